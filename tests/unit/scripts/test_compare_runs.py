"""compare_runs: bitwise verdicts that catch one ulp, tolerances, missing steps, and valid PNGs (also
plot_metrics)."""

import json
import math
from pathlib import Path

from scripts import compare_runs, plot_metrics

PNG = b"\x89PNG\r\n\x1a\n"


def _dump(folder: Path, losses: list[float], eval_every: int = 0) -> Path:
    folder.mkdir(parents=True)
    records = [
        {"step": s, "loss": loss, "grad_norm": 1.0 / s, "lr": 1e-3, "tokens_per_s": 100.0 * s, "tflops": 0.5,
         "mem_peak_gib": 0.3} | ({"eval_loss": loss + 0.1} if eval_every and s % eval_every == 0 else {})
        for s, loss in enumerate(losses, 1)
    ]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder


def test_one_ulp_in_one_step_is_caught_and_equality_reported(tmp_path, capsys):
    losses = [6.9, 6.1, 5.4, 5.0]
    a = _dump(tmp_path / "a", losses)
    assert compare_runs.main([str(a), str(_dump(tmp_path / "same", losses))]) == 0
    assert capsys.readouterr().out.strip().endswith("bitwise equal over 4 steps")

    nudged = list(losses)
    nudged[2] = math.nextafter(losses[2], math.inf)
    b = _dump(tmp_path / "b", nudged)
    assert compare_runs.ulps(losses[2], nudged[2]) == 1
    assert compare_runs.main([str(a), str(b), "--plot", str(tmp_path / "diff.png")]) == 1
    out = capsys.readouterr().out
    assert "max rel diff" in out and "at step 3 (loss)" in out and " 1 ulp" in out
    assert (tmp_path / "diff.png").read_bytes()[:8] == PNG
    assert compare_runs.main([str(a), str(b), "--rtol", "1e-12"]) == 0  # within tolerance
    capsys.readouterr()

    # Logged every other step (log_freq): the verdict says what it did not see.
    for run in (a, b):
        records = (run / "metrics.jsonl").read_text().splitlines()
        (run / "metrics.jsonl").write_text("".join(line + "\n" for line in records[1::2]))
    assert compare_runs.main([str(a), str(b), "--brief"]) == 0
    assert capsys.readouterr().out.startswith(
        "bitwise equal over 2 steps (of 4: 2 steps not logged by both runs; log_all_steps=true logs each)")
    sparse = [_write(tmp_path / name, [{"step": 1, "loss": 6.9}, {"step": 3, "loss": loss}])
              for name, loss in (("sparse_a", 5.4), ("sparse_b", math.nextafter(5.4, 9)))]
    assert compare_runs.main([*map(str, sparse), "--brief", "--rtol", "1e-12"]) == 0  # said under a tolerance too
    assert "at step 3 (loss) (of 3: 1 steps not logged by both runs" in capsys.readouterr().out


def test_metrics_files_may_stand_for_their_runs_and_an_eval_column_needs_an_eval(tmp_path, capsys):
    a, b = _dump(tmp_path / "a", [6.9, 6.1]), _dump(tmp_path / "b", [6.9, 6.0])
    assert compare_runs.main([str(a / "metrics.jsonl"), str(b / "metrics.jsonl")]) == 1
    header = capsys.readouterr().out.splitlines()[0]
    assert "loss A" in header and "grad_norm A" in header and "eval_loss" not in header  # neither evaluated
    evaluated = _dump(tmp_path / "c", [6.9, 6.1], eval_every=2)
    assert compare_runs.main([str(a), str(evaluated)]) == 1  # step 2's eval_loss: logged by one run only
    assert "eval_loss A" in capsys.readouterr().out.splitlines()[0]
    plot_metrics.main([str(a / "metrics.jsonl"), "--out", str(tmp_path / "one.png")])
    assert (tmp_path / "one.png").read_bytes()[:8] == PNG


