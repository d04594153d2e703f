"""Which files data.source trains on, in which order, and when a changed file rebuilds the cache."""

import os
from pathlib import Path

import numpy as np
import pytest

from parallel.errors import ConfigError
from tests.source_kinds import write_megatron
from trainer.data import prepare as data_module
from trainer.data.prepare import prepare_dataset
from trainer.data.records import iter_documents
from trainer.data.sources import check_disjoint, list_source, sources_fingerprint


class _Stop(Exception):
    pass


def _stop_before_building(*args: object) -> None:
    raise _Stop


def _logs_until_building(root: Path, tmp_path: Path, monkeypatch) -> list[str]:
    """What the main rank logs about `root` before it starts building the cache."""
    logs: list[str] = []
    monkeypatch.setattr(data_module, "_build", _stop_before_building)
    with pytest.raises(_Stop):
        prepare_dataset(str(root), None, 300, tmp_path / "cache", True, logs.append)
    return logs


def _edit_keeping_size_and_mtime(path: Path, offset: int) -> None:
    stat = path.stat()
    data = bytearray(path.read_bytes())
    data[offset] = ord("b")
    path.write_bytes(bytes(data))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # what cp -p or rsync -t keep
    assert path.stat().st_size == stat.st_size and path.stat().st_mtime_ns == stat.st_mtime_ns


@pytest.mark.parametrize("size, offset", [
    (150_000, 0), (150_000, 150_000 - 10),  # a large file's first and last pages
    (150_000, (150_000 - 4096) * 7 // 15 + 100),  # one of the pages spread between them
    (60_000, 30_001),  # a file up to 64 KiB is hashed whole: any byte
])
def test_a_file_replaced_with_same_size_and_mtime_changes_the_cache_key(tmp_path: Path, size: int,
                                                                         offset: int) -> None:
    path = tmp_path / "corpus.txt"
    path.write_bytes(b"a" * size)
    before = sources_fingerprint([path])
    _edit_keeping_size_and_mtime(path, offset)
    assert sources_fingerprint([path]) != before


def test_suffixes_match_in_any_case_and_the_rest_is_named_in_the_log(tmp_path: Path, monkeypatch) -> None:
    root = tmp_path / "corpus"
    root.mkdir()
    (root / "a.txt").write_text("alpha")
    (root / "B.TXT").write_text("beta")
    (root / "README.Md").write_text("gamma")
    (root / "x.JSONL").write_text('{"text": "delta"}\n')
    (root / "model.bin").write_bytes(b"\x00")
    (root / ".hidden.txt").write_text("tooling")
    files, left_out, _ = list_source(str(root))
    assert [p.name for p in files] == ["B.TXT", "README.Md", "a.txt", "x.JSONL"]
    assert [p.name for p in left_out] == ["model.bin"]
    assert list(iter_documents(root / "x.JSONL")) == ["delta"]  # read as JSON lines, not as text
    logs = _logs_until_building(root, tmp_path, monkeypatch)
    assert f"data: left out 1 file(s) under data.source={root} that are none of .txt/.jsonl/.jsonl.gz/.jsonl.zst/.md/" \
           f".py/.parquet files, Hugging Face dataset folders (save_to_disk) or Megatron .bin/.idx pairs, e.g. " \
           f"{root / 'model.bin'}" in logs


def test_a_folder_reached_under_two_names_is_read_under_the_first_in_sorted_order(tmp_path: Path,
                                                                                   monkeypatch) -> None:
    """Whatever order the filesystem lists them in, the name kept (and so the document order) is the
    same everywhere; the log says that names were dropped."""
    root = tmp_path / "corpus"
    (root / "m_real").mkdir(parents=True)
    (root / "m_real" / "doc.txt").write_text("doc")
    (root / "z_link").symlink_to(root / "m_real")
    (root / "a_link").symlink_to(root / "m_real")
    (root / "n.txt").write_text("n")
    (root / "zz.txt").symlink_to(root / "n.txt")  # a file under two names: read once too
    files, _, links = list_source(str(root))
    assert [p.relative_to(root).as_posix() for p in files] == ["a_link/doc.txt", "n.txt"]
    assert {link.relative_to(root).as_posix(): kept.relative_to(root).as_posix() for link, kept in links.items()} \
        == {"zz.txt": "n.txt"}
    logs = _logs_until_building(root, tmp_path, monkeypatch)
    assert f"data: read 1 file(s) under data.source={root} once though linked under several names, e.g. " \
           f"{root / 'zz.txt'} (read as {root / 'n.txt'})" in logs


def test_a_vocabulary_too_small_for_a_trained_tokenizer_is_refused_before_the_source_is_read(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("alpha")
    logs: list[str] = []
    with pytest.raises(ConfigError, match=r"^model.vocab_size=100 must be >= 260 \(the tokenizer trained on data.source"):
        prepare_dataset(str(tmp_path), None, 100, tmp_path / "cache", True, logs.append)
    assert logs == [] and not (tmp_path / "cache").exists()


def test_blend_sources_that_hold_the_same_file_under_other_names_are_refused(tmp_path: Path) -> None:
    """A Megatron prefix and its .bin, or a folder and a file in it, pass the config's name check but would
    train on the same documents at the sum of both weights: one line naming both sources and the file."""
    (tmp_path / "mega").mkdir()
    bin_path = write_megatron(tmp_path / "mega" / "corpus", [[1, 2, 3]], np.int32)
    prefix = str(bin_path)[: -len(".bin")]
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "a.jsonl").write_text('{"text": "one"}\n')
    (folder / "b.txt").write_text("two")
    check_disjoint([prefix, str(folder), None])  # three different sources
    linked = tmp_path / "linked"
    linked.mkdir()
    os.link(folder / "b.txt", linked / "b.txt")  # a hard link: another path, the same file
    for sources, shared in (([prefix, str(bin_path)], bin_path), ([prefix + ".idx", prefix], bin_path),
                            ([str(folder), str(folder / "a.jsonl")], folder / "a.jsonl"),
                            ([str(folder), str(linked)], linked / "b.txt")):
        with pytest.raises(ConfigError) as info:
            check_disjoint(sources)
        message = str(info.value)
        assert "\n" not in message and f"data.source[0]={sources[0]}" in message
        assert f"data.source[1]={sources[1]}" in message and f"both hold {shared}" in message


@pytest.mark.parametrize("name, text", [("doc.jsonl", '{"text": "first"}\n{"text": "second"}\n'),
                                        ("doc.txt", "first\nsecond\n")])
def test_a_byte_order_mark_is_not_part_of_the_first_document(tmp_path: Path, name: str, text: str) -> None:
    """Editors on Windows start UTF-8 files with a BOM: it is no text (a .txt file's first token would hold
    it) and no JSON (the first line would be a bad record, silently skipped under data.bad_records=skip)."""
    plain, marked = tmp_path / "plain", tmp_path / "marked"
    plain.mkdir(), marked.mkdir()
    (plain / name).write_text(text, encoding="utf-8")
    (marked / name).write_text(text, encoding="utf-8-sig")
    assert (marked / name).read_bytes().startswith(b"\xef\xbb\xbf")
    documents = list(iter_documents(marked / name))
    assert documents == list(iter_documents(plain / name)) and documents[0].startswith("first")
