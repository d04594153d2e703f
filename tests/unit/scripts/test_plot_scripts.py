"""visualize_schedule and plot_metrics on bad input: one `error:` line naming the argument, exit 2, and
no file written (matplotlib would write OUT.png for a folder or a name without an extension)."""

import pytest

from scripts import plot_metrics, visualize_schedule
from tests.unit.scripts.test_compare_runs import PNG, _dump, _write


def _one_error_line(capsys, code: int, *fragments: str) -> None:
    assert code == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and all(f in err[0] for f in fragments), err
    assert captured.out == ""


@pytest.mark.parametrize("args, fragments", [
    (["pp=0"], ["pp=0: must be an integer from 1 to 64"]),
    (["pp=-2"], ["pp=-2: must be an integer from 1 to 64"]),
    (["pp=abc"], ["pp=abc: must be an integer"]),
    (["vpp=0"], ["vpp=0: must be an integer >= 1"]),
    (["forward=0", "backward=0"], ["forward=0: must be a finite number > 0"]),
    (["forward=-1"], ["forward=-1: must be a finite number > 0"]),
    (["forward=nan"], ["forward=nan: must be a finite number > 0"]),
    (["p2p=-5"], ["p2p=-5: must be a finite number >= 0"]),
    (["schedule=zb_h1", "weight=3", "backward=2"], ["weight=3: must be from 0 to backward=2"]),
    (["microbatches=300"], ["pp=4 vpp=1 microbatches=300: pp x vpp x microbatches must be at most 1024"]),
    (["forward=100", "backward=200"], ["forward=100 backward=200", "the makespan must be at most 2048"]),
    (["schedule=zbv", "vpp=1"], ["schedule=zbv pp=4 vpp=1 microbatches=8: pipeline_schedule=zbv runs exactly 2"]),
    (["sends=x"], ["sends=x is not one of: block | async | ahead"]),
    (["actions=nope/a.txt"], ["actions=nope/a.txt: its folder nope does not exist"]),  # checked before the PNG
    (["actions=out.png"], ["actions=out.png: is the output image too"]),
    (["bogus=1"], ["unknown option bogus="]),
    (["weight=0"], ["weight=0: W's share of the backward, which only zb_h1 and zbv run apart (schedule=1f1b"]),
])
def test_visualize_schedule_refuses_bad_arguments_before_writing(tmp_path, monkeypatch, capsys, args, fragments):
    monkeypatch.chdir(tmp_path)
    _one_error_line(capsys, visualize_schedule.main([*args, "out.png"]), *fragments)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("out, fragments", [
    ("folder", ["output folder: is a folder"]),
    ("noext", ["output noext: has no extension: end it in one of", ".png", ".pdf", ".svg"]),
    ("x.foo", ["output x.foo: .foo is not an image format matplotlib writes", ".png"]),
    ("x.pgf", ["output x.pgf: .pgf is not an image format"]),  # needs TeX, and fails after it began writing
    ("nope/x.png", ["output nope/x.png: its folder nope does not exist"]),
])
def test_visualize_schedule_refuses_an_output_it_would_not_write_as_named(tmp_path, monkeypatch, capsys, out,
                                                                          fragments):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "folder").mkdir()
    _one_error_line(capsys, visualize_schedule.main(["pp=2", "microbatches=2", out]), *fragments)
    assert [p.name for p in tmp_path.iterdir()] == ["folder"] and not any((tmp_path / "folder").iterdir())
    assert visualize_schedule.main(["pp=2", "microbatches=2", "another.png", "extra.png"]) == 2
    assert "one output image expected, got 2: another.png extra.png" in capsys.readouterr().err


