"""torchrun train.py end to end: loss falls, layouts agree, resume and determinism are bitwise."""

import math

import pytest

from tests.e2e.launch import losses, metrics, train_ok

# Small and quick: tiny model, short sequences, a warmup short enough for the loss to move in 6 steps.
FAST = ("model=tiny", "seq_len=64", "optim.warmup_steps=1", "optim.lr=1e-2", "log_all_steps=true")
CONTRACT_FIELDS = {"step", "loss", "grad_norm", "lr", "tokens_per_s", "step_time_s", "tflops", "mem_peak_gib", "comm"}


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory):
    """The same global batch (4 sequences) on dp=1, 2 and 4 ranks, 6 steps each."""
    runs = {}
    for nproc, batch in ((1, 4), (2, 2), (4, 1)):
        dump = tmp_path_factory.mktemp(f"dp{nproc}")
        runs[nproc] = train_ok(nproc, dump, *FAST, "steps=6", f"batch_size={batch}")
    return runs


def test_loss_falls_on_1_2_4_ranks(layout_runs):
    for nproc, records in layout_runs.items():
        assert [r["step"] for r in records] == list(range(1, 7))
        assert records[-1]["loss"] < records[0]["loss"] - 0.3, (nproc, [r["loss"] for r in records])


def test_layouts_give_the_same_losses(layout_runs):
    reference = losses(layout_runs[1])
    for nproc in (2, 4):
        for step, loss in losses(layout_runs[nproc]).items():
            assert math.isclose(loss, reference[step], rel_tol=1e-5), (nproc, step, loss, reference[step])


def test_metrics_contract(layout_runs):
    for nproc, records in layout_runs.items():
        for r in records:
            assert CONTRACT_FIELDS <= r.keys()
            assert isinstance(r["loss"], float) and r["tokens_per_s"] > 0 and r["tflops"] > 0
        # Per step with FSDP (ZeRO-3 by default) over 4 units and M microbatches: 2M all-gathers and one
        # reduce-scatter per unit, plus the grad-norm and loss all-reduces; nothing without peers.
        units, m = 4, 4 // nproc
        expected = {} if nproc == 1 else {"all_gather": units * 2 * m, "reduce_scatter": units, "all_reduce": 2}
        assert {op: v["count"] for op, v in records[-1]["comm"].items()} == expected


def test_resume_is_bitwise(tmp_path):
    straight = losses(train_ok(2, tmp_path / "straight", *FAST, "steps=6", "batch_size=2"))
    resumed_dir = tmp_path / "resumed"
    # The first job stops at step 3 of the same 6-step LR schedule, as a preempted job would.
    train_ok(2, resumed_dir, *FAST, "steps=3", "optim.decay_steps=6", "batch_size=2", "checkpoint.freq=3")
    assert (resumed_dir / "checkpoints" / "step_3" / "manifest.json").is_file()
    train_ok(2, resumed_dir, *FAST, "steps=6", "batch_size=2", "checkpoint.freq=3")
    resumed = losses(metrics(resumed_dir))
    for step in (4, 5, 6):
        assert resumed[step] == straight[step], (step, resumed[step], straight[step])


def test_deterministic_runs_are_bitwise_identical(tmp_path):
    args = (*FAST, "steps=4", "batch_size=4", "microbatch_size=2", "enable_deterministic_training=true")
    first = losses(train_ok(2, tmp_path / "a", *args))
    second = losses(train_ok(2, tmp_path / "b", *args))
    assert first == second
