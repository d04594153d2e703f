"""The documents in one source: a `.jsonl` line's `data.text_key` field (compressed or not), a Parquet or
Hugging Face dataset row's `data.text_key` column, a Megatron indexed dataset's documents (token ids, not
text), or a whole other file. A line or row that holds no document is a bad record: by default
(data.bad_records=error) one line naming file:line or file row N; with `skip` it is counted and skipped,
and the count is checked once packed."""

import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np

from parallel.errors import ConfigError
from trainer.data.compression import CORRUPT_ERRORS, compression_of, open_decompressed
from trainer.data.megatron_indexed import IndexedDataset
from trainer.data.sources import is_json_lines, not_text_reason, source_kind
from trainer.data.tables import dataset_rows, parquet_rows

_SHOWN_BAD_RECORDS = 3  # locations kept in meta.json and logged: enough to find the pattern
_SHOWN_KEYS = 10


class RecordFormat(NamedTuple):
    """How documents are read (data.text_key, data.bad_records, data.max_bad_fraction)."""
    text_key: str = "text"
    bad_records: str = "error"
    max_bad_fraction: float = 0.001


class BadRecord(ConfigError):
    """A record that holds no document; data.bad_records says whether it is fatal."""


class RecordCount:
    """The records one read of the sources met, and the bad ones skipped (the first few, with where and why)."""

    def __init__(self) -> None:
        self.records = self.skipped = 0
        self.first_skipped: list[str] = []

    def skip(self, reason: str) -> None:
        self.skipped += 1
        if len(self.first_skipped) < _SHOWN_BAD_RECORDS:
            self.first_skipped.append(reason)

    def skipped_note(self) -> str:
        """For a line saying the sources hold no text: that bad records were skipped, where they were
        the cause (a text_key no record has, say), or ""."""
        if not self.skipped:
            return ""
        return (f"; {self.skipped} of its {self.records} records were bad and skipped (data.bad_records=skip), "
                f"first: {'; '.join(self.first_skipped)}")

    def meta(self) -> dict:
        """What the packed tokens' meta.json records, for check_skipped to judge a run's policy against."""
        return {"records": self.records, "skipped_records": self.skipped, "first_skipped": self.first_skipped}


def iter_documents(path: Path, fmt: RecordFormat = RecordFormat(), count: RecordCount | None = None) -> Iterator[str]:
    """The text documents of one source (iter_records); a Megatron dataset, already tokenized, has none."""
    if source_kind(path) == "megatron":
        raise ConfigError(f"data.source {path} is a Megatron indexed dataset: already tokenized, it has no text "
                          "to train a tokenizer on; set data.tokenizer to the tokenizer that wrote it")
    yield from iter_records(path, fmt, count)


def iter_records(path: Path, fmt: RecordFormat = RecordFormat(),
                 count: RecordCount | None = None) -> Iterator[str | np.ndarray]:
    """Yields the documents of one source: each line's or row's text for JSON lines and tables, each
    document's token ids for a Megatron dataset, else the whole file, as written (line endings kept: CRLF
    stays CRLF). A document with no text or tokens is none. `count` (when given) tallies the records read
    and those skipped."""
    count = count if count is not None else RecordCount()
    kind = source_kind(path)
    if kind == "megatron":
        for ids in IndexedDataset(path).documents():
            count.records += 1
            if len(ids):
                yield ids
        return
    if kind in ("parquet", "hf_dataset"):
        rows = parquet_rows(path, fmt.text_key) if kind == "parquet" else dataset_rows(path, fmt.text_key)
        for row, value in rows:
            if text := _row_text(value, f"data.source={path} row {row}", fmt, count):
                yield text
        return
    yield from _text_documents(path, fmt, count)


