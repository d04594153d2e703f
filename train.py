"""Entry point: `torchrun --nproc_per_node=N train.py [hydra overrides]`."""

import sys

import hydra
from omegaconf import DictConfig, OmegaConf

from parallel.errors import ConfigError
from parallel.mesh import LaunchEnv
from trainer.config import from_dict
from trainer.run import run
from trainer.validate import validate


@hydra.main(config_path="conf", config_name="config", version_base=None)
def main(raw: DictConfig) -> None:
    launch = LaunchEnv.from_torchrun()
    try:
        cfg = from_dict(OmegaConf.to_container(raw, resolve=True))
        dims = validate(cfg, launch.world_size)
        run(cfg, launch, dims)
    except (ConfigError, FloatingPointError) as e:
        # Ranks see the same bad input (or the same reduced gradient norm); one line from rank 0 is the
        # message, every rank exits non-zero.
        if launch.rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2 if isinstance(e, ConfigError) else 3)


if __name__ == "__main__":
    main()
