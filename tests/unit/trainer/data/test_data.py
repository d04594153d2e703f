"""Data pipeline: tokenizer, packed tokens, cache, microbatches (the sampler: test_sampler.py)."""

import errno
import hashlib
import json
import os
import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from parallel.errors import ConfigError
from tests import REPO
from trainer.data import prepare as data
from trainer.data import shards
from trainer.data.loader import BatchLoader
from trainer.data.prepare import prepare_dataset
from trainer.data.sampler import GlobalBatchSampler
from trainer.data.shards import TOKENS_FILE, PackedTokens, is_complete, write_packed_tokens
from trainer.data.records import iter_documents
from trainer.data.sources import default_corpus_files, list_source, sources_fingerprint
from trainer.data.tokenizer_spm import SentencePieceTokenizer
from trainer.data.tokenizer_spm import train_tokenizer

VOCAB = 320
SHARED_CACHE = REPO / ".cache" / "data"


def _source_files(source: str) -> list[Path]:
    return list_source(source)[0]


def _pack(files: list[Path], tokenizer: SentencePieceTokenizer, out: Path, progress=lambda line: None) -> Path:
    return write_packed_tokens(files, tokenizer, out, progress=progress, sources=sources_fingerprint(files))


@pytest.fixture(scope="module")
def tokenizer(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> SentencePieceTokenizer:
    model = tmp_path_factory.mktemp("tok") / "spm.model"
    return SentencePieceTokenizer(train_tokenizer(_source_files(str(corpus)), VOCAB, model))


@pytest.fixture(scope="module")
def packed(corpus: Path, tokenizer: SentencePieceTokenizer, tmp_path_factory: pytest.TempPathFactory) -> PackedTokens:
    out = tmp_path_factory.mktemp("packed") / "tokens"
    _pack(_source_files(str(corpus)), tokenizer, out, lambda line: None)
    return PackedTokens(out)


# --- tokenizer -------------------------------------------------------------------------------------


def test_tokenizer_round_trips_any_text(tokenizer: SentencePieceTokenizer) -> None:
    text = "héllo  wörld 🚀 日本語\n\tindented\r\n  ∑ ≠ \x00 end"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert all(0 <= i < tokenizer.vocab_size for i in ids)
    assert (tokenizer.vocab_size, tokenizer.bos_id, tokenizer.eos_id) == (VOCAB, 1, 2)


def test_tokenizer_training_is_deterministic(corpus: Path, tokenizer: SentencePieceTokenizer, tmp_path: Path) -> None:
    again = train_tokenizer(_source_files(str(corpus)), VOCAB, tmp_path / "again.model")
    assert again.read_bytes() == tokenizer.path.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again.model"]  # no temp files left


def test_tokenizer_rejects_non_model(tmp_path: Path) -> None:
    bogus = tmp_path / "x.model"
    bogus.write_text("not a model")
    with pytest.raises(ConfigError, match=r"data\.tokenizer=.*not a sentencepiece model"):
        SentencePieceTokenizer(bogus)


# --- packed tokens ---------------------------------------------------------------------------------


def test_packed_tokens_match_direct_encoding(
    corpus: Path, tokenizer: SentencePieceTokenizer, packed: PackedTokens
) -> None:
    files = _source_files(str(corpus))
    assert [f.relative_to(corpus).as_posix() for f in files] == ["a.txt", "c.md", "d.jsonl", "sub/b.py"]
    documents = [f.read_text() for f in files if f.suffix != ".jsonl"]
    documents[2:2] = [json.loads(line)["text"] for line in (corpus / "d.jsonl").read_text().splitlines()]
    expected = [t for doc in documents for t in [1, *tokenizer.encode(doc), 2]]
    assert packed.num_tokens == len(expected)
    assert packed.meta["dtype"] == "uint16" and packed.meta["num_documents"] == len(documents)
    assert packed.meta["vocab_size"] == VOCAB and len(packed.meta["tokenizer_sha256"]) == 64
    # The hash of every byte written, computed while writing: what a resume compares.
    assert packed.meta["tokens_sha256"] == hashlib.sha256((packed.path / TOKENS_FILE).read_bytes()).hexdigest()
    assert packed.meta["tokens_sha256"] == hashlib.sha256(np.asarray(expected, np.uint16).tobytes()).hexdigest()
    seq_len = 16
    assert packed.num_sequences(seq_len) == (len(expected) - 1) // seq_len
    for index in (0, 3, packed.num_sequences(seq_len) - 1):
        window = packed.sequence(index, seq_len)
        assert window.dtype == np.int64
        assert window.tolist() == expected[index * seq_len : index * seq_len + seq_len + 1]


def test_documents_keep_their_bytes_and_empty_ones_add_nothing(tokenizer: SentencePieceTokenizer, tmp_path: Path) -> None:
    root = tmp_path / "corpus"
    root.mkdir()
    (root / "a.txt").write_bytes(b"one\r\ntwo\rthree\n")  # CRLF and a lone CR, as written
    (root / "b.txt").write_bytes(b"")
    (root / "c.jsonl").write_text(json.dumps({"text": ""}) + "\n" + json.dumps({"text": "x\r\ny"}) + "\n")
    files = _source_files(str(root))
    documents = [doc for path in files for doc in iter_documents(path)]
    assert documents == ["one\r\ntwo\rthree\n", "x\r\ny"]
    packed = PackedTokens(_pack(files, tokenizer, tmp_path / "packed", lambda line: None))
    expected = [t for doc in documents for t in [1, *tokenizer.encode(doc), 2]]
    assert packed.meta["num_documents"] == 2
    assert packed.sequence(0, packed.num_tokens - 1).tolist() == expected
    assert tokenizer.decode(tokenizer.encode(documents[0])) == documents[0]


def test_a_source_with_no_text_is_one_line(tokenizer: SentencePieceTokenizer, tmp_path: Path) -> None:
    root = tmp_path / "corpus"
    root.mkdir()
    (root / "a.txt").write_bytes(b"")
    (root / "b.jsonl").write_text(json.dumps({"text": ""}) + "\n\n")
    with pytest.raises(ConfigError, match=r'^data.source holds no text \(empty files, or empty "text" fields only\)$'):
        _pack(_source_files(str(root)), tokenizer, tmp_path / "packed", lambda line: None)
    assert not any(p.name.startswith(".packed") for p in tmp_path.iterdir())  # nothing half-written left


def test_a_damaged_meta_json_is_one_line_saying_how_to_rebuild(packed: PackedTokens, tmp_path: Path) -> None:
    copy = tmp_path / "tokens"
    shutil.copytree(packed.path, copy)
    for text, reason in (("{broken", "unreadable \\(JSONDecodeError\\)"), ("[1, 2]", "missing some of num_tokens")):
        (copy / "meta.json").write_text(text)
        with pytest.raises(ConfigError, match=rf"^packed tokens {copy}: meta.json is {reason}.*delete the folder"):
            PackedTokens(copy)


def test_packed_tokens_too_short_names_seq_len(packed: PackedTokens) -> None:
    with pytest.raises(ConfigError, match="seq_len="):
        packed.num_sequences(packed.num_tokens)


def test_failed_write_leaves_nothing(tokenizer: SentencePieceTokenizer, tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"no_text": 1}\n')
    with pytest.raises(ConfigError, match=r"data.source=.*bad.jsonl:2"):
        _pack([bad], tokenizer, tmp_path / "out" / "tokens", lambda line: None)
    assert list((tmp_path / "out").iterdir()) == []


@pytest.mark.parametrize("line, fragment", [
    ('{"text": "abc \\ud800 def"}', "is not Unicode text (surrogates not allowed '\\ud800' at character 4)"),
    ('{"text": "a", "x": ' + "[" * 100_000 + "]" * 100_000 + "}", "cannot be read: RecursionError"),
    ('{"text": "a", "n": ' + "9" * 5000 + "}", "cannot be read: ValueError: Exceeds the limit"),
])
def test_json_that_python_cannot_take_names_its_line(tmp_path: Path, line: str, fragment: str) -> None:
    """Valid JSON past what Python or a tokenizer takes (a lone surrogate, deep nesting, a huge integer)
    is bad data like any other: one ConfigError naming the file and line."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n' + line + "\n")
    with pytest.raises(ConfigError) as caught:
        list(iter_documents(bad))
    assert str(caught.value).startswith(f"data.source={bad}:2") and fragment in str(caught.value), caught.value


# --- batch loader ----------------------------------------------------------------------------------


def test_batch_loader_shapes_and_shift(packed: PackedTokens) -> None:
    seq_len, dp_size = 8, 2
    sampler = GlobalBatchSampler(packed.num_sequences(seq_len), global_batch_size=8, seed=0)
    loader = BatchLoader(packed, sampler, seq_len, dp_rank=1, dp_size=dp_size, microbatch_size=2)
    microbatches = loader.batch(step=3)
    assert len(microbatches) == 2
    rank_indices = sampler.rank_indices(3, 1, dp_size).tolist()
    rows = [row for inputs, targets in microbatches for row in zip(inputs, targets, strict=True)]
    for index, (inputs, targets) in zip(rank_indices, rows, strict=True):
        window = packed.sequence(index, seq_len)
        assert inputs.tolist() == window[:-1].tolist() and targets.tolist() == window[1:].tolist()
    for inputs, targets in microbatches:
        assert inputs.shape == targets.shape == (2, seq_len) and inputs.dtype == targets.dtype == torch.int64
        assert torch.equal(inputs[:, 1:], targets[:, :-1])


def test_batch_loader_microbatch_must_divide(packed: PackedTokens) -> None:
    sampler = GlobalBatchSampler(packed.num_sequences(8), global_batch_size=8, seed=0)
    with pytest.raises(ConfigError, match="microbatch_size=3"):
        BatchLoader(packed, sampler, 8, dp_rank=0, dp_size=2, microbatch_size=3)


# --- prepare_dataset -------------------------------------------------------------------------------


def test_missing_and_empty_sources(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^data.source=/no/such/dir does not exist$"):
        prepare_dataset("/no/such/dir", None, VOCAB, tmp_path, True, print)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "x.bin").write_bytes(b"0")
    with pytest.raises(ConfigError, match=r"data\.source=.*empty contains no"):
        _source_files(str(tmp_path / "empty"))
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    with pytest.raises(ConfigError, match=r"data\.source=.*loop is a link that leads nowhere$"):
        _source_files(str(tmp_path / "loop"))
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(ConfigError, match=r"data\.source=.*fifo is neither a file nor a folder"):
        _source_files(str(tmp_path / "fifo"))


def test_folder_sources_follow_linked_folders_skip_hidden_ones_and_check_each_file(
    tokenizer: SentencePieceTokenizer, tmp_path: Path
) -> None:
    root, elsewhere = tmp_path / "corpus", tmp_path / "elsewhere"
    for folder in (root / "own", root / ".git", elsewhere):
        folder.mkdir(parents=True)
    (root / "own" / "a.txt").write_text("alpha")
    (root / ".git" / "b.txt").write_text("tooling")
    (elsewhere / "c.md").write_text("gamma")
    (root / "linked").symlink_to(elsewhere)  # a corpus assembled from links
    (elsewhere / "loop").symlink_to(root)  # and a loop back, read once
    (root / "zz_latest.txt").symlink_to(root / "own" / "a.txt")  # a file under two names: read once,
    os.link(elsewhere / "c.md", root / "own" / "hard.md")  # also when hard-linked
    files = _source_files(str(root))
    assert [p.relative_to(root).as_posix() for p in files] == ["linked/c.md", "own/a.txt"]
    # Another encoding inside a folder is refused by name (a single-file source is checked up front).
    (root / "own" / "d.txt").write_text("delta " * 50, encoding="utf-16")
    with pytest.raises(ConfigError, match=r"^data.source file .*own/d.txt is not UTF-8 text \(invalid byte at offset 0\)$"):
        _pack(_source_files(str(root)), tokenizer, tmp_path / "packed", print)
    (root / "own" / "d.txt").write_bytes(b"delta\xff")  # a short file has no cut character to excuse
    with pytest.raises(ConfigError, match=r"own/d.txt is not UTF-8 text \(invalid byte at offset 5\)"):
        _pack(_source_files(str(root)), tokenizer, tmp_path / "packed", print)


def test_ranks_that_see_other_files_stop_before_any_waiting(corpus: Path, tmp_path: Path, monkeypatch) -> None:
    """A rank whose source files differ (another node's copy, another Python's stdlib) would wait an
    hour for a cache the main rank never builds: all ranks compare cache keys first."""
    from trainer.data import build

    keys = []

    def disagree(key: str) -> None:
        keys.append(key)
        raise ConfigError("stop here")

    with pytest.raises(ConfigError, match="stop here"):
        prepare_dataset(str(corpus), None, VOCAB, tmp_path, False, print, agree=disagree)
    assert len(keys) == 1 and not any(tmp_path.iterdir())  # nothing built, nothing waited for
    monkeypatch.setattr(build.comm, "all_gather_object", lambda obj, group: [obj, obj, "other"])
    with pytest.raises(ConfigError, match=r"^data.source: rank 2 sees other source files or tokenizer than rank 0"):
        build.same_data_on_every_rank(keys[0])
    monkeypatch.setattr(build.comm, "all_gather_object", lambda obj, group: [obj, obj])
    build.same_data_on_every_rank(keys[0])


def test_given_tokenizer_is_checked(corpus: Path, tokenizer: SentencePieceTokenizer, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=rf"^model.vocab_size=300 is below the tokenizer's vocabulary size {VOCAB} "
                                          rf"\(data.tokenizer={tokenizer.path}\): "):
        prepare_dataset(str(corpus), tokenizer.path, 300, tmp_path, True, print)
    with pytest.raises(ConfigError, match=r"data.tokenizer=/no/spm.model does not exist"):
        prepare_dataset(str(corpus), "/no/spm.model", VOCAB, tmp_path, True, print)
    with pytest.raises(ConfigError, match=rf"^data.tokenizer={tmp_path} is a folder without tokenizer.json or "
                                          r"tokenizer.model or original/tokenizer.model$"):
        prepare_dataset(str(corpus), str(tmp_path), VOCAB, tmp_path, True, print)
    tok, tokens = prepare_dataset(str(corpus), tokenizer.path, VOCAB, tmp_path, True, lambda line: None)
    assert tok.path == tokenizer.path and tokens.meta["tokenizer_sha256"]
    assert not list(tmp_path.glob("tokenizer-*"))  # a given tokenizer is not retrained
    # More rows than ids (a padded vocabulary) pack the same tokens, from the same cache.
    _, padded = prepare_dataset(str(corpus), tokenizer.path, 512, tmp_path, True, lambda line: None)
    assert padded.path == tokens.path


def test_tokens_packed_with_another_tokenizer_are_refused(corpus: Path, tokenizer: SentencePieceTokenizer, tmp_path: Path) -> None:
    """E.g. the tokenizer folder was deleted and trained again by another sentencepiece version, while
    the tokens folder of the same key stayed: the tokens must not be read with the new tokenizer."""
    _, tokens = prepare_dataset(str(corpus), tokenizer.path, VOCAB, tmp_path, True, lambda line: None)
    meta = json.loads((tokens.path / "meta.json").read_text())
    assert meta["tokenizer_sha256"] == tokenizer.sha256 == hashlib.sha256(tokenizer.path.read_bytes()).hexdigest()
    (tokens.path / "meta.json").write_text(json.dumps(meta | {"tokenizer_sha256": "0" * 64}))
    with pytest.raises(ConfigError, match=rf"^data.cache_dir: {tokens.path} was packed with another tokenizer than "
                                          rf"{tokenizer.path}; delete {tokens.path} to pack the data again$"):
        prepare_dataset(str(corpus), tokenizer.path, VOCAB, tmp_path, True, lambda line: None)


def test_a_source_written_to_while_it_is_packed_is_not_published(tokenizer: SentencePieceTokenizer, tmp_path: Path) -> None:
    source = tmp_path / "a.txt"
    source.write_text("alpha beta\n")
    keyed = sources_fingerprint([source])  # when the cache key was taken
    with source.open("a") as f:
        f.write("gamma\n")
    with pytest.raises(ConfigError, match=r"^data.source changed while it was being prepared"):
        write_packed_tokens([source], tokenizer, tmp_path / "out" / "tokens", progress=print, sources=keyed)
    assert list((tmp_path / "out").iterdir()) == []


def test_a_tokenizer_trained_on_a_source_written_to_meanwhile_is_not_kept(corpus: Path, tmp_path: Path,
                                                                          monkeypatch) -> None:
    train = data.train_tokenizer

    def train_while_a_file_changes(files, vocab_size, model_path, fmt):
        path = train(files, vocab_size, model_path, fmt)
        files[0].touch()  # a writer appends during training: the mtime moves
        return path

    source = tmp_path / "corpus"
    shutil.copytree(corpus, source)
    monkeypatch.setattr(data, "train_tokenizer", train_while_a_file_changes)
    with pytest.raises(ConfigError, match=r"^data.source changed while it was being prepared"):
        prepare_dataset(str(source), None, VOCAB, tmp_path / "cache", True, lambda line: None)
    assert not list((tmp_path / "cache").glob("tokenizer-*/*.model")) and not list((tmp_path / "cache").glob("tokens-*"))


def test_the_tokenizer_is_read_once(tokenizer: SentencePieceTokenizer, tmp_path: Path) -> None:
    """What checkpoints and exports carry, and the fingerprint's sha, are the model in use, even when
    its file is replaced during the run."""
    path = tmp_path / "spm.model"
    shutil.copyfile(tokenizer.path, path)
    loaded = SentencePieceTokenizer(path)
    path.write_bytes(b"another model")
    assert loaded.model_bytes == tokenizer.path.read_bytes()
    assert loaded.sha256 == hashlib.sha256(tokenizer.path.read_bytes()).hexdigest()
    assert loaded.encode("alpha beta") == tokenizer.encode("alpha beta")


def test_cache_is_built_once_and_half_written_folders_never_count(corpus: Path, tmp_path: Path) -> None:
    lines: list[str] = []
    _, first = prepare_dataset(str(corpus), None, VOCAB, tmp_path, True, lines.append)
    assert any("training a BPE tokenizer" in line for line in lines)
    lines.clear()
    _, cached = prepare_dataset(str(corpus), None, VOCAB, tmp_path, True, lines.append)
    assert len(lines) == 1 and "cached" in lines[0] and cached.path == first.path
    # What a killed writer (temp folder) or an interrupted copy (no meta.json) leaves behind.
    expected = (first.path / "tokens.bin").read_bytes()
    shutil.rmtree(first.path)
    for leftover in (tmp_path / f".{first.path.name}.tmpabc", first.path):
        leftover.mkdir()
        (leftover / "tokens.bin").write_bytes(expected[:10])
        assert not is_complete(leftover)
    lines.clear()
    _, rebuilt = prepare_dataset(str(corpus), None, VOCAB, tmp_path, True, lines.append)
    assert not any("training" in line for line in lines)  # the finished tokenizer is reused
    assert (rebuilt.path / "tokens.bin").read_bytes() == expected


def test_a_cache_published_by_another_job_is_not_packed_again(corpus: Path, tokenizer: SentencePieceTokenizer,
                                                              tmp_path: Path, monkeypatch) -> None:
    """The ranks waiting on this main rank go on as soon as the cache is complete, into collectives that time
    out: so the main rank must not pack a copy it throws away. (a) Tokens complete and only the trained
    tokenizer gone: it is trained again and the tokens read. (b) Another job sharing data.cache_dir publishes
    the tokens being packed: packing stops at the next batch and theirs are read."""
    _, first = prepare_dataset(str(corpus), None, VOCAB, tmp_path / "a", True, print)
    shutil.rmtree(next((tmp_path / "a").glob("tokenizer-*")))

    def no_packing(*args, **kwargs):
        raise AssertionError("packed again")

    with monkeypatch.context() as patch:
        patch.setattr(data, "write_packed_tokens", no_packing)
        lines: list[str] = []
        _, again = prepare_dataset(str(corpus), None, VOCAB, tmp_path / "a", True, lines.append)
    assert any("training a BPE tokenizer" in line for line in lines) and again.path == first.path
    files = _source_files(str(corpus))
    theirs = _pack(files, tokenizer, tmp_path / "theirs")
    out, seen = tmp_path / "b" / "tokens", []
    read = shards.iter_records

    def publishing_theirs(*args, **kwargs):  # another job finishes once this one has read its first file
        yield from read(*args, **kwargs)
        if not out.exists():
            shutil.copytree(theirs, out)

    monkeypatch.setattr(shards, "iter_records", publishing_theirs)
    written = write_packed_tokens(files, tokenizer, out, progress=seen.append, sources=sources_fingerprint(files),
                                  batch_chars=64)
    assert written == out and (out / "tokens.bin").read_bytes() == (theirs / "tokens.bin").read_bytes()
    assert any("published meanwhile by another job" in line for line in seen)
    assert [p.name for p in out.parent.iterdir()] == ["tokens"]  # this writer's temp folder is gone


def test_a_complete_cache_is_read_without_writing_anything(corpus: Path, tmp_path: Path, monkeypatch) -> None:
    """A cache prepared once may be shared from a read-only mount."""
    _, built = prepare_dataset(str(corpus), None, VOCAB, tmp_path, True, print)

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    for method in ("unlink", "mkdir", "write_text", "write_bytes", "touch"):
        monkeypatch.setattr(Path, method, read_only)
    monkeypatch.setattr(os, "replace", read_only)
    _, cached = prepare_dataset(str(corpus), None, VOCAB, tmp_path, True, print)
    assert cached.path == built.path and cached.num_tokens == built.num_tokens


def test_a_cache_dir_that_cannot_hold_the_cache_is_one_line(corpus: Path, tmp_path: Path) -> None:
    """Checked before anything slow (and before the error marker, which would land in it too)."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    for cache_dir in (blocker, blocker / "below"):
        with pytest.raises(ConfigError, match=rf"data.cache_dir={cache_dir} is not a writable folder: .*builds the cache"):
            prepare_dataset(str(corpus), None, VOCAB, cache_dir, True, print)


def test_default_corpus_end_to_end() -> None:
    """The built-in default data (the stdlib's source) through the shared cache, vocab 512."""
    files = default_corpus_files()
    assert len(files) > 100 and all(f.suffix == ".py" for f in files)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    assert not any({"test", "tests", "site-packages"} & set(f.relative_to(stdlib).parts) for f in files)
    tokenizer, tokens = prepare_dataset(None, None, 512, SHARED_CACHE, True, lambda line: None)
    assert tokenizer.vocab_size == tokens.vocab_size == 512
    non_empty = [f for f in files if f.stat().st_size > 0]  # an empty __init__.py is no document
    assert len(non_empty) < len(files)
    assert tokens.num_tokens > 1_000_000 and tokens.meta["num_documents"] == len(non_empty)
    sampler = GlobalBatchSampler(tokens.num_sequences(128), global_batch_size=8, seed=0)
    inputs, _ = BatchLoader(tokens, sampler, 128, 0, 1, 4).batch(0)[0]
    assert inputs.shape == (4, 128) and int(inputs.max()) < 512
    assert tokenizer.decode(inputs[0].tolist())  # real text comes back out
