"""Entry point: `torchrun --nproc_per_node=N train.py [hydra overrides]`."""

import sys
import time

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

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
        values = OmegaConf.to_container(raw, resolve=True)
        sweep_job_dump_dir(values, launch)
        cfg = from_dict(values)
        dims = validate(cfg, launch.world_size)
        run(cfg, launch, dims)
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
