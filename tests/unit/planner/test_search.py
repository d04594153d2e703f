"""The layout search's rows against the trainer: every row passes validate() as the run of it would (its
real microbatch count, its switches), its memory is the dry run's over the step's real program, and the
overrides it prints compose to the very config it ranked."""

import dataclasses

import pytest

from planner.config import compose_config
from planner.devices import load_device
from planner.dry_run import plan
from planner.search import Candidate, plan_layouts
from scripts import plan as plan_script
from scripts.plan import launch_overrides
from trainer.config.ranges import MAX_MICROBATCHES
from trainer.config.rules import validate

GIB = 2**30


def test_each_rows_peak_is_the_dry_runs_over_the_real_program():
    """Interleaved 1F1B with 13 microbatches on 4 stages keeps more in flight than its first 8 would:
    the dry run of each row (train.py dry_run=true with the row's overrides) predicts the row's peak."""
    base = compose_config(["model=llama3_8b", "seq_len=4096"])
    rows = plan_layouts(base, 4, 13, load_device("h100"), 70 * GIB, 30)
    assert any(c.dims.pp == 4 and c.cfg.virtual_pipeline_stages > 1 for c in rows)
    for c in rows:
        assert c.peak_bytes == plan(c.cfg, c.dims)["memory"]["peak_bytes"], c.overrides()


def test_rows_obey_the_rules_that_read_the_real_microbatch_count():
    """32768 sequences on one device: microbatches of 1 would be more than MAX_MICROBATCHES a step, which
    validate() refuses; the rows are the layouts it accepts."""
    base = compose_config(["model=tiny", "seq_len=64"])
    rows = plan_layouts(base, 1, 2 * MAX_MICROBATCHES, load_device("h100"), 70 * GIB, 100)
    assert rows and all(c.cfg.num_microbatches <= MAX_MICROBATCHES for c in rows)
    for c in rows:
        validate(c.cfg, 1)


def test_rows_obey_the_rules_that_read_the_variant():
    """optimize_backward_concat=true refuses grad_reduce=per_microbatch: the last_microbatch variants
    remain."""
    base = compose_config(["model=llama3_8b", "seq_len=8192", "optimize_backward_concat=true"])
    rows = plan_layouts(base, 8, 8, load_device("h100"), 70 * GIB, 5)
    assert len(rows) == 5 and {c.cfg.grad_reduce for c in rows} == {"last_microbatch"}
    for c in rows:
        validate(c.cfg, 8)


def test_a_rows_overrides_compose_the_config_it_ranked():
    """The overrides given (less the layout keys the row sets), then the row's: train.py composes them
    into the ranked config (the planner's copy is a dry run)."""
    given = ["model=llama3_8b", "seq_len=8192", "model_parallel_size=4", "optim.lr=1e-4", "dry_run=true"]
    for c in plan_layouts(compose_config(given), 8, 8, load_device("h100"), 70 * GIB, 3):
        launched = compose_config(launch_overrides(given, c))
        assert not launched.dry_run and launched.optim.lr == 1e-4
        assert dataclasses.replace(launched, dry_run=True) == c.cfg
        validate(launched, 8)


def test_the_default_budget_keeps_a_reserve(capsys):
    """Llama 3 8B at seq 9216, FSDP over 8 without checkpointing, fits the H100's nominal 80 GiB but not the
    default budget, 80 GiB less 5% and 3 GiB. scripts/plan.py plans for the budget unless told another. At
    seq 8192 it fits the budget: the loss's scratch is the bf16 logits' bytes (8192 x 128256 x 2), no
    longer twice the fp32 logits', which tipped it over."""
    h100 = load_device("h100")

    def fsdp_only(seq: int, budget: int) -> list[Candidate]:
        base = compose_config(["model=llama3_8b", f"seq_len={seq}"])
        return [c for c in plan_layouts(base, 8, 8, h100, budget, 40)
                if (c.dims.tp, c.dims.cp, c.dims.pp, c.cfg.model.layer_ckpt) == (1, 1, 1, "none")]

    nominal = fsdp_only(9216, h100.memory_bytes)
    assert nominal and all(h100.budget_bytes < c.peak_bytes <= h100.memory_bytes for c in nominal)
    assert not fsdp_only(9216, h100.budget_bytes)
    fitting = fsdp_only(8192, h100.budget_bytes)
    assert fitting
    stage = plan(fitting[0].cfg, fitting[0].dims)["memory"]["per_stage"][0]
    assert stage["categories"]["loss_buffers"] == pytest.approx(8192 * 128256 * 2, rel=1e-3)
    assert plan_script.main(["model=tiny", "--world", "1", "--top", "1"]) == 0
    assert capsys.readouterr().out.startswith("1 x h100, 73.0 GiB each")


@pytest.mark.parametrize("argv, line", [
    (["--world", "4", "--mem-gib", "0"], "argument --mem-gib: must be a finite number > 0, got 0"),
    (["--world", "4", "--mem-gib", "nan"], "argument --mem-gib: must be a finite number > 0, got nan"),
    (["--world", "4", "--gpus-per-node", "0"], "argument --gpus-per-node: must be a finite number > 0, got 0"),
    (["--world", "4", "--top", "0"], "argument --top: must be a finite number > 0, got 0"),
])
def test_a_flag_out_of_range_is_refused_not_ignored(argv: list[str], line: str, capsys) -> None:
    with pytest.raises(SystemExit) as stopped:
        plan_script.main(argv)
    assert stopped.value.code == 2 and line in capsys.readouterr().err


@pytest.mark.parametrize("override, line", [
    ("compute_dtype=fp16", "error: compute_dtype=fp16 is not one of: null | bf16 | fp32"),
    ("optim.lr=-1", "error: optim.lr=-1.0 must be >= 0"),  # its own line, not every layout's refusal
])
def test_a_bad_config_value_is_its_own_line(override: str, line: str, capsys) -> None:
    assert plan_script.main(["--world", "4", override]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == line
