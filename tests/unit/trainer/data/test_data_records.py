"""Documents as users have them: another text field, compressed JSON lines, and bad records skipped or not."""

import gzip
import json
from pathlib import Path

import pytest
import zstandard

from parallel.errors import ConfigError
from tests.source_kinds import DOCUMENTS, train_small_tokenizer
from trainer.data.prepare import prepare_dataset
from trainer.data.records import RecordFormat
from trainer.data.shards import TOKENS_FILE
from trainer.data.tokenizer_spm import SentencePieceTokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> SentencePieceTokenizer:
    return train_small_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def _pack(source: Path, tokenizer, cache: Path, logs: list[str] | None = None, **fmt) -> bytes:
    """The packed tokens of `source`, with the given tokenizer and `fmt` (RecordFormat's fields)."""
    _, tokens = prepare_dataset(str(source), str(tokenizer.path), tokenizer.vocab_size, cache, True,
                                (logs if logs is not None else []).append, fmt=RecordFormat(**fmt))
    return (tokens.path / TOKENS_FILE).read_bytes()


def _jsonl(records: list) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in records).encode()


def test_a_text_key_packs_the_same_tokens_as_text_files(tmp_path: Path, tokenizer) -> None:
    texts = tmp_path / "texts"
    texts.mkdir()
    for i, document in enumerate(DOCUMENTS):
        (texts / f"doc{i:03d}.txt").write_bytes(document.encode())
    lines = tmp_path / "docs.jsonl"
    lines.write_bytes(_jsonl([{"id": i, "content": doc} for i, doc in enumerate(DOCUMENTS)]))
    expected = _pack(texts, tokenizer, tmp_path / "cache")
    logs: list[str] = []
    assert _pack(texts, tokenizer, tmp_path / "cache", logs, text_key="content") == expected
    assert [line for line in logs if line.startswith("data: cached")], logs  # text files read no key: no repack
    assert _pack(lines, tokenizer, tmp_path / "cache", text_key="content") == expected
    with pytest.raises(ConfigError, match=r'docs\.jsonl:1 has no string "text" field \(its keys: id, content\)$'):
        _pack(lines, tokenizer, tmp_path / "cache")  # the default key is another cache: not reused


def test_compressed_json_lines_pack_the_same_tokens_as_plain_ones(tmp_path: Path, tokenizer) -> None:
    data = _jsonl([{"text": doc} for doc in DOCUMENTS] * 50)
    plain = tmp_path / "plain.jsonl"
    plain.write_bytes(data)
    expected = _pack(plain, tokenizer, tmp_path / "cache")
    small_frames = zstandard.ZstdCompressor(level=3).compress
    for name, content in [("a.jsonl.gz", gzip.compress(data)), ("b.JSONL.GZ", gzip.compress(data)),
                          ("c.jsonl.zst", zstandard.ZstdCompressor().compress(data)),
                          ("d.Jsonl.Zst", small_frames(data[:1000]) + small_frames(data[1000:]))]:  # two frames
        (tmp_path / name).write_bytes(content)
        assert _pack(tmp_path / name, tokenizer, tmp_path / "cache") == expected, name


@pytest.mark.parametrize("name, compress", [("cut.jsonl.gz", gzip.compress),
                                            ("cut.jsonl.zst", zstandard.ZstdCompressor().compress)])
