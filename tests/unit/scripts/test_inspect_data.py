"""scripts/inspect_data.py on a small corpus with a tiny vocabulary: the per-source shares add up to 100%,
the document counts are the bos of the inspected windows of the packed tokens, a shown sequence is the
tokenizer's decode of its window, and a bad override or option is one error line with exit code 2."""

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from scripts.inspect_data import BOS_MARK, EOS_MARK, NEWLINE_MARK, Sequence, gather, main, stats_lines
from tests import REPO
from tests.unit.conftest import write_corpus
from trainer.data.sampler import GlobalBatchSampler, split_windows
from trainer.data.shards import PackedTokens
from trainer.data.tokenizer import load_tokenizer

SEQ_LEN, BATCH, STEPS, SEED = 32, 16, 4, 3


@pytest.fixture(scope="module")
def inspected(tmp_path_factory) -> tuple[list[str], Path]:
    """The report of 4 global batches of 16 (one epoch of the corpus' windows, so documents are seen), and
    the cache folder the script prepared."""
    root = tmp_path_factory.mktemp("inspect")
    corpus, cache = write_corpus(root / "corpus"), root / "cache"
    overrides = [f"data.source={corpus}", f"data.cache_dir={cache}", "model.vocab_size=320", f"seq_len={SEQ_LEN}",
                 f"batch_size={BATCH // 2}", "data.held_out_fraction=0", f"seed={SEED}", f"dump_dir={root / 'dump'}"]
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "inspect_data.py"), *overrides, "--dp", "2",
                           "--steps", str(STEPS), "--show", "3", "--width", "100000"],
                          cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines(), cache


def packed_windows(cache: Path) -> tuple[PackedTokens, list[np.ndarray]]:
    """The cache's packed tokens and the input tokens of the inspected steps, read without the script."""
    tokens = PackedTokens(next(cache.glob("tokens-*")))
    sampler = GlobalBatchSampler(split_windows(tokens.num_tokens, SEQ_LEN, 0.0)[0], BATCH, SEED)
    indices = [int(i) for step in range(STEPS) for i in sampler.global_indices(step)]
    return tokens, [tokens.sequence(i, SEQ_LEN)[:-1] for i in indices]


def shares(lines: list[str], kind: str) -> list[float]:
    return [float(m.group(1)) for line in lines if line.startswith("source ")
            for m in [re.search(rf"([\d.]+)% of {kind}", line)]]


def test_the_source_shares_add_up_to_100_percent(inspected) -> None:
    lines, _ = inspected
    assert len([line for line in lines if line.startswith("source ")]) == 1  # data.source names one source
    assert sum(shares(lines, "tokens")) == pytest.approx(100.0)
    assert sum(shares(lines, "documents")) == pytest.approx(100.0)


def test_the_document_counts_are_the_bos_of_the_packed_windows(inspected) -> None:
    lines, cache = inspected
    _, windows = packed_windows(cache)
    bos = load_tokenizer(next(cache.glob("tokenizer-*/spm.model"))).bos_id
    per_sequence = [int(np.count_nonzero(w == bos)) for w in windows]
    assert max(per_sequence) > 0  # the check below means something
    line = next(line for line in lines if line.startswith("documents per sequence:"))
    assert line.startswith(f"documents per sequence: mean {np.mean(per_sequence):.2f}, min {min(per_sequence)}, "
                           f"max {max(per_sequence)} ")
    assert any(line.startswith(f"inspect: steps 0-{STEPS - 1}, {STEPS} global batches of {BATCH} sequences")
               for line in lines)  # batch_size x --dp


def test_a_shown_sequence_is_the_decode_of_its_window(inspected) -> None:
    lines, cache = inspected
    tokens, windows = packed_windows(cache)
    tokenizer = load_tokenizer(next(cache.glob("tokenizer-*/spm.model")))
    shown = [line for line in lines if line.startswith("sequence ")]
    assert len(shown) == 3
    for line, window in zip(shown, windows):
        index, text = re.fullmatch(r"sequence (\d+) \(step 0\): (.*)", line).groups()
        assert np.array_equal(tokens.sequence(int(index), SEQ_LEN)[:-1], window)
        specials = np.flatnonzero((window == tokenizer.bos_id) | (window == tokenizer.eos_id))
        runs = np.split(window, specials)  # each run after the first starts with its bos or eos
        expected = [tokenizer.decode(run[1:] if i else run) for i, run in enumerate(runs)]
        marks = [BOS_MARK if window[s] == tokenizer.bos_id else EOS_MARK for s in specials]
        assert re.findall(f"{BOS_MARK}|{EOS_MARK}", text) == marks
        assert re.split(f"{BOS_MARK}|{EOS_MARK}", text) == [t.replace("\n", NEWLINE_MARK) for t in expected]


def test_a_bos_that_is_also_the_eos_counts_once() -> None:
    """GPT-2's <|endoftext|> is bos and eos: each such token is one of the tokens, not two (100% before)."""
    end = 0
    two_documents = np.array([end, 5, 6, end, end, 7, 8, end])
    lines = stats_lines(gather([Sequence(0, 0, "src", two_documents)], end, end))
    assert lines[-1] == "bos/eos: 50.0% of tokens (bos and eos are one token)"
    assert lines[-2].startswith("documents per sequence: mean 2.00,")
    lines = stats_lines(gather([Sequence(0, 0, "src", np.array([1, 5, 6, 2, 1, 7, 8, 2]))], 1, 2))
    assert lines[-1] == "bos/eos: 50.0% of tokens (bos 25.0%, eos 25.0%)"


def test_a_long_sequence_is_clipped_to_the_width(inspected, capsys, tmp_path) -> None:
    lines, cache = inspected
    args = [f"data.source={cache.parent / 'corpus' / 'a.txt'}", f"data.cache_dir={cache}", "model.vocab_size=320",
            f"dump_dir={tmp_path}", "seq_len=64", "batch_size=1", "data.held_out_fraction=0", "--show", "1", "--width", "20"]
    assert main(args) == 0
    shown = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("sequence "))
    assert len(shown.split(": ", 1)[1]) == 20 and shown.endswith("…")


@pytest.mark.parametrize("args, message", [
    (["optim.lrr=1e-3"], r"error: optim.lrr is not a known config key"),
    (["--steps", "0"], r"error: --steps=0 must be at least 1"),
    (["--steps", "100000000"], r"error: --steps=100000000 x 4 sequences per step is more than the 1,000,000 "),
])
def test_a_bad_override_or_option_is_one_error_line_with_exit_2(args, message, tmp_path) -> None:
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "inspect_data.py"), *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert re.match(message, done.stderr) and len(done.stderr.splitlines()) == 1
    assert done.stdout == ""
