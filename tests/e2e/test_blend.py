"""A blend of two sources weighted 0.8/0.2, trained end to end: every window of 8 global batches holds
80% +- 3% of its tokens from the first source (in scripts/inspect_data.py's numbers, and in the test's own
statement of the greedy rule), the runs on dp=1, dp=2 and pp=2 agree, a resume continues bitwise, the start
line gives each source's epochs (the small source runs through more than one), and a resume with other
weights is refused. The caches come from scripts/prepare_data.py, one per source: the runs tokenize nothing."""

import random
import re
import shutil
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from scripts.inspect_data import main as inspect_data
from tests import REPO
from tests.e2e.launch import error_lines, metrics, train

WEIGHTS = (0.8, 0.2)
GLOBAL_BATCH, STEPS, WINDOW, INSPECTED = 8, 4, 8, 16
RUN = ("model=tiny", "seq_len=64", "optim.warmup_steps=1", "optim.lr=1e-2", "log_all_steps=true", f"steps={STEPS}",
       "data.weights=[0.8,0.2]")
LAYOUTS = {  # name: (ranks, overrides); every layout's global batch is 8 sequences
    "dp1": (1, ("batch_size=8", "microbatch_size=4")),
    "dp2": (2, ("batch_size=4", "microbatch_size=2")),
    "pp2": (2, ("batch_size=8", "microbatch_size=2", "pipeline_parallel_size=2", "checkpoint.freq=2")),
}


def write_sources(root: Path) -> tuple[Path, Path]:
    """A large source and a small one (a few sequences of 64 tokens), in words of their own."""
    rng = random.Random(0)
    first, second = root / "prose", root / "code.txt"
    first.mkdir()
    words = ["".join(rng.choice("abcdefghijklmnoprstuvw") for _ in range(rng.randint(2, 8))) for _ in range(400)]
    for i in range(8):
        (first / f"{i}.txt").write_text("\n".join(" ".join(rng.choice(words) for _ in range(12)) for _ in range(60)))
    second.write_text(" ".join(rng.choice(["def", "return", "(x)", "+", "1", "lambda"]) for _ in range(60)))
    return first, second


@pytest.fixture(scope="module")
def blend(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("blend")
    first, second = write_sources(root)
    data = (f"data.source=[{first},{second}]", f"data.cache_dir={root / 'cache'}")
    prepared = subprocess.run([sys.executable, str(REPO / "scripts" / "prepare_data.py"), *RUN, *data],
                              cwd=root, capture_output=True, text=True, timeout=180)
    assert prepared.returncode == 0, prepared.stderr[-3000:]
    caches = prepared.stdout.split()
    assert len(caches) == 2 and all(Path(cache).parent == root / "cache" for cache in caches)
    runs = {}
    for name, (nproc, overrides) in LAYOUTS.items():
        runs[name] = train(nproc, root / name, *RUN, *data, *overrides)
        assert runs[name].returncode == 0, runs[name].stdout[-3000:] + runs[name].stderr[-5000:]
        output = runs[name].stdout + runs[name].stderr
        assert all(f"data: cached {cache}" in output for cache in caches) and "data: preparing" not in output
    return {"root": root, "data": data, "runs": runs}


def greedy_first_source_counts(samples: int) -> list[int]:
    """Per global batch, how many sequences come from the first source: the rule stated again, in fractions."""
    weights, counts, first = [Fraction(4, 5), Fraction(1, 5)], [0, 0], []
    for i in range(samples):
        lags = [(i + 1) * weight - count for weight, count in zip(weights, counts)]
        chosen = lags.index(max(lags))
        counts[chosen] += 1
        first.append(chosen == 0)
    return [sum(first[i:i + GLOBAL_BATCH]) for i in range(0, samples, GLOBAL_BATCH)]


def test_every_window_of_8_global_batches_holds_80_percent_of_the_first_source(blend, capsys) -> None:
    args = [*RUN, *blend["data"], f"dump_dir={blend['root'] / 'inspect'}", "batch_size=8", "--steps", str(INSPECTED)]
    assert inspect_data(args) == 0
    lines = capsys.readouterr().out.splitlines()
    first = Path(blend["data"][0].split("[")[1].split(",")[0]).as_posix()
    per_step = [float(m.group(1)) for line in lines
                for m in [re.fullmatch(rf"step \d+: {re.escape(first)} ([\d.]+)% of tokens.*", line)] if m]
    assert len(per_step) == INSPECTED
    windows = np.lib.stride_tricks.sliding_window_view(np.array(per_step), WINDOW).mean(axis=1)
    assert np.all(np.abs(windows - 80.0) <= 3.0), windows
    expected = greedy_first_source_counts(INSPECTED * GLOBAL_BATCH)
    assert per_step == [round(100 * count / GLOBAL_BATCH, 1) for count in expected]
    share = np.lib.stride_tricks.sliding_window_view(np.array(expected), WINDOW).sum(axis=1) / (WINDOW * GLOBAL_BATCH)
    assert np.all(np.abs(share - 0.8) <= 0.03), share


def test_the_layouts_train_on_the_same_batches(blend) -> None:
    losses = {name: [(r["loss"], r["grad_norm"]) for r in metrics(blend["root"] / name)] for name in LAYOUTS}
    assert len(losses["dp1"]) == STEPS
    for name, records in losses.items():
        assert np.allclose(records, losses["dp1"], rtol=1e-5, atol=0), name


def test_the_start_says_each_sources_epochs(blend) -> None:
    line = next(line for line in blend["runs"]["dp1"].stderr.splitlines() if "data: blend of 2 sources" in line)
    found = re.findall(r"\(weight ([\d.]+), (\d+) training sequences, ([\d.]+) epochs(: sequences repeat)?\)", line)
    # 32 samples: 6 periods of (first, first, second, first, first) and 2 more of the first: 26 and 6.
    for (weight, sequences, epochs, repeat), drawn, want in zip(found, (26, 6), WEIGHTS, strict=True):
        assert float(weight) == want and epochs == f"{drawn / int(sequences):.2f}"
        assert bool(repeat) == (drawn > int(sequences))
    assert int(found[1][1]) < 6  # the small source is used up, and starts its next epoch, within the run


def test_a_resume_continues_bitwise_and_other_weights_are_refused(blend, tmp_path) -> None:
    nproc, overrides = LAYOUTS["pp2"]
    saved = blend["root"] / "pp2" / "checkpoints" / "step_2"
    shutil.copytree(saved, tmp_path / "resumed" / "checkpoints" / "step_2")
    proc = train(nproc, tmp_path / "resumed", *RUN, *blend["data"], *overrides)
    assert proc.returncode == 0, proc.stderr[-5000:]
    straight = {r["step"]: (r["loss"], r["grad_norm"]) for r in metrics(blend["root"] / "pp2")}
    resumed = {r["step"]: (r["loss"], r["grad_norm"]) for r in metrics(tmp_path / "resumed")}
    assert list(resumed) == [3, 4] and all(resumed[step] == straight[step] for step in resumed)
    shutil.copytree(saved, tmp_path / "reweighted" / "checkpoints" / "step_2")
    proc = train(1, tmp_path / "reweighted", *RUN, *blend["data"], "batch_size=8", "data.weights=[0.5,0.5]")
    assert proc.returncode != 0
    (line,) = error_lines(proc.stderr)
    assert "data.weights [0.8, 0.2] -> [0.5, 0.5] (the blend's shares changed" in line, line