def test_a_corrupt_compressed_file_is_one_line_naming_it(tmp_path: Path, tokenizer, name, compress) -> None:
    whole = compress(_jsonl([{"text": doc} for doc in DOCUMENTS] * 2000))  # cut past the first MiB checked
    for content in (whole[: len(whole) // 2], b"not compressed at all"):
        source = tmp_path / name
        source.write_bytes(content)
        with pytest.raises(ConfigError, match=rf"^data\.source=?.*{name}.* is not a readable \w+ file \([^\n]+\)$"):
            _pack(source, tokenizer, tmp_path / "cache")


def _with_bad_lines(tmp_path: Path) -> Path:
    """1000 good records, a line that is not JSON (line 3) and one without "text" (line 7)."""
    lines = [json.dumps({"text": DOCUMENTS[i % len(DOCUMENTS)]}) for i in range(1000)]
    lines.insert(2, '{"text": "cut here')
    lines.insert(6, json.dumps({"id": 6, "body": "x"}))
    source = tmp_path / "bad.jsonl"
    source.write_text("\n".join(lines) + "\n")
    return source


def test_skip_counts_and_logs_bad_records_and_packs_the_good_ones(tmp_path: Path, tokenizer) -> None:
    source = _with_bad_lines(tmp_path)
    good = tmp_path / "good.jsonl"
    good.write_text("".join(line for line in source.read_text().splitlines(keepends=True)
                            if '"text": "cut' not in line and '"body"' not in line))
    logs: list[str] = []
    packed = _pack(source, tokenizer, tmp_path / "cache", logs, bad_records="skip", max_bad_fraction=0.01)
    assert packed == _pack(good, tokenizer, tmp_path / "cache")
    skipped = [line for line in logs if "skipped" in line]
    assert len(skipped) == 1 and skipped[0].startswith("data: skipped 2 bad record(s) of 1002 (0.1996%)")
    assert "bad.jsonl:3 is not valid JSON" in skipped[0]
    assert 'bad.jsonl:7 has no string "text" field (its keys: id, body)' in skipped[0]


def test_too_many_bad_records_are_refused_and_error_refuses_a_skipping_cache(tmp_path: Path, tokenizer) -> None:
    source = _with_bad_lines(tmp_path)
    cache = tmp_path / "cache"
    with pytest.raises(ConfigError, match=r"^data\.source has 2 bad records of 1002 \(0\.1996%\), more than "
                                          r"data\.max_bad_fraction=0\.001; first: [^\n]+$"):
        _pack(source, tokenizer, cache, bad_records="skip")
    with pytest.raises(ConfigError, match=r"^data\.bad_records=error, but \S+ was packed with "
                                          r"data\.bad_records=skip, which skipped 2 bad record\(s\)[^\n]+$"):
        _pack(source, tokenizer, cache)
    assert _pack(source, tokenizer, cache, bad_records="skip", max_bad_fraction=0.002)  # the same cache, reused


def test_a_carriage_return_between_a_records_tokens_or_ending_its_line_is_whitespace(tmp_path: Path, tokenizer) -> None:
    """JSON allows "\r" between tokens: read with universal newlines it cut the record in two (both
    halves bad, the record lost under skip, the lines after numbered wrong)."""
    lone = tmp_path / "lone_cr.jsonl"
    first, second = (json.dumps(d).encode() for d in DOCUMENTS[:2])
    lone.write_bytes(b'{"text": ' + first + b',\r"id": 1}\r\n{"text": ' + second + b'}\n')
    plain = tmp_path / "plain.jsonl"
    plain.write_bytes(_jsonl([{"text": DOCUMENTS[0]}, {"text": DOCUMENTS[1]}]))
    logs: list[str] = []
    assert _pack(lone, tokenizer, tmp_path / "cache", logs) == _pack(plain, tokenizer, tmp_path / "cache")
    assert not [line for line in logs if "skipped" in line]


def test_error_names_the_file_and_line_of_the_first_bad_record(tmp_path: Path, tokenizer) -> None:
    source = _with_bad_lines(tmp_path)
    with pytest.raises(ConfigError, match=r"^data\.source=\S+bad\.jsonl:3 is not valid JSON "
                                          r"\(Invalid control character at: column 19\)$"):  # the line's newline
        _pack(source, tokenizer, tmp_path / "cache")


def test_gzip_members_joined_with_cat_each_opening_with_a_bom_read_every_record(tmp_path: Path, tokenizer) -> None:
    joined = tmp_path / "joined.jsonl.gz"
    joined.write_bytes(b"".join(gzip.compress("\ufeff".encode() + _jsonl([{"text": doc}])) for doc in DOCUMENTS[:3]))
    plain = tmp_path / "plain.jsonl"
    plain.write_bytes(_jsonl([{"text": doc} for doc in DOCUMENTS[:3]]))
    assert _pack(joined, tokenizer, tmp_path / "cache") == _pack(plain, tokenizer, tmp_path / "cache")


def test_sources_whose_every_record_is_bad_say_so(tmp_path: Path, tokenizer) -> None:
    """Records under another key than data.text_key, all skipped: the line names them, not empty files."""
    source = tmp_path / "other_key.jsonl"
    source.write_bytes(_jsonl([{"content": doc} for doc in DOCUMENTS[:3]]))
    with pytest.raises(ConfigError, match=r'^data\.source holds no text \(empty files, or empty "text" fields only\); '
                                          r'3 of its 3 records were bad and skipped \(data\.bad_records=skip\), '
                                          r'first: \S+other_key\.jsonl:1 has no string "text" field \(its keys: content\)'):
        _pack(source, tokenizer, tmp_path / "cache", bad_records="skip")
    from trainer.data.tokenizer_spm import train_tokenizer

    with pytest.raises(ConfigError, match=r"^data\.source holds no text \(empty, or blank lines only\); 3 of its 3 "
                                          r"records were bad and skipped"):
        train_tokenizer([source], 320, tmp_path / "spm" / "tokenizer.model", RecordFormat(bad_records="skip"))