def test_steps_logged_by_one_run_only_are_a_difference(tmp_path, capsys):
    a = _dump(tmp_path / "a", [6.9, 6.1, 5.4])
    b = _dump(tmp_path / "b", [6.9, 6.1])
    assert compare_runs.main([str(a), str(b), "--brief"]) == 1
    verdict = capsys.readouterr().out  # the difference first, not a "bitwise equal" that reads as a pass
    assert verdict.startswith("steps logged by one run only: [3]; the common steps: bitwise equal over 2 steps")


def test_ulps_across_zero_and_signs():
    assert compare_runs.ulps(0.0, -0.0) == 0
    assert compare_runs.ulps(-1.0, math.nextafter(-1.0, 0.0)) == 1
    assert compare_runs.ulps(math.nextafter(0.0, -1.0), math.nextafter(0.0, 1.0)) == 2
    # Numerically equal, 0 ulps apart, but not the same bits: not "bitwise equal", within any tolerance.
    assert compare_runs.rel_diff(0.0, 0.0) == 0.0 and 0.0 < compare_runs.rel_diff(0.0, -0.0) < 1e-300


def test_a_float32_value_differs_by_float32_ulps(tmp_path, capsys):
    """A grad norm is an fp32 result: one float32 rounding apart is 1 ulp, not 2^29 double ulps."""
    norm, next_norm = 0.5401780605316162, 0.540178120136261  # adjacent float32s, as logged
    assert compare_runs.precision(norm, next_norm) == 32 and compare_runs.precision(norm, 0.1) == 64
    assert compare_runs.ulps(norm, next_norm, 32) == 1 and compare_runs.ulps(norm, next_norm) == 1 << 29
    a = _write(tmp_path / "a", [{"step": 1, "loss": 6.9, "grad_norm": norm}])
    b = _write(tmp_path / "b", [{"step": 1, "loss": 6.9, "grad_norm": next_norm}])
    assert compare_runs.main([str(a), str(b)]) == 1
    assert "       1 ulp32" in capsys.readouterr().out