def test_visualize_schedule_writes_the_picture_and_the_actions(tmp_path, capsys):
    out, actions = tmp_path / "s.png", tmp_path / "a.txt"
    assert visualize_schedule.main(["pp=2", "microbatches=2", f"actions={actions}", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG and "r1 F c0 m0" in actions.read_text().splitlines()
    assert "makespan 9," in capsys.readouterr().out
    # Run again: its own action list is replaced; a file it did not write (a run's metrics) is refused, kept.
    assert visualize_schedule.main(["pp=4", "microbatches=4", f"actions={actions}", str(out)]) == 0
    assert "r3 F c0 m3" in actions.read_text().splitlines()
    capsys.readouterr()
    metrics = _dump(tmp_path / "run", [6.9, 6.1]) / "metrics.jsonl"
    kept = metrics.read_bytes()
    _one_error_line(capsys, visualize_schedule.main(["pp=2", f"actions={metrics}", str(out)]),
                    f"actions={metrics}: exists and is not an action list this script wrote")
    assert metrics.read_bytes() == kept


def test_an_interrupted_write_leaves_the_earlier_image_whole(tmp_path, monkeypatch):
    """Outputs are written beside their name and renamed: a write cut short (Ctrl-C, a full disk) left a
    truncated file under the name asked for."""
    import matplotlib.figure

    out = tmp_path / "s.png"
    assert visualize_schedule.main(["pp=2", "microbatches=2", str(out)]) == 0
    before = out.read_bytes()

    def cut_short(fig, path, **kwargs):
        with open(path, "wb") as f:
            f.write(PNG)
        raise KeyboardInterrupt

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", cut_short)
    with pytest.raises(KeyboardInterrupt):
        visualize_schedule.main(["pp=4", "microbatches=4", str(out)])
    assert out.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["s.png"]
    monkeypatch.undo()
    # Through a symlink the linked file is replaced, and the link stays one.
    (tmp_path / "runs").mkdir()
    (tmp_path / "latest.png").symlink_to(tmp_path / "runs" / "x.png")
    assert visualize_schedule.main(["pp=2", "microbatches=2", str(tmp_path / "latest.png")]) == 0
    assert (tmp_path / "latest.png").is_symlink() and (tmp_path / "runs" / "x.png").read_bytes()[:8] == PNG


def test_plot_metrics_refuses_an_output_it_would_not_write_as_named(tmp_path, capsys):
    run = _dump(tmp_path / "run", [6.9, 6.1])
    for out, fragment in ((tmp_path / "run", "is a folder"), (tmp_path / "noext", "has no extension"),
                          (tmp_path / "x.foo", ".foo is not an image format"),
                          (tmp_path / "nope" / "x.png", f"its folder {tmp_path / 'nope'} does not exist")):
        _one_error_line(capsys, plot_metrics.main([str(run), "--out", str(out)]), f"--out {out}: {fragment}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["metrics.jsonl"]


def test_plot_metrics_refuses_a_run_with_nothing_to_draw_or_a_value_that_is_not_a_number(tmp_path, capsys):
    good = _dump(tmp_path / "good", [6.9, 6.1])
    nothing = _write(tmp_path / "nothing", [{"step": 1, "foo": 1.0}, {"step": 2, "foo": 1.0}])
    text = _write(tmp_path / "text", [{"step": 1, "loss": 6.9}, {"step": 2, "loss": "abc"}])
    flag = _write(tmp_path / "flag", [{"step": 1, "lr": True}])
    out = tmp_path / "curves.png"
    for run, fragment in ((nothing, "metrics.jsonl logs none of loss, tokens_per_s, mem_peak_gib, lr: nothing to draw"),
                          (text, "metrics.jsonl: step 2 logs loss='abc', not a number"),
                          (flag, "metrics.jsonl: step 1 logs lr=True, not a number")):
        _one_error_line(capsys, plot_metrics.main([str(good), str(run), "--out", str(out)]), f"{run}/{fragment}")
    assert not out.exists()
    # Some panels without its curve, a null (non-finite) value, an integer past a float: drawn, with a note.
    sparse = _write(tmp_path / "sparse", [{"step": 1, "loss": None, "lr": 1e-3}, {"step": 2, "loss": 10 ** 400}])
    assert plot_metrics.main([str(good), str(sparse), "--out", str(out)]) == 0
    assert f"note: {sparse}/metrics.jsonl logs no tokens_per_s, mem_peak_gib:" in capsys.readouterr().err
    assert out.read_bytes()[:8] == PNG



@pytest.mark.parametrize("args, analytic", [
    (["pp=4", "microbatches=8"], "(analytic 27.3%)"),
    (["pp=4", "schedule=zb_h1", "microbatches=2"], "(analytic -)"),  # the paper's formula: from pp microbatches
    (["pp=4", "schedule=zb_h1", "microbatches=4"], "(analytic 20.0%)"),
    (["pp=4", "schedule=zbv", "vpp=2", "microbatches=7"], "(analytic 6.7%)"),  # zbv: from 2pp - 1
])
def test_the_analytic_bubble_is_printed_where_its_formula_applies(tmp_path, capsys, args, analytic):
    assert visualize_schedule.main([*args, str(tmp_path / "s.png")]) == 0
    assert analytic in capsys.readouterr().out
