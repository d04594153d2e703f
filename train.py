"""Entry point: `torchrun --nproc_per_node=N train.py [hydra overrides]`."""

import sys
import time

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from torch.distributed import DistBackendError
from torch.distributed.elastic.multiprocessing.errors import record

from parallel.errors import ConfigError
from parallel.mesh import LaunchEnv
from trainer.config import from_dict
from trainer.run import run
from trainer.validate import validate

RANK0_FIRST_S = 2.0


def sweep_job_dump_dir(raw: dict, launch: LaunchEnv) -> None:
    """Hydra multirun (-m): each job of the sweep trains in its own {dump_dir}/{job number}, never in a
    folder another job of the sweep resumes from. Under torchrun every worker would run the whole sweep
    through one rendezvous: refused, one torchrun per sweep point instead."""
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode != RunMode.MULTIRUN:
        return
    if launch.torchrun:
        raise ConfigError("hydra multirun (-m) cannot run under torchrun: start one torchrun per sweep point")
    raw["dump_dir"] = f"{raw['dump_dir']}/{hydra_cfg.job.num}"


@hydra.main(config_path="conf", config_name="config", version_base=None)
def main(raw: DictConfig) -> None:
    launch = LaunchEnv.from_torchrun()
    try:
        train_or_exit(raw, launch)
    except Exception as e:
        # A failure of this rank alone (torchrun stops the others): one line with its rank; the traceback
        # is in torchrun's failure summary, from the error file @record wrote. A collective broken by a
        # peer that died first is only the echo of that failure: torchrun stops this rank while it waits.
        if lost_a_peer(e):
            time.sleep(RANK0_FIRST_S)
        print(f"error: rank {launch.rank}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
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
        values = OmegaConf.to_container(raw, resolve=True)
        sweep_job_dump_dir(values, launch)
        cfg = from_dict(values)
        run(cfg, launch, validate(cfg, launch.world_size))
    except (ConfigError, FloatingPointError) as e:
        # Ranks see the same bad input (or the same reduced gradient norm); one line from rank 0 is the
        # message, every rank exits non-zero. The others leave a moment later: torchrun stops the whole
        # group as soon as one worker exits, which could kill rank 0 before it has printed.
        if launch.rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        else:
            time.sleep(RANK0_FIRST_S)
        sys.exit(2 if isinstance(e, ConfigError) else 3)
    except KeyboardInterrupt:
        if launch.rank == 0:
            print("interrupted: stopped before the next checkpoint; a restart resumes from the newest one",
                  file=sys.stderr, flush=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
