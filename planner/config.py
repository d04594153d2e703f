"""The config train.py would run with a list of hydra overrides, composed the same way (conf/, the
override check), for tools that plan without launching."""

from hydra import compose, initialize_config_dir

from parallel.launch_env import LaunchEnv
from trainer.config.cli import CONF_DIR, check_overrides, resolved
from trainer.config.hf_model import fill_hf_model
from trainer.config.rules import check_model_config
from trainer.config.schema import TrainConfig, from_dict


def compose_config(overrides: list[str]) -> TrainConfig:
    """The config, its values in range: a bad one is its own line, not every layout's refusal."""
    check_overrides(overrides, LaunchEnv.from_torchrun(), hydra_flags=False)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        raw = compose(config_name="config", overrides=overrides)
    cfg = from_dict(fill_hf_model(resolved(raw)))
    check_model_config(cfg)
    return cfg
