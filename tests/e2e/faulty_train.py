"""train.py with one worker killed (SIGKILL) at a chosen point, for tests that break things on purpose.

    python -m torch.distributed.run ... tests/e2e/faulty_train.py POINT:STEP:RANK [hydra overrides]

POINT is where in step STEP worker RANK dies:
  step_start   as the step begins
  backward     at the step's first gradient reduce-scatter (inside autograd)
  optimizer    before the optimizer update
  save_shards  right after this rank's own checkpoint shard is written (others may still be writing)
  save_rename  after the manifest is written, before the folder is renamed into place (rank 0 writes it)
(the save points go by the checkpoint's folder, so with checkpoint.async_save they fire in the
background thread, while the next steps run)
or, with POINT `write_error`, worker RANK does not die: its shard write of step STEP's checkpoint fails
as on a full disk (ENOSPC), also in checkpoint.async_save's background thread;
or, with POINT `stall`, worker RANK does not die but sleeps for a minute at step STEP's first gradient
reduce-scatter, so its peers wait in that collective (it prints `stalling at <unix time>` first);
with POINT `halt` and RANK `all`, every worker raises FloatingPointError as step STEP begins, as an
agreed nan_policy=halt stop does; with POINT `signal_then_die` (STEP ignored), worker RANK sends itself
SIGUSR1 as its data preparation begins, long before its first step, and dies once the stopped job has
saved and written stopped.json; `signal_then_die_saving` likewise, but it dies in the stop's save, once
its own shard is written.
The fault fires in the first attempt only (TORCHELASTIC_RESTART_COUNT=0): a group torchrun restarts
runs clean. The product has no fault switches; this file patches the functions it names.
"""

import errno
import os
import runpy
import signal
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

POINTS = ("step_start", "backward", "optimizer", "save_shards", "save_rename")
STALL_S = 60.0


def die(where: str) -> None:
    sys.stderr.write(f"faulty_train: killing rank {os.environ.get('RANK')} at {where}\n")
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _saving(folder: object, step: int) -> bool:
    """Whether `folder` is where step `step`'s checkpoint is being written: by folder, not by the step
    counter, as a background save runs after the step loop moved on."""
    return Path(str(folder)).name == f".tmp_step_{step}"


def arm(point: str, step: int) -> None:
    from torch.distributed.checkpoint import FileSystemWriter

    from parallel import comm
    from trainer import optimizer
    from trainer.checkpoint import files as checkpoint
    from trainer.step import StepRunner

    current = {"step": 0}
    train_step = StepRunner.train_step

    def counting_train_step(self, s):
        current["step"] = s
        if point == "step_start" and s == step:
            die(f"{point}:{step}")
        if point == "halt" and s == step:
            raise FloatingPointError(f"step {s}: non-finite gradient (faulty_train)")
        return train_step(self, s)

    StepRunner.train_step = counting_train_step
    if point in ("signal_then_die", "signal_then_die_saving"):
        from trainer import trainer

        build_data, train = trainer.build_data, trainer.Trainer.train

        def signalled_build_data(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGUSR1)
            return build_data(*args, **kwargs)

        def train_then_die(*args, **kwargs):
            train(*args, **kwargs)
            die(f"{point} after the stop")

        trainer.build_data = signalled_build_data
        if point == "signal_then_die":
            trainer.Trainer.train = train_then_die
        else:
            write_data = FileSystemWriter.write_data

            def write_then_die(self, plan, planner):
                write_data(self, plan, planner).wait()
                die(f"{point} in the stop's save")

            FileSystemWriter.write_data = write_then_die
    if point == "stall":
        reduce_scatter = comm.reduce_scatter_tensor

        def stalling_reduce_scatter(*args, **kwargs):
            if current["step"] == step:
                sys.stderr.write(f"faulty_train: stalling at {time.time()}\n")
                sys.stderr.flush()
                time.sleep(STALL_S)
            return reduce_scatter(*args, **kwargs)

        comm.reduce_scatter_tensor = stalling_reduce_scatter
    wrap = {
        "backward": (comm, "reduce_scatter_tensor", lambda *a, **k: current["step"] == step),
        "optimizer": (optimizer.NamedAdamW, "step", lambda *a, **k: current["step"] == step),
    }
    if point in wrap:
        owner, name, when = wrap[point]
        original = getattr(owner, name)

        def faulty(*args, **kwargs):
            if when(*args, **kwargs):
                die(f"{point}:{step}")
            return original(*args, **kwargs)

        setattr(owner, name, faulty)
    elif point == "save_shards":
        write_data = FileSystemWriter.write_data

        def write_then_die(self, plan, planner):
            future = write_data(self, plan, planner)
            if _saving(self.path, step):
                future.wait()
                die(f"{point}:{step}")
            return future

        FileSystemWriter.write_data = write_then_die
    elif point == "write_error":
        write_data = FileSystemWriter.write_data

        def full_disk(self, plan, planner):
            if _saving(self.path, step):
                raise OSError(errno.ENOSPC, "No space left on device (faulty_train)")
            return write_data(self, plan, planner)

        FileSystemWriter.write_data = full_disk
    elif point == "save_rename":
        replace = os.replace

        def replace_or_die(src, dst):
            if _saving(src, step):
                die(f"{point}:{step}")
            return replace(src, dst)

        checkpoint.os.replace = replace_or_die


def main() -> None:
    point, step, rank = sys.argv[1].split(":")
    assert point in (*POINTS, "stall", "halt", "signal_then_die", "signal_then_die_saving", "write_error"), point
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and rank in ("all", os.environ.get("RANK")):
        arm(point, int(step))
    sys.argv = [str(REPO / "train.py"), *sys.argv[2:]]
    runpy.run_path(str(REPO / "train.py"), run_name="__main__")


if __name__ == "__main__":
    main()
