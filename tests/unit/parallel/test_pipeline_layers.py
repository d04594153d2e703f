"""Layers per pipeline stage: even splits, adjusted first and last stages (with and without virtual
stages), and the splits that are refused in one line."""

import pytest

from parallel.errors import ConfigError
from parallel.pipeline.layers import check_virtual_split, chunk_layers, stage_layer_counts, virtual_stages
from trainer.config.rules import validate
from trainer.config.schema import from_dict


def _layers(n_layers, pp, vpp, first=None, last=None) -> dict[tuple[int, int], list[int]]:
    return {(rank, chunk): list(chunk_layers(n_layers, pp, vpp, rank, chunk, first, last))
            for rank in range(pp) for chunk in range(vpp)}


def test_chunks_cover_every_layer_once_in_stage_order():
    """Stage s = chunk * pp + rank holds layer block s."""
    for pp, vpp, n_layers, first, last in ((2, 1, 4, None, None), (2, 2, 8, None, None), (3, 2, 12, None, None),
                                           (4, 3, 24, None, None), (4, 1, 6, 1, 1), (4, 2, 14, 1, 1), (3, 1, 7, 3, None)):
        layers = _layers(n_layers, pp, vpp, first, last)
        by_stage = [layers[(s % pp, s // pp)] for s in range(pp * vpp)]
        assert [i for block in by_stage for i in block] == list(range(n_layers))
    assert list(chunk_layers(8, 2, 2, rank=1, chunk=1)) == [6, 7]  # stage 3 of 4


def test_first_and_last_stages_take_their_own_counts():
    assert stage_layer_counts(6, 4, 1, 1, 1) == (1, 2, 2, 1)
    assert stage_layer_counts(10, 4, 1, first=1) == (1, 3, 3, 3)
    assert stage_layer_counts(9, 4, 1, last=3) == (2, 2, 2, 3)
    assert stage_layer_counts(5, 2, 1, 2, 3) == (2, 3)
    assert _layers(6, 4, 1, 1, 1) == {(0, 0): [0], (1, 0): [1, 2], (2, 0): [3, 4], (3, 0): [5]}


def test_virtual_stages_adjust_the_first_chunk_of_rank_0_and_the_last_chunk_of_the_last_rank():
    """num_layers_per_virtual_pipeline_stage=L: every other chunk holds L layers; the chunk count counts
    the adjusted ends as stages."""
    assert virtual_stages(14, 4, 2, 1, 1) == 2 and virtual_stages(16, 4, 2) == 2 and virtual_stages(6, 4, None, 1, 1) == 1
    check_virtual_split(14, 4, 2, 1, 1)
    assert stage_layer_counts(14, 4, 2, 1, 1) == (1, 2, 2, 2, 2, 2, 2, 1)
    layers = _layers(14, 4, 2, 1, 1)
    assert layers[(0, 0)] == [0] and layers[(3, 1)] == [13] and layers[(0, 1)] == [7, 8]
    assert stage_layer_counts(6, 2, 2, first=1, last=1) == (1, 2, 2, 1)


@pytest.mark.parametrize("n_layers, pp, vpp, first, last, message", [
    (6, 4, 1, 3, 3, "the other 2 stages would share 0 layers"),
    (6, 4, 1, 1, 2, "the other 2 stages would share 3 layers"),
    (6, 4, 1, 0, None, "every stage needs the same count of at least one layer"),
    (6, 2, 1, 2, 3, "the other 0 stages would share 1 layers"),
    (6, 1, 1, 2, None, "need at least 2 pipeline stages"),
])
def test_splits_that_do_not_add_up_are_one_line(n_layers, pp, vpp, first, last, message):
    with pytest.raises(ConfigError, match=message) as err:
        stage_layer_counts(n_layers, pp, vpp, first, last)
    assert "\n" not in str(err.value)


def test_virtual_splits_that_do_not_fill_whole_chunks_are_one_line():
    for n_layers, pp, per_stage, first, last in ((13, 4, 2, 1, 1), (16, 4, 2, 1, 1), (1, 2, 1, 1, 1)):
        with pytest.raises(ConfigError, match="num_layers_per_virtual_pipeline_stage=") as err:
            check_virtual_split(n_layers, pp, per_stage, first, last)
        assert "pipeline_first_stage_layers" in str(err.value) and "\n" not in str(err.value)
    # The adjusted ends take every layer: the key would size no stage (it was accepted and unused).
    with pytest.raises(ConfigError, match="leaves no layer for stages of num_layers_per_virtual_pipeline_stage=3"):
        check_virtual_split(2, 2, 3, 1, 1)


def _config(**overrides):
    model = {"name": "tiny", "n_layers": 6, "dim": 32, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 64, "multiple_of": 16}
    return from_dict({"model": model | overrides.pop("model", {}), "seq_len": 8, "batch_size": 4} | overrides)


def test_the_config_validates_uneven_layouts_and_names_the_keys():
    validate(_config(pipeline_parallel_size=4, pipeline_first_stage_layers=1, pipeline_last_stage_layers=1), 4)
    cfg = _config(model={"n_layers": 14}, pipeline_parallel_size=4, pipeline_first_stage_layers=1,
                  pipeline_last_stage_layers=1, num_layers_per_virtual_pipeline_stage=2)
    validate(cfg, 4)
    assert cfg.virtual_pipeline_stages == 2
    with pytest.raises(ConfigError, match="pipeline_first_stage_layers=1 and pipeline_last_stage_layers=2"):
        validate(_config(pipeline_parallel_size=4, pipeline_first_stage_layers=1, pipeline_last_stage_layers=2), 4)
    with pytest.raises(ConfigError, match="num_layers_per_virtual_pipeline_stage=2"):
        validate(_config(model={"n_layers": 16}, pipeline_parallel_size=4, pipeline_first_stage_layers=1,
                         pipeline_last_stage_layers=1, num_layers_per_virtual_pipeline_stage=2), 4)
    with pytest.raises(ConfigError, match="pipeline_first_stage_layers=0 must be > 0"):
        validate(_config(pipeline_parallel_size=2, pipeline_first_stage_layers=0), 2)
