"""torchrun train.py end to end: loss falls, layouts agree, resume and determinism are bitwise."""

import math
import shutil

import pytest

from scripts.compare_runs import main as compare_runs
from tests.e2e.launch import died_before_saving, losses, metrics, train_ok

# Small and quick: tiny model, short sequences, a warmup short enough for the loss to move in 6 steps;
# as many KV heads as heads, so that tp=4 (the resharding test) divides them.
FAST = ("model=tiny", "seq_len=64", "optim.warmup_steps=1", "optim.lr=1e-2", "log_all_steps=true", "model.n_kv_heads=4")
# metrics.jsonl's contract: every record has these (eval_loss only on evaluation steps); mfu and
# mfu_compute are null without a known device peak (CPU).
CONTRACT_FIELDS = {"step", "loss", "grad_norm", "lr", "tokens_per_s", "step_time_s", "tflops", "tflops_compute",
                   "comm_wait_s", "mfu", "mfu_compute", "mem_peak_gib", "comm", "skipped_steps", "wall_time"}


LAYOUTS = {  # name: (ranks, overrides); every layout sees the same 4-sequence global batch
    "dp1": (1, ("batch_size=4",)),
    # Also test_deterministic_runs_are_bitwise_identical's first run: two microbatches per step.
    "dp2": (2, ("batch_size=2", "microbatch_size=1", "reshard_after_forward=false",
                "enable_deterministic_training=true")),
    "dp4": (4, ("batch_size=1",)),
    "hsdp2x2": (4, ("batch_size=1", "dp_replicate=2", "optimize_backward_concat=true")),
    # These two save step 3, which test_resume_is_bitwise resumes from.
    "tp2sp": (2, ("batch_size=4", "model_parallel_size=2", "model.sequence_parallel=true", "checkpoint.freq=3")),
    "cp2ring": (2, ("batch_size=4", "context_parallel_size=2", "context_parallel_comm=ring", "checkpoint.freq=3")),
    # Its step-3 checkpoint is the one test_a_checkpoint_resumes_on_other_layouts reshards.
    "tp2dp2": (4, ("batch_size=2", "model_parallel_size=2", "microbatch_size=2", "checkpoint.freq=3")),
}


@pytest.fixture(scope="module")
def layout_dirs(tmp_path_factory):
    dirs = {name: tmp_path_factory.mktemp(name) for name in LAYOUTS}
    for name, (nproc, overrides) in LAYOUTS.items():
        train_ok(nproc, dirs[name], *FAST, "steps=6", *overrides)
    return dirs


@pytest.fixture(scope="module")
def layout_runs(layout_dirs):
    return {name: metrics(folder) for name, folder in layout_dirs.items()}


def test_loss_falls_on_every_layout(layout_runs):
    for name, records in layout_runs.items():
        assert [r["step"] for r in records] == list(range(1, 7))
        assert records[-1]["loss"] < records[0]["loss"] - 0.3, (name, [r["loss"] for r in records])


def test_layouts_give_the_same_losses_and_gradient_norms(layout_runs):
    reference = layout_runs["dp1"]
    for name, records in layout_runs.items():
        for record, want in zip(records, reference, strict=True):
            for key in ("loss", "grad_norm"):
                assert math.isclose(record[key], want[key], rel_tol=1e-5), (name, record["step"], key, record[key], want[key])


def test_metrics_contract(layout_runs):
    # Per step, per FSDP unit (4 of them), M microbatches: ZeRO-3 all-gathers 2M times, ZeRO-2 once,
    # each unit reduce-scatters once (HSDP: plus one replica all-reduce); then the grad-norm and loss
    # all-reduces. One rank has no peers and communicates nothing.
    units = 4
    expected = {
        "dp1": {},
        "dp2": {"all_gather": units, "reduce_scatter": units, "all_reduce": 2},
        "dp4": {"all_gather": units * 2, "reduce_scatter": units, "all_reduce": 2},
        "hsdp2x2": {"all_gather": units * 2, "reduce_scatter": units, "all_reduce": units + 2},
    }
    for name, records in layout_runs.items():
        for r in records:
            assert CONTRACT_FIELDS <= r.keys()
            assert isinstance(r["loss"], float) and r["tokens_per_s"] > 0 and r["tflops"] > 0
            assert r["tflops_compute"] >= r["tflops"] and 0 <= r["comm_wait_s"] < r["step_time_s"]
            if name != "dp1":  # gloo blocks the host: every layout with peers waits on something
                assert r["comm_wait_s"] > 0, (name, r)
        if name in expected:  # TP layouts' counts are asserted per block in tests/distributed
            assert {op: v["count"] for op, v in records[-1]["comm"].items()} == expected[name], name