def _text_documents(path: Path, fmt: RecordFormat, count: RecordCount) -> Iterator[str]:
    reason = not_text_reason(path)
    if reason is not None:
        raise ConfigError(f"data.source file {path} {reason}")
    json_lines = is_json_lines(path)
    try:
        # JSON lines end at "\n" alone: a lone "\r" is JSON whitespace (universal newlines cut the record
        # there), and a CRLF line's "\r" is whitespace before its end.
        with io.TextIOWrapper(open_decompressed(path), encoding="utf-8-sig", errors="replace",
                              newline="\n" if json_lines else "") as f:
            if not json_lines:
                count.records += 1
                if text := f.read():
                    yield text
                return
            for line_no, line in enumerate(f, start=1):
                if line.strip() and (text := _record_text(line, f"data.source={path}:{line_no}", fmt, count)):
                    yield text
    except CORRUPT_ERRORS as exc:
        raise ConfigError(f"data.source file {path} is not a readable {compression_of(path)} file ({exc})") from exc


def _row_text(value: str | UnicodeDecodeError | None, where: str, fmt: RecordFormat, count: RecordCount) -> str:
    """A table row's text; "" for a bad row skipped (its column is a string column: only nulls and bytes
    that are not UTF-8, which a writer that does not validate leaves, are bad)."""
    count.records += 1
    if isinstance(value, str):
        return value
    if value is None:
        reason = f'{where}: its "{fmt.text_key}" is null'
    else:
        reason = (f'{where}: its "{fmt.text_key}" is not UTF-8 text ({value.reason} '
                  f"{value.object[value.start]:#04x} at byte {value.start})")
    if fmt.bad_records == "error":
        raise BadRecord(reason)
    count.skip(reason)
    return ""


def _record_text(line: str, where: str, fmt: RecordFormat, count: RecordCount) -> str:
    """The line's text; "" for a bad record skipped."""
    count.records += 1
    try:
        # A byte-order mark opens each member of gzip files joined with `cat`: not part of the record.
        return _jsonl_text(line.removeprefix("\ufeff"), where, fmt.text_key)
    except BadRecord as exc:
        if fmt.bad_records == "error":
            raise
        count.skip(str(exc))
        return ""


def _jsonl_text(line: str, where: str, key: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise BadRecord(f"{where} is not valid JSON ({exc.msg}: column {exc.colno})") from exc
    except (RecursionError, ValueError) as exc:  # valid JSON past Python's limits: nesting, integer digits
        raise BadRecord(f"{where} cannot be read: {type(exc).__name__}: {str(exc).splitlines()[0]}") from exc
    if not isinstance(record, dict):
        raise BadRecord(f'{where} has no string "{key}" field (it is a JSON {type(record).__name__}, not an object)')
    if not isinstance(record.get(key), str):
        keys = ", ".join(list(record)[:_SHOWN_KEYS]) + (", ..." if len(record) > _SHOWN_KEYS else "")
        raise BadRecord(f'{where} has no string "{key}" field (its keys: {keys or "none"})')
    text = record[key]
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:  # JSON may escape a lone UTF-16 surrogate, which no tokenizer takes
        raise BadRecord(f'{where}: its "{key}" is not Unicode text ({exc.reason} {text[exc.start]!r} at '
                        f"character {exc.start})") from exc
    return text


def check_skipped(meta: dict, fmt: RecordFormat, tokens: Path) -> str | None:
    """The log line on the bad records packed `tokens` skipped (None: none), or one line refusing them under
    this run's data.bad_records and data.max_bad_fraction. Checked on the tokens rather than keyed in the
    cache: both policies pack the same tokens from the same records, so a cache is reused across them."""
    skipped, records = meta.get("skipped_records", 0), meta.get("records", 0)  # none in caches made before
    if not skipped:
        return None
    first = "; ".join(meta["first_skipped"])
    if fmt.bad_records == "error":
        raise ConfigError(f"data.bad_records=error, but {tokens} was packed with data.bad_records=skip, which "
                          f"skipped {skipped} bad record(s), first: {first}; set data.bad_records=skip or delete {tokens}")
    fraction = skipped / records
    if fraction > fmt.max_bad_fraction:
        raise ConfigError(f"data.source has {skipped} bad records of {records} ({fraction:.4%}), more than "
                          f"data.max_bad_fraction={fmt.max_bad_fraction:g}; first: {first}")
    return f"data: skipped {skipped} bad record(s) of {records} ({fraction:.4%}), first: {first}"
