"""The one torchrun command line every launcher uses (the Slurm batch script, submitit, TorchX).

    python scripts/launch_command.py --nnodes N --nproc-per-node P --rdzv-endpoint HOST:PORT \
        --rdzv-id ID [--dump-dir DIR] [--max-restarts N] -- [hydra overrides]

prints it shell-quoted. Overrides pass through unchanged; a default `dump_dir` and `stop_signal=USR1`
(checkpoint and exit on Slurm's warning signal) are added unless the overrides set them.

The rendezvous port of a job is 29500 + job id % 3000: below Linux's ephemeral ports (32768 up), and
the same for two jobs on one head node only when their ids differ by a multiple of 3000.
"""

import argparse
import os
import shlex
import socket
import sys
from pathlib import Path

DEFAULT_STOP_SIGNAL = "USR1"
REPO = Path(__file__).resolve().parents[1]


def rendezvous_port(job_id: str | int) -> int:
    return 29500 + int(job_id) % 3000


def ranks_per_node(nproc_per_node: int | None, gpus_per_node: int | None) -> int:
    """Ranks per node: as given, else one per GPU, else 1 (the batch script's rule too)."""
    return nproc_per_node if nproc_per_node is not None else max(gpus_per_node or 0, 1)


def positive_int(text: str) -> int:
    """argparse type of node and rank counts."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def override_key(override: str) -> str:
    """The config key a hydra override sets (`key=v`, `+key=v`, `++key=v`)."""
    return override.split("=", 1)[0].lstrip("+~")


def torchrun_args(nnodes: int, nproc_per_node: int, rdzv_endpoint: str, rdzv_id: str, overrides: list[str],
                  dump_dir: str | None = None, python: str = "python", stop_signal: str = DEFAULT_STOP_SIGNAL,
                  max_restarts: int = 0) -> list[str]:
    """argv of torchrun on one node, running train.py with the overrides; `max_restarts`: torchrun
    restarts the whole group that often when a worker dies (the run resumes from its newest checkpoint)."""
    if nnodes < 1 or nproc_per_node < 1 or max_restarts < 0:
        raise ValueError(f"nnodes={nnodes} and nproc_per_node={nproc_per_node} must be at least 1, "
                         f"max_restarts={max_restarts} at least 0")
    given = {override_key(o) for o in overrides if "=" in o}
    extra = [] if dump_dir is None or "dump_dir" in given else [f"dump_dir={dump_dir}"]
    extra += [] if "stop_signal" in given else [f"stop_signal={stop_signal}"]
    return [
        python, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc_per_node={nproc_per_node}",
        *([f"--max-restarts={max_restarts}"] if max_restarts else []),
        "--rdzv_backend=c10d", f"--rdzv_endpoint={rdzv_endpoint}", f"--rdzv_id={rdzv_id}",
        str(REPO / "train.py"), *extra, *overrides,
    ]


def dump_dir_of(overrides: list[str], default: str | None) -> str:
    """Where the run writes, as the trainer will see it: the config composed with the overrides (`default`
    first when none sets dump_dir), so quoting and interpolations (`${oc.env:SCRATCH}/run`) are resolved."""
    from hydra import compose, initialize_config_dir

    if default is not None and "dump_dir" not in {override_key(o) for o in overrides if "=" in o}:
        overrides = [f"dump_dir={hydra_quoted(default)}", *overrides]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        return os.path.expanduser(str(compose(config_name="config", overrides=overrides).dump_dir))  # as the trainer


def hydra_quoted(value: str) -> str:
    """`value` as one hydra override value, whatever it holds (spaces, commas, brackets, quotes)."""
    return "'" + value.replace("'", "\\'") + "'"


def free_port() -> int:
    """A port free on this machine now, for a one-node rendezvous that must not meet another job's."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nnodes", type=positive_int, required=True)
    parser.add_argument("--nproc-per-node", type=positive_int, required=True)
    parser.add_argument("--rdzv-endpoint", required=True)
    parser.add_argument("--rdzv-id", required=True)
    parser.add_argument("--dump-dir")
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--max-restarts", type=int, default=0)
    parser.add_argument("overrides", nargs="*")
    opts = parser.parse_args()
    argv = torchrun_args(opts.nnodes, opts.nproc_per_node, opts.rdzv_endpoint, opts.rdzv_id, opts.overrides,
                         opts.dump_dir, opts.python, max_restarts=opts.max_restarts)
    print(shlex.join(argv))


if __name__ == "__main__":
    main()
