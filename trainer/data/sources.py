"""Where the training text comes from: `data.source`'s files (or, by default, the Python standard library's
own source: real text on every machine, with no download), which of them hold JSON lines, whether each is
text, and a cheap fingerprint of them all (of the files' bytes as stored, compressed or not). records.py
reads the documents in them.
"""

import hashlib
import os
import sysconfig
from functools import partial
from pathlib import Path
from typing import NamedTuple

from parallel.errors import ConfigError
from trainer.data.compression import CORRUPT_ERRORS, compression_of, open_decompressed

JSON_LINES_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")
SOURCE_SUFFIXES = (".txt", *JSON_LINES_SUFFIXES, ".md", ".py")
# Test suites are left out of the default corpus: they are huge, repetitive and full of odd encodings.
EXCLUDED_STDLIB_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test"})


def default_corpus_files() -> list[Path]:
    """The standard library's .py files (no site-packages, no test suites), sorted by relative path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for folder, subfolders, names in os.walk(root):
        # Pruned during the walk: site-packages alone can be far larger than the stdlib.
        subfolders[:] = [name for name in subfolders if name not in EXCLUDED_STDLIB_DIRS]
        files.extend(Path(folder) / name for name in names if name.endswith(".py"))
    return sorted(files, key=lambda path: str(path.relative_to(root)))


class SourceFiles(NamedTuple):
    files: list[Path]  # to train on, sorted by name
    left_out: list[Path]  # visible files under the folder, left out for their suffix
    links: dict[Path, Path]  # a name left out -> the name its file is read under (linked twice)


def list_source(source: str | None) -> SourceFiles:
    """`data.source`'s files; None or "stdlib": the default corpus."""
    if source is None or source == "stdlib":
        return SourceFiles(default_corpus_files(), [], {})
    root = Path(source).expanduser()
    if not root.exists():
        broken = root.is_symlink()  # exists() follows links: a dangling or looping link reads as absent
        raise ConfigError(f"data.source={source} {'is a link that leads nowhere' if broken else 'does not exist'}")
    if root.is_file():
        _check_text_file(root, source)
        return SourceFiles([root], [], {})
    if not root.is_dir():
        raise ConfigError(f"data.source={source} is neither a file nor a folder (a pipe, socket or device)")
    visible = [path for path in _visible_files_under(root) if path.is_file()]
    files = [path for path in visible if _is_source_suffix(path)]
    if not files:
        raise ConfigError(f"data.source={source} contains no {'/'.join(SOURCE_SUFFIXES)} files")
    by_name = partial(_relative_name, root)
    left_out = sorted((path for path in visible if not _is_source_suffix(path)), key=by_name)
    once, links = _once_each(sorted(files, key=by_name))
    return SourceFiles(once, left_out, links)


def _once_each(files: list[Path]) -> tuple[list[Path], dict[Path, Path]]:
    """A file linked under several names is read once, under its first name in order: read twice it
    would be trained on twice, and a copy sorted last would land in the held-out tail. Returns the
    names read and, for each name dropped, the name its file is read under."""
    first_name, once, links = {}, [], {}
    for path in files:
        stat = path.stat()
        identity = (stat.st_dev, stat.st_ino) if stat.st_ino else path.resolve()  # 0: no inode numbers
        if identity in first_name:
            links[path] = first_name[identity]
        else:
            first_name[identity] = path
            once.append(path)
    return once, links


def _is_source_suffix(path: Path) -> bool:
    return path.name.lower().endswith(SOURCE_SUFFIXES)  # NOTES.TXT is text as notes.txt is


def is_json_lines(path: Path) -> bool:
    """Whether `path` holds one JSON record a line (compressed or not), rather than one document."""
    return path.name.lower().endswith(JSON_LINES_SUFFIXES)


def _relative_name(root: Path, path: Path) -> str:
    return str(path.relative_to(root))


def _check_text_file(path: Path, source: str) -> None:
    """A file named on its own is checked on every rank before anything else; a folder's files are
    filtered by suffix here and checked as the main rank reads them (records.py)."""
    if not _is_source_suffix(path):
        raise ConfigError(f"data.source={source} is not a {'/'.join(SOURCE_SUFFIXES)} file")
    reason = not_text_reason(path)
    if reason is not None:
        raise ConfigError(f"data.source={source} {reason}")


def _visible_files_under(root: Path) -> list[Path]:
    """Every file under `root` outside hidden folders (.git, .venv, .cache hold tooling, not training
    text), following symlinked folders as a corpus assembled from links needs; each real folder is
    read once, so a link loop ends, under the first of its names in sorted order (the walk visits
    subfolders sorted, so the names, and the document order, do not depend on the filesystem)."""
    seen, files = set(), []
    for folder, subfolders, names in os.walk(root, followlinks=True):
        real = os.path.realpath(folder)
        if real in seen:
            subfolders[:] = []
            continue
        seen.add(real)
        subfolders[:] = sorted(name for name in subfolders if not name.startswith("."))
        files.extend(Path(folder) / name for name in names if not name.startswith("."))
    return files


TEXT_CHECK_BYTES = 1 << 20  # how much of each source file must be UTF-8 text


def not_text_reason(path: Path) -> str | None:
    """Why `path` is not UTF-8 text, or None. Checked on its first TEXT_CHECK_BYTES only: a file in
    another encoding (UTF-16, Latin-1) or a binary one shows there, while a stray bad byte further on
    is replaced when read rather than fatal. A compressed file is checked on its decompressed text."""
    try:
        with open_decompressed(path) as f:
            head = f.read(TEXT_CHECK_BYTES)
            whole_file = not f.read(1)
    except CORRUPT_ERRORS as exc:
        return f"is not a readable {compression_of(path)} file ({exc})"
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        if whole_file or e.start < len(head) - 3:  # not just a character cut at the end of the sample
            return f"is not UTF-8 text (invalid byte at offset {e.start})"
    if b"\0" in head:
        return "is not text (it contains NUL bytes)"
    return None


_SAMPLE_BYTES = 4096
# Pages read per file (every rank, every start): a file up to this many pages is hashed whole.
_SAMPLE_PAGES = 16


SOURCE_CHANGED = ("data.source changed while it was being prepared (a file was written to or replaced); "
                  "start again once it is complete")


def sources_fingerprint(text_files: list[Path]) -> str:
    """Cheap fingerprint of the corpus: absolute path, size, mtime and content of every file, whole up
    to 64 KiB, else 16 pages of 4 KiB spread evenly from its first to its last byte. The content catches
    a file replaced by another of the same size with its mtime kept (`cp -p`, `rsync -t`, an archive of
    another version), which size and mtime alone miss; in a larger file, a same-size edit between the
    pages with the mtime kept is not seen (remove its tokens-* and tokenizer-* folders to re-pack)."""
    digest = hashlib.sha256()
    for path in text_files:
        stat = path.stat()
        digest.update(f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
        with open(path, "rb") as f:
            for offset in _sample_offsets(stat.st_size):
                f.seek(offset)
                digest.update(f.read(_SAMPLE_BYTES))
    return digest.hexdigest()


def _sample_offsets(size: int) -> list[int]:
    """Start of each sampled page: every page of a small file, else evenly spaced, first and last included."""
    pages = -(-size // _SAMPLE_BYTES)
    if pages <= _SAMPLE_PAGES:
        return [i * _SAMPLE_BYTES for i in range(pages)]
    last = size - _SAMPLE_BYTES
    return [last * i // (_SAMPLE_PAGES - 1) for i in range(_SAMPLE_PAGES)]
