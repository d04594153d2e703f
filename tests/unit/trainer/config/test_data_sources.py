"""`data.source` as a list and `data.weights`: hydra's list syntax reaches the config, and every misfit
between the two is one line naming the key."""

import os

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from parallel.errors import ConfigError
from parallel.launch_env import LaunchEnv
from tests import REPO
from trainer.config.cli import check_overrides
from trainer.config.rules import validate
from trainer.config.schema import TrainConfig, from_dict


def load(*overrides: str) -> TrainConfig:
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        raw = compose(config_name="config", overrides=list(overrides))
    return from_dict(OmegaConf.to_container(raw, resolve=True))


def test_a_list_of_sources_and_weights_reach_the_config() -> None:
    cfg = load("data.source=[/data/web,'~/books',stdlib]", "data.weights=[0.5,0.3,0.2]")
    assert cfg.data.source == ["/data/web", os.path.expanduser("~/books"), "stdlib"]
    assert cfg.data.sources == cfg.data.source and cfg.data.weights == [0.5, 0.3, 0.2]
    validate(cfg, world_size=1)
    assert load().data.sources == ["stdlib"] and load("data.source=null").data.sources == [None]
    assert load("data.source=[a,b]", "data.weights=[1,0]").data.weights == [1.0, 0.0]  # integers are weights too


@pytest.mark.parametrize("overrides, message", [
    (["data.source=[a,b]", "data.weights=[0.8]"],
     "data.weights has 1 weights for the 2 sources of data.source; give one per source, in the same order"),
    (["data.source=[a,b]", "data.weights=[0.8,0.1,0.1]"], "data.weights has 3 weights for the 2 sources"),
    (["data.source=[a,b]", "data.weights=[0.8,-0.2]"], "data.weights[1]=-0.2 must be >= 0"),
    (["data.source=[a,b]", "data.weights=[0,0]"],
     "data.weights=[0.0, 0.0] are all 0: at least one source needs a positive weight"),
    (["data.source=a", "data.weights=[1]"], "data.weights=[1.0] with a single data.source has nothing to blend; "
                                           "leave it null"),
    (["data.weights=[1]"], "data.weights=[1.0] with a single data.source has nothing to blend"),
    (["data.source=[a,b,./a]"], "data.source names ./a twice (data.source[0] and data.source[2])"),
    (["data.source=[stdlib,b,stdlib]"], "data.source names stdlib twice (data.source[0] and data.source[2])"),
    (["data.source=[]"], "data.source=[] names no source"),
    (["data.source=[a,null]"], "data.source[1] must not be null"),
    (["data.source=[a,'']"], "data.source[1] is an empty string"),
    (["data.source=[a,b]", "data.weights=[x,1]"], "data.weights[0]='x' must be float"),
    (["data.source=[a,b]", "data.weights=0.5"], "data.weights=0.5 must be list or null"),
])
def test_sources_and_weights_that_do_not_fit_are_one_line(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        validate(load(*overrides), world_size=1)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_an_unquoted_tilde_in_a_list_of_sources_says_to_quote_the_path(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        check_overrides(["data.source=[~/web,/data/code]"], LaunchEnv(rank=0, local_rank=0, world_size=1,
                                                                       torchrun=False, run_id="t"))
    assert exit_.value.code == 2
    assert capsys.readouterr().err == (
        "error: data.source=[~/web,/data/code]: `~` must be quoted or expanded by the shell, e.g. "
        "data.source=['~/web',/data/code] (the trainer expands a leading ~ in its path keys)\n")
    assert load("data.source=['~/web',/data/code]").data.source == [os.path.expanduser("~/web"), "/data/code"]
