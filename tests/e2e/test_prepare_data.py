"""scripts/prepare_data.py builds the cache a job builds: a 2-rank job on a folder of every source kind,
started after it, tokenizes nothing, trains, and its packed tokens are those of the same documents as .txt."""

import subprocess
import sys
from pathlib import Path

from tests import REPO
from tests.e2e.launch import metrics, train
from tests.source_kinds import DOCUMENTS, text_form_of_every_kind, train_small_tokenizer, write_every_kind
from trainer.data.prepare import prepare_dataset
from trainer.data.shards import TOKENS_FILE


def test_a_job_after_prepare_data_trains_every_kind_on_two_ranks_without_tokenizing(tmp_path):
    tokenizer = train_small_tokenizer(tmp_path)
    documents = DOCUMENTS * 3
    mixed = write_every_kind(tmp_path / "mixed", documents, tokenizer)
    cache = tmp_path / "cache"
    overrides = ("model=tiny", "model.vocab_size=400", "seq_len=32", "batch_size=2", "steps=2", "log_freq=1",
                 f"data.source={mixed}", f"data.tokenizer={tokenizer.path}", f"data.cache_dir={cache}",
                 "data.held_out_fraction=0")
    prepared = subprocess.run([sys.executable, str(REPO / "scripts" / "prepare_data.py"), *overrides,
                               f"dump_dir={tmp_path / 'unused'}"], cwd=tmp_path, capture_output=True, text=True,
                              timeout=120)
    assert prepared.returncode == 0, prepared.stderr
    assert "data: tokenized [####################] 100% 5/5 files" in prepared.stderr
    tokens = Path(prepared.stdout.strip())
    assert tokens.parent == cache
    packed = (tokens / TOKENS_FILE).read_bytes()

    job = train(2, tmp_path / "dump", *overrides, timeout=240)
    output = job.stdout + job.stderr
    assert job.returncode == 0, output[-5000:]
    assert f"data: cached {tokens}" in output
    assert "data: preparing" not in output and "data: tokenized" not in output
    assert [r["step"] for r in metrics(tmp_path / "dump") if "loss" in r] == [1, 2]
    assert (tokens / TOKENS_FILE).read_bytes() == packed  # read, not rewritten

    text = text_form_of_every_kind(tmp_path / "texts", documents)
    _, as_text = prepare_dataset(str(text), str(tokenizer.path), 400, tmp_path / "text_cache", True, print)
    assert (as_text.path / TOKENS_FILE).read_bytes() == packed