@pytest.mark.parametrize("name", ["dp2", "tp2sp", "cp2ring"])  # ZeRO-2 with microbatches, tp x SP, cp
def test_resume_is_bitwise(tmp_path, layout_dirs, layout_runs, name):
    """Steps 4-6 resumed from step 3 equal layout_runs' straight run. dp2 goes through a job that died
    after step 4 in the same dump_dir (the redone step is logged once); the others resume the straight
    run's own step-3 checkpoint in a new dump_dir."""
    nproc, layout = LAYOUTS[name]
    straight = {r["step"]: (r["loss"], r["grad_norm"]) for r in layout_runs[name]}
    resumed_dir = tmp_path / "resumed"
    if name == "dp2":
        # The first job dies after step 4 of the same 6-step LR schedule, its last checkpoint at step 3.
        train_ok(nproc, resumed_dir, *FAST, "steps=4", "optim.decay_steps=6", "checkpoint.freq=3", *layout)
        assert (resumed_dir / "checkpoints" / "step_3" / "manifest.json").is_file()
        died_before_saving(resumed_dir, 4)
        train_ok(nproc, resumed_dir, *FAST, "steps=6", "checkpoint.freq=3", *layout)
        steps = [1, 2, 3, 4, 5, 6]
    else:
        shutil.copytree(layout_dirs[name] / "checkpoints" / "step_3", resumed_dir / "checkpoints" / "step_3")
        train_ok(nproc, resumed_dir, *FAST, "steps=6", *layout)
        steps = [4, 5, 6]
    records = metrics(resumed_dir)
    assert [r["step"] for r in records] == steps
    resumed = {r["step"]: (r["loss"], r["grad_norm"]) for r in records}
    for step in (4, 5, 6):
        assert resumed[step] == straight[step], (step, resumed[step], straight[step])


RELAYOUTS = {  # name: (the layout whose step-3 checkpoint it resumes, ranks, overrides)
    "tp1dp4": ("tp2dp2", 4, ("batch_size=1",)),
    "tp4dp1": ("tp2dp2", 4, ("batch_size=4", "model_parallel_size=4", "model.sequence_parallel=true")),
    "tp2pp2": ("tp2dp2", 4, ("batch_size=4", "model_parallel_size=2", "pipeline_parallel_size=2", "microbatch_size=2")),
    "hsdp2x2": ("tp2dp2", 4, ("batch_size=1", "dp_replicate=2")),
    "dp2": ("cp2ring", 2, ("batch_size=2",)),
}


def test_a_checkpoint_resumes_on_other_layouts(tmp_path, layout_dirs, layout_runs):
    """A tp2 x dp2 checkpoint of step 3 resumes on tp1 x dp4, tp4 x dp1, tp2 x pp2 and HSDP 2 x 2, and a
    cp2 checkpoint on dp2: every rank reads the boxes of the full parameters (and Adam moments) it owns,
    and steps 4-6 match the run that never stopped, in loss and gradient norm."""
    for name, (source, nproc, overrides) in RELAYOUTS.items():
        straight = {r["step"]: r for r in layout_runs[source]}
        relaid = tmp_path / name
        shutil.copytree(layout_dirs[source] / "checkpoints" / "step_3", relaid / "checkpoints" / "step_3")
        resumed = train_ok(nproc, relaid, *FAST, "steps=6", *overrides)
        assert [r["step"] for r in resumed] == [4, 5, 6], name
        for record in resumed:
            for key in ("loss", "grad_norm"):
                want = straight[record["step"]][key]
                assert math.isclose(record[key], want, rel_tol=1e-5), (name, record["step"], key, record[key], want)


def test_deterministic_runs_are_bitwise_identical(tmp_path, layout_dirs, layout_runs, capsys):
    """A second deterministic run of layout dp2 compares bitwise equal to layout_runs' one; the same
    comparison catches a run perturbed by one part in 1e5 of the LR (so it is not equality by
    construction, e.g. of two copies of one file). One part in 1e7 moves the weights by less than an
    fp32 ulp in most places and may round away entirely."""
    nproc, layout = LAYOUTS["dp2"]
    second = losses(train_ok(nproc, tmp_path / "b", *FAST, "steps=6", *layout))
    assert second == losses(layout_runs["dp2"])
    train_ok(nproc, tmp_path / "perturbed", *FAST, "steps=6", *layout, "optim.lr=1.00001e-2")
    first = str(layout_dirs["dp2"])
    assert compare_runs([first, str(tmp_path / "b"), "--brief"]) == 0
    assert compare_runs([first, str(tmp_path / "perturbed"), "--brief"]) == 1
    verdicts = capsys.readouterr().out.splitlines()
    assert verdicts[0].startswith("bitwise equal over 6 steps") and "max rel diff" in verdicts[1], verdicts
