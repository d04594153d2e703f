"""The benchmark scripts stay runnable: every one imports, and the cross-implementation step benchmark
still builds its pair (a renamed helper once broke it silently, as nothing ran it)."""

import importlib

import pytest

BENCHES = ("agreement", "checkpoint", "concat", "cp", "fp8", "fsdp", "fsdp_runners", "pp", "ranks", "step", "tp",
           "trainer_step")


@pytest.mark.parametrize("name", BENCHES)
def test_every_bench_script_imports(name: str) -> None:
    importlib.import_module(f"scripts.bench.{name}")


def test_step_bench_runs_ours_against_hf_to_the_same_loss() -> None:
    step = importlib.import_module("scripts.bench.step")
    result = step.run(step.model_args("tiny", 32), batch=2, warmup=1, steps=1, seed=0)
    loss_ours, loss_hf = result["losses"]
    assert abs(loss_ours - loss_hf) <= 1e-6 * abs(loss_hf)
    assert "agree within" in step.require_agreement("losses", abs(loss_ours - loss_hf) / abs(loss_hf), rtol=1e-6)


def test_a_disagreement_exits_with_one_error_line() -> None:
    agreement = importlib.import_module("scripts.bench.agreement")
    with pytest.raises(SystemExit, match=r"^error: losses disagree: largest relative difference 2.00e-03 > 1e-05$"):
        agreement.require_agreement("losses", 2e-3, rtol=1e-5)
    with pytest.raises(SystemExit):
        agreement.require_agreement("losses", float("nan"), rtol=1e-5)
    nan = float("nan")
    assert agreement.worst([1e-9, 2e-9]) == 2e-9 and agreement.worst([]) == 0.0
    assert all(agreement.worst(values) != agreement.worst(values) for values in ([1e-9, nan], [0.0, nan, 1.0]))
