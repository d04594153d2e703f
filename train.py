"""Entry point: `torchrun --nproc_per_node=N train.py [hydra overrides]`."""

from trainer.resilience import early_signals

early_signals.hold()  # before the imports: seconds in which a scheduler's warning would be dropped

import signal
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.plugins import Plugins
from hydra.types import RunMode
from omegaconf import DictConfig
from torch.distributed import DistBackendError
from torch.distributed.elastic.multiprocessing.errors import record

from parallel.comm import CommTimeout
from parallel.errors import ConfigError
from parallel.launch_env import LaunchEnv
from planner.dry_run import dry_run, planned_world
from trainer.config.cli import RANK0_FIRST_S, check_overrides, exit_on_bad_input, linger, resolved
from trainer.config.hf_model import fill_hf_model
from trainer.config.rules import validate
from trainer.config.schema import from_dict
from trainer.resilience.preemption import check_stop_signal_reaches_workers
from trainer.run import run

PEERS_TIME_OUT_S = 3.0


def sweep_job_dump_dir(raw: dict, launch: LaunchEnv) -> None:
    """Hydra multirun (-m): each job of the sweep trains in its own {dump_dir}/{job number}, never in a
    folder another job of the sweep resumes from. Under torchrun every worker would run the whole sweep
    through one rendezvous: refused, one torchrun per sweep point instead."""
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode != RunMode.MULTIRUN:
        return
    if launch.torchrun:
        raise ConfigError("hydra multirun (-m) cannot run under torchrun: run `python train.py -m "
                          "hydra/launcher=torchrun hydra.launcher.nproc_per_node=N ...`, one torchrun per sweep point")
    raw["dump_dir"] = f"{raw['dump_dir']}/{hydra_cfg.job.num}"


def refuse_a_launcher_without_a_sweep() -> None:
    """hydra/launcher and its keys choose how a sweep launches its points; without -m hydra ignores them,
    and a command meant to run N ranks per point would train as one process, on another global batch."""
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode == RunMode.MULTIRUN:
        return
    given = [o for o in hydra_cfg.overrides.hydra if o.lstrip("+").startswith(("hydra/launcher", "hydra.launcher"))]
    if given:
        raise ConfigError(f"{given[0]} picks how a sweep (-m) launches its points; without -m it changes nothing and "
                          "this would train as one process: add -m, or launch with torchrun")


class Terminated(BaseException):
    """SIGTERM (torchrun passing on its own, a scheduler cancelling the job): like Ctrl-C, not an error
    that `except Exception` may swallow."""


def raise_terminated(signum: int, frame: object) -> None:
    raise Terminated


@hydra.main(config_path="conf", config_name="config", version_base=None)
def main(raw: DictConfig) -> None:
    launch = LaunchEnv.from_torchrun()
    signal.signal(signal.SIGTERM, raise_terminated)
    try:
        train_or_exit(raw, launch)
    except Exception as e:
        # A failure of this rank alone (torchrun stops the others): one line with its rank; the traceback
        # is in torchrun's failure summary, from the error file @record wrote. A collective broken by a
        # peer that died first is only the echo of that failure: torchrun stops this rank while it waits.
        if lost_a_peer(e):
            linger(RANK0_FIRST_S)
        print(f"error: rank {launch.rank}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        if isinstance(e, CommTimeout):
            # Every rank waiting in the stalled collective times out, each by its own clock: stay a moment,
            # or torchrun stops the peers whose timeout fires just after this one before they can say so.
            linger(PEERS_TIME_OUT_S)
        sys.exit(1)


def lost_a_peer(e: Exception) -> bool:
    """A communication error because another rank went away (gloo's and NCCL's wordings)."""
    text = str(e)
    return isinstance(e, DistBackendError) or "remote worker" in text or "Connection closed by peer" in text


@record
def train_or_exit(raw: DictConfig, launch: LaunchEnv) -> None:
    """Train; expected failures exit with one line (SystemExit passes @record by), anything else
    escapes and @record writes it, traceback and all, to the error file torchrun names."""
    try:
        values = resolved(raw)
        refuse_a_launcher_without_a_sweep()
        sweep_job_dump_dir(values, launch)
        cfg = from_dict(fill_hf_model(values))
        dims = validate(cfg, planned_world(cfg, launch))
        check_stop_signal_reaches_workers(cfg.stop_signal, launch)
        if cfg.dry_run:
            dry_run(cfg, launch, dims)
            return
        run(cfg, launch, dims)
    except (ConfigError, FloatingPointError) as e:
        # Ranks see the same bad input (or the same reduced gradient norm).
        exit_on_bad_input(str(e), launch, code=2 if isinstance(e, ConfigError) else 3)
    except (KeyboardInterrupt, Terminated) as e:
        terminated = isinstance(e, Terminated)
        if launch.rank == 0:
            # torchrun's SIGTERM looks the same whether a peer failed or torchrun itself was stopped.
            why = ("stopped by SIGTERM (torchrun sends it to every worker when one of them fails or when it is "
                   "stopped itself)" if terminated else "interrupted")
            print(f"{why}: stopped before the next checkpoint; a restart resumes from the newest one (with none "
                  "yet, start again in a new dump_dir)", file=sys.stderr, flush=True)
        sys.exit(128 + signal.SIGTERM if terminated else 130)


def register_sweep_launchers() -> None:
    """hydra/launcher=torchrun | torchrun_slurm live in the installed hydra_plugins.llm_trainer, which an
    editable install hides from hydra's plugin scan. A checkout run without installing the project
    trains as usual; only those launchers are then unknown to hydra."""
    try:
        from hydra_plugins.llm_trainer import TorchrunLauncher
    except ImportError:
        return
    Plugins.instance().register(TorchrunLauncher)


if __name__ == "__main__":
    register_sweep_launchers()
    check_overrides(sys.argv[1:], LaunchEnv.from_torchrun())
    main()