def test_plot_metrics_draws_several_runs(tmp_path):
    dumps = [_dump(tmp_path / "a", [6.9, 6.1, 5.4], eval_every=2), _dump(tmp_path / "b", [7.0, 6.0, 5.5])]
    out = tmp_path / "curves.png"
    assert plot_metrics.main([*map(str, dumps), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG and out.stat().st_size > 10_000


def test_plot_metrics_says_what_it_left_out_and_refuses_a_run_with_nothing_to_draw(tmp_path, capsys):
    writing = _dump(tmp_path / "writing", [6.9, 6.1])
    with (writing / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "lo')  # a run still writing its next record
    assert plot_metrics.main([str(writing), "--out", str(tmp_path / "a.png")]) == 0
    assert "note: " in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text("")
    assert plot_metrics.main([str(writing), str(empty), "--out", str(tmp_path / "b.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "holds no records" in err[0], err


def _write(folder: Path, records: list[dict]) -> Path:
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder


def test_non_finite_missing_and_eval_values_are_compared_not_skipped(tmp_path, capsys):
    """A step whose loss or norm went non-finite (logged as null) in one run only, or an eval loss that
    differs or is logged by one run only, is a difference; the same non-finite value in both is not."""
    base = {"step": 1, "loss": 6.4, "grad_norm": 0.6, "eval_loss": 6.5}
    a = _write(tmp_path / "a", [base])
    variants = {
        "null_norm": base | {"grad_norm": None},
        "nan_loss": base | {"loss": float("nan"), "grad_norm": float("inf")},
        "no_norm": {k: v for k, v in base.items() if k != "grad_norm"},
        "other_eval": base | {"eval_loss": 5.0},
        "no_eval": {k: v for k, v in base.items() if k != "eval_loss"},
    }
    for name, record in variants.items():
        assert compare_runs.main([str(a), str(_write(tmp_path / name, [record])), "--plot",
                                  str(tmp_path / f"{name}.png")]) == 1, name
        verdict = capsys.readouterr().out.strip().splitlines()[-1]
        assert "bitwise equal" not in verdict, (name, verdict)
    both_null = base | {"grad_norm": None}
    assert compare_runs.main([str(tmp_path / "null_norm"), str(_write(tmp_path / "null2", [both_null]))]) == 0
    capsys.readouterr()
    # As the trainer writes them: null, and `nonfinite` naming which. A NaN and an Inf differ.
    from trainer.observability.metrics import StepMetrics

    def logged(folder: str, loss: float) -> Path:
        metrics = StepMetrics(step=1, loss=loss, grad_norm=0.6, lr=1e-3, tokens_per_s=1.0, step_time_s=1.0,
                              tflops=1.0, tflops_compute=1.0, comm_wait_s=0.0, mfu=None, mfu_compute=None,
                              mem_peak_gib=1.0, comm={})
        return _write(tmp_path / folder, [json.loads(json.dumps(metrics.record()))])

    nan, inf, nan2 = logged("nan", float("nan")), logged("inf", float("inf")), logged("nan2", float("nan"))
    record = json.loads((nan / "metrics.jsonl").read_text())
    assert record["loss"] is None and record["nonfinite"] == {"loss": "nan"}
    assert compare_runs.main([str(nan), str(inf)]) == 1
    assert "values differ in kind at step 1 (loss" in capsys.readouterr().out
    assert compare_runs.main([str(nan), str(nan2), "--fields", "loss,grad_norm"]) == 0


def test_unreadable_or_duplicated_metrics_exit_2_with_one_line(tmp_path, capsys):
    a = _dump(tmp_path / "a", [6.9, 6.1])
    twice = _write(tmp_path / "twice", [{"step": 1, "loss": 6.9}, {"step": 1, "loss": 6.8}])
    fractional = _write(tmp_path / "fractional", [{"step": 1, "loss": 6.9}, {"step": 2.5, "loss": 6.8}])
    stepless = _write(tmp_path / "stepless", [{"loss": 6.9}])
    for other, fragment in ((tmp_path / "missing", "is not a readable metrics file"), (twice, "logs some step twice"),
                            (fractional, "a record's step is 2.5, not a whole number"),
                            (stepless, "a record's step is None, not a whole number")):
        assert compare_runs.main([str(a), str(other)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error:") and fragment in err[0], err


def test_misuse_that_would_prove_nothing_exits_2(tmp_path, capsys):
    """One metrics file given twice (also through a hard link), files without any compared value, an
    empty or undecodable file, no common step, nothing but non-finite values: no verdict to trust."""
    a = _dump(tmp_path / "a", [6.9, 6.1])
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "metrics.jsonl").hardlink_to(a / "metrics.jsonl")
    no_values = _write(tmp_path / "nolosses", [{"step": 1, "lr": 1e-3}, {"step": 2, "lr": 1e-3}])
    empty = _write(tmp_path / "empty", [])
    binary = _write(tmp_path / "binary", [])
    (binary / "metrics.jsonl").write_bytes(b'\xff\xfe{"step": 1}\n')
    later = _write(tmp_path / "later", [{"step": 3, "loss": 5.0}])
    skipped = [{"step": s, "loss": None, "grad_norm": None} for s in (1, 2)]
    cases = ((a, tmp_path / "a" / ".", "same metrics file"), (a, linked, "same metrics file"),
             (no_values, _write(tmp_path / "nolosses2", [{"step": 1}, {"step": 2}]),
              "no loss, grad_norm values to compare"), (a, empty, "holds no records"),
             (a, binary, "is not a readable metrics file"), (a, later, "no step in common"),
             (_write(tmp_path / "x", skipped), _write(tmp_path / "y", skipped), "all 4 compared values are non-finite"))
    copy = _write(tmp_path / "copy", [r | {"wall_time": 1.7e9 + r["step"]} for r in
                                     map(json.loads, (a / "metrics.jsonl").read_text().splitlines())])
    cases += ((copy, _write(tmp_path / "copy2", map(json.loads, (copy / "metrics.jsonl").read_text().splitlines())),
               "ended at the same wall_time: one run is a copy of the other"),)
    for first, second, fragment in cases:
        assert compare_runs.main([str(first), str(second)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error:") and fragment in err[0], err
    assert compare_runs.main([str(a), str(_dump(tmp_path / "b", [6.9, 6.1])), "--plot", "/no/such/dir/x.png"]) == 2
    assert "error: --plot /no/such/dir/x.png" in capsys.readouterr().err


def test_records_copied_from_one_run_to_the_other_are_left_out(tmp_path, capsys):
    """A dump_dir copied after step 2 and resumed on another layout: only step 3 was run by both."""
    base = [{"step": s, "loss": 7.0 - s, "grad_norm": 1.0, "wall_time": 1.7e9 + s} for s in (1, 2)]
    a = _write(tmp_path / "a", [*base, {"step": 3, "loss": 4.0, "grad_norm": 1.0, "wall_time": 1.7e9 + 3}])
    b = _write(tmp_path / "b", [*base, {"step": 3, "loss": 4.0, "grad_norm": 1.0, "wall_time": 1.7e9 + 9}])
    assert compare_runs.main([str(a), str(b), "--brief"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("bitwise equal over 1 step")
    assert "2 common step(s), 1 to 2, ended at the same wall_time in both runs" in captured.err


def test_partial_last_line_non_finite_values_unfinished_runs_and_config_differences_are_said(tmp_path, capsys):
    a, b = _dump(tmp_path / "a", [6.9, 6.1, 5.4]), _dump(tmp_path / "b", [6.9, 6.1, 5.4])
    with (b / "metrics.jsonl").open("a") as f:
        f.write('{"step": 4, "loss": 5.')  # a run still writing
    for folder, steps, concat in ((a, 3, False), (b, 6, True)):
        (folder / "train_config.json").write_text(json.dumps(
            {"dump_dir": str(folder), "steps": steps, "optimize_backward_concat": concat, "model": {"dim": 64}}))
    assert compare_runs.main([str(a), str(b)]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip().endswith("bitwise equal over 3 steps")
    notes = captured.err.strip().splitlines()
    assert any("last line is partial" in n for n in notes), notes
    assert any(f"{b}: logged up to step 3 of its steps=6" in n for n in notes), notes
    assert any("configs differ in: optimize_backward_concat (False vs True), steps (3 vs 6)" in n for n in notes), notes
    for folder, per_rank in ((a, 4), (b, 2)):  # two layouts of one global batch of 4
        config = json.loads((folder / "train_config.json").read_text()) | {"batch_size": per_rank}
        (folder / "train_config.json").write_text(json.dumps(config))
        (folder / "fingerprint.json").write_text(json.dumps({"global_batch_size": 4}))
    compare_runs.main([str(a), str(b)])
    err = capsys.readouterr().err
    assert "batch_size (4 vs 2)" in err and "the global batch is 4 sequences in both" in err, err
    for folder in (a, b):  # concat changes nothing on a layout of one microbatch: nothing tests it
        (folder / "layout.json").write_text(json.dumps({"world_size": 1, "inert_keys": {
            "optimize_backward_concat": "more than one microbatch", "model.sequence_parallel": "model_parallel_size > 1"}}))
    compare_runs.main([str(a), str(b)])
    assert ("note: optimize_backward_concat differs, but changes nothing on either run's layout (it needs more "
            "than one microbatch): this comparison does not test it") in capsys.readouterr().err
    (b / "train_config.json").write_text((a / "train_config.json").read_text())
    compare_runs.main([str(a), str(b)])
    assert "the configs are identical (dump_dir aside): nothing was toggled" in capsys.readouterr().err
    skipped = [{"step": 1, "loss": 6.9, "grad_norm": 1.0}, {"step": 2, "loss": None, "grad_norm": None}]
    x, y = _write(tmp_path / "x", skipped), _write(tmp_path / "y", skipped)
    assert compare_runs.main([str(x), str(y)]) == 0
    captured = capsys.readouterr()
    assert "(2 of 4 values non-finite in both runs)" in captured.out
    assert f"{x} has no readable train_config.json" in captured.err


def test_a_malformed_line_is_named_by_its_line_number_and_only_an_unterminated_last_one_is_partial(tmp_path, capsys):
    a = _dump(tmp_path / "a", [6.9, 6.1])
    b = _write(tmp_path / "b", [])
    (b / "metrics.jsonl").write_text('\n\n{"step": 1, "loss": 6.9}\nBAD\n{"step": 2, "loss": 6.1}\n')
    assert compare_runs.main([str(a), str(b)]) == 2
    assert "line 4 is not a JSON record" in capsys.readouterr().err
    (b / "metrics.jsonl").write_text('{"step": 1, "loss": 6.9}\n{"step": 2, "lo\n')  # ends with a newline: damage
    assert compare_runs.main([str(a), str(b)]) == 2
    assert "line 2 is not a JSON record" in capsys.readouterr().err


def test_fields_and_tolerance_are_checked(tmp_path, capsys):
    a = _dump(tmp_path / "a", [6.9, 6.1, 5.4, 5.0])
    with_eval = _dump(tmp_path / "e", [6.9, 6.1, 5.4, 5.0], eval_every=2)
    assert compare_runs.main([str(a), str(with_eval)]) == 1  # eval_loss logged by one run only
    assert compare_runs.main([str(a), str(with_eval), "--fields", "loss,grad_norm"]) == 0
    capsys.readouterr()
    for bad in (["--rtol", "nan"], ["--rtol=-1e-6"], ["--rtol", "inf"], ["--fields", "lr"]):
        try:
            compare_runs.main([str(a), str(with_eval), *bad])
        except SystemExit as e:
            assert e.code == 2, bad
        else:
            raise AssertionError(f"{bad} was accepted")


def test_per_unit_norms_name_the_first_step_and_units_that_differ(tmp_path, capsys):
    def with_units(folder: Path, head_grad_at_2: float) -> Path:
        _dump(folder, [6.9, 6.1, 5.4])
        records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        for r in records:
            r["unit_param_norms"] = {"tok_embeddings": 3.0, "layers.0": 2.0, "head": 1.0}
            r["unit_grad_norms"] = {"tok_embeddings": 0.1, "layers.0": 0.2,
                                    "head": head_grad_at_2 if r["step"] >= 2 else 0.3}
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        return folder

    a, b = with_units(tmp_path / "a", 0.3), with_units(tmp_path / "b", 0.30000001)
    # Loss and grad norm are bitwise equal, but a unit's norm is not: so are the runs' gradients.
    assert compare_runs.main([str(a), str(b), "--brief"]) == 1
    assert capsys.readouterr().out.startswith(
        "bitwise equal over 3 steps; but per-unit norms first differ at step 2, unit_grad_norms: head")
    assert compare_runs.main([str(a), str(b), "--rtol", "1e-6"]) == 0
    assert "per-unit norms" not in capsys.readouterr().out
    plain = _dump(tmp_path / "plain", [6.9, 6.1, 5.4])
    assert compare_runs.main([str(a), str(plain), "--brief"]) == 1
    assert "per-unit norms are logged by one run only, from step 1" in capsys.readouterr().out


def test_a_nan_and_an_inf_in_one_unit_norm_differ(tmp_path):
    """Nested NaN/Inf (a unit's norm) are logged as null like top-level ones and named in `nonfinite` by
    field and unit, so that compare_runs tells them apart."""
    from trainer.observability.metrics import StepMetrics

    def logged(folder: str, layer_grad: float) -> dict[int, dict]:
        metrics = StepMetrics(step=1, loss=1.0, grad_norm=float("nan"), lr=1e-3, tokens_per_s=1.0, step_time_s=1.0,
                              tflops=0.0, tflops_compute=0.0, comm_wait_s=0.0, mfu=None, mfu_compute=None,
                              mem_peak_gib=0.0, comm={}, unit_grad_norms={"layers.0": layer_grad, "head": 1.0},
                              unit_param_norms={"layers.0": 1.0, "head": 1.0})
        record = json.loads(json.dumps(metrics.record(), allow_nan=False))
        assert record["unit_grad_norms"]["layers.0"] is None
        assert record["nonfinite"] == {"grad_norm": "nan", "unit_grad_norms.layers.0": repr(layer_grad)}
        return compare_runs.read_metrics(_write(tmp_path / folder, [record]), [])

    nan, inf, nan2 = logged("nan", float("nan")), logged("inf", float("inf")), logged("nan2", float("nan"))
    assert math.isnan(nan[1]["unit_grad_norms"]["layers.0"]) and nan[1]["unit_grad_norms"]["head"] == 1.0
    assert compare_runs.unit_divergence(nan, inf, 0.0) == \
        "per-unit norms first differ at step 1, unit_grad_norms: layers.0"
    assert compare_runs.unit_divergence(nan, nan2, 0.0) is None


def test_a_profiled_step_compares_as_any_other(tmp_path, capsys):
    """`profiled` marks a step's timings, not its numerics: a run profiled at some steps is bitwise equal
    to the same run unprofiled."""
    records = [{"step": s, "loss": loss, "grad_norm": 0.5} for s, loss in ((1, 6.9), (2, 6.1))]
    plain = _write(tmp_path / "a", records)
    profiled = _write(tmp_path / "b", [r | {"profiled": True} if r["step"] == 2 else r for r in records])
    assert compare_runs.main([str(plain), str(profiled)]) == 0
    out, err = capsys.readouterr()
    assert out.strip().endswith("bitwise equal over 2 steps")
    assert all(line.endswith("has no readable train_config.json: the configs are not compared")
               for line in err.splitlines()), err  # nothing about the flag


def test_a_plot_it_would_not_write_as_named_is_refused_before_any_output(tmp_path, capsys):
    """matplotlib picks the format by the extension and writes PATH.png for a folder or a name without one:
    refused in one line, before the table, and no file appears."""
    a, b = _dump(tmp_path / "a", [6.9, 6.1]), _dump(tmp_path / "b", [6.9, 6.0])
    for plot, fragment in ((tmp_path / "a", "is a folder"),
                           (tmp_path / "noext", "has no extension: end it in one of .avif"),
                           (tmp_path / "x.foo", ".foo is not an image format matplotlib writes"),
                           (tmp_path / "nope" / "x.png", f"its folder {tmp_path / 'nope'} does not exist")):
        assert compare_runs.main([str(a), str(b), "--plot", str(plot)]) == 2
        captured = capsys.readouterr()
        err = captured.err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: --plot {plot}: {fragment}"), err
        assert captured.out == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]
    assert [p.name for p in (tmp_path / "a").iterdir()] == ["metrics.jsonl"]


def test_a_value_too_large_for_a_float_differs_instead_of_crashing(tmp_path, capsys):
    """A hand-edited or foreign file's huge integer (isfinite raised OverflowError) is a value past a
    float's range: it differs from a number, and equals itself."""
    a = _write(tmp_path / "a", [{"step": 1, "loss": 10**400}, {"step": 2, "loss": 6.0}])
    b = _write(tmp_path / "b", [{"step": 1, "loss": 6.9}, {"step": 2, "loss": 6.0}])
    assert compare_runs.main([str(a), str(b), "--fields", "loss"]) == 1
    assert "differ" in capsys.readouterr().out
    same = _write(tmp_path / "same", [{"step": 1, "loss": 10**400}, {"step": 2, "loss": 6.0}])
    assert compare_runs.main([str(a), str(same), "--fields", "loss"]) == 0


def test_a_value_that_is_not_a_number_is_unreadable_not_a_match(tmp_path, capsys):
    """The same string in both runs read as 'non-finite in both' and the runs as bitwise equal."""
    runs = [_write(tmp_path / name, [{"step": 1, "loss": 6.9, "grad_norm": 1.0},
                                     {"step": 2, "loss": "abc", "grad_norm": 0.5}]) for name in "ab"]
    assert compare_runs.main([*map(str, runs), "--brief"]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip() == "error: run A: step 2 logs loss='abc', not a number" and "equal" not in captured.out
    # A bool is an int to Python, but no logged value: unreadable as well.
    clean, flagged = (_write(tmp_path / name, [{"step": 1, "loss": 6.9, "grad_norm": 1.0},
                                               {"step": 2, "loss": 6.0, "grad_norm": norm}])
                      for name, norm in (("clean", 1), ("flagged", True)))
    assert compare_runs.main([str(clean), str(flagged), "--brief"]) == 2
    assert "run B: step 2 logs grad_norm=True, not a number" in capsys.readouterr().err
