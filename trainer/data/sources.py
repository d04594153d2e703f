"""Where the training text comes from: `data.source`'s files (or, by default, the Python standard library's
own source: real text on every machine, with no download), which kind each is, and a cheap fingerprint of
them all (of the bytes as stored, compressed or not). records.py reads the documents in them.

A source's kind comes from its layout and content, not from a key: text (.txt, .md, .py), JSON lines
(.jsonl, compressed or not), Parquet (.parquet, or any file that is one), a Hugging Face dataset folder
(what `datasets`' save_to_disk writes) or a Megatron indexed dataset (PREFIX.bin beside PREFIX.idx, named
by either file or by PREFIX, already tokenized).
"""

import hashlib
import os
import sysconfig
from functools import partial
from pathlib import Path
from typing import NamedTuple

from parallel.errors import ConfigError
from trainer.data.compression import CORRUPT_ERRORS, compression_of, open_decompressed
from trainer.data.megatron_indexed import index_path, is_indexed_dataset
from trainer.data.tables import has_parquet_magic, hf_dataset_layout

JSON_LINES_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")
TEXT_SUFFIXES = (".txt", ".md", ".py")
SOURCE_SUFFIXES = (".txt", *JSON_LINES_SUFFIXES, ".md", ".py", ".parquet")
KINDS = (f"{'/'.join(SOURCE_SUFFIXES)} files, Hugging Face dataset folders (save_to_disk) or Megatron "
         ".bin/.idx pairs")
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
    """`data.source`'s files; None or "stdlib": the default corpus. A Hugging Face dataset folder is one
    source (the folder); a Megatron pair is its .bin."""
    if source is None or source == "stdlib":
        return SourceFiles(default_corpus_files(), [], {})
    root = Path(source).expanduser()
    if not root.exists():
        prefix = root.with_name(root.name + ".bin")
        if prefix.is_file():  # Megatron names a dataset by the prefix its two files share
            return list_source(str(prefix))
        broken = root.is_symlink()  # exists() follows links: a dangling or looping link reads as absent
        raise ConfigError(f"data.source={source} {'is a link that leads nowhere' if broken else 'does not exist'}")
    if root.is_file():
        return SourceFiles([_check_named_file(root, source)], [], {})
    if not root.is_dir():
        raise ConfigError(f"data.source={source} is neither a file nor a folder (a pipe, socket or device)")
    if _check_dataset_folder(root, source):
        return SourceFiles([root], [], {})
    visible = _visible_sources_under(root, source)
    files = [path for path in visible if is_source(path)]
    if not files:
        raise ConfigError(f"data.source={source} contains no {KINDS}")
    _check_pairs(visible, files, source)
    by_name = partial(_relative_name, root)
    left_out = sorted((path for path in visible if not is_source(path) and not _is_pair_index(path)), key=by_name)
    once, links = _once_each(sorted(files, key=by_name))
    return SourceFiles(once, left_out, links)


def check_disjoint(sources: list[str | None]) -> None:
    """One line when two sources of a blend hold the same file under different names (a Megatron prefix
    and its .bin, a folder and a file in it): its documents would be trained on at the sum of both weights,
    and one source's held-out tail could be trained on through the other."""
    holder: dict[tuple[int, int] | Path, int] = {}
    for i, source in enumerate(sources):
        for path in list_source(source).files:
            real = file_identity(path)  # a hard link is the same file under another path
            if real in holder:
                j = holder[real]
                raise ConfigError(f"data.source[{j}]={sources[j]} and data.source[{i}]={source} both hold {path}; "
                                  "list each file under one source and give that source more weight in data.weights")
            holder[real] = i


def source_kind(path: Path) -> str | None:
    """"text", "jsonl", "parquet", "hf_dataset", "megatron" or None (not a source this trainer reads)."""
    if path.is_dir():
        return "hf_dataset" if hf_dataset_layout(path) == "dataset" else None
    name = path.name.lower()
    if is_indexed_dataset(path):
        return "megatron"
    if name.endswith(JSON_LINES_SUFFIXES):
        return "jsonl"
    if name.endswith(TEXT_SUFFIXES):
        return "text"
    if name.endswith(".parquet") or has_parquet_magic(path):
        return "parquet"
    return None


def is_source(path: Path) -> bool:
    """Whether a path found under a folder is read: by its suffix (or layout), not by sniffing every file."""
    return path.is_dir() or is_indexed_dataset(path) or path.name.lower().endswith(SOURCE_SUFFIXES)


def _is_pair_index(path: Path) -> bool:
    return path.suffix.lower() == ".idx" and is_indexed_dataset(path.with_suffix(".bin"))


def _check_named_file(path: Path, source: str) -> Path:
    """A file named on its own is checked on every rank before anything else; a folder's files are
    filtered by suffix here and checked as the main rank reads them (records.py). Returns the path read
    (a Megatron pair is read through its .bin)."""
    suffix = path.suffix.lower()
    if suffix == ".idx" and path.with_suffix(".bin").is_file():
        return path.with_suffix(".bin")
    if suffix in (".bin", ".idx") and not source_kind(path):
        other = index_path(path) if suffix == ".bin" else path.with_suffix(".bin")
        raise ConfigError(f"data.source={source} has no {other.name} beside it: a Megatron indexed dataset is "
                          f"the pair PREFIX.bin and PREFIX.idx")
    kind = source_kind(path)
    if kind is None:
        raise ConfigError(f"data.source={source} is not one of the sources this trainer reads ({KINDS})")
    if kind in ("text", "jsonl"):
        reason = not_text_reason(path)
        if reason is not None:
            raise ConfigError(f"data.source={source} {reason}")
    return path


def _check_dataset_folder(root: Path, source: str) -> bool:
    """Whether `root` is a Hugging Face dataset folder (one source); a DatasetDict's folder is refused."""
    layout = hf_dataset_layout(root)
    if layout == "dataset_dict":
        _refuse_dataset_dict(root, f"data.source={source} is")
    return layout == "dataset"


def _refuse_dataset_dict(folder: Path, what: str) -> None:
    """A DatasetDict holds its test and validation splits beside train: read whole, they would be trained on."""
    splits = sorted(p.name for p in folder.iterdir() if hf_dataset_layout(p) == "dataset")
    example = "train" if "train" in splits or not splits else splits[0]
    raise ConfigError(f"{what} a Hugging Face DatasetDict (splits: {', '.join(splits) or 'none'}), whose "
                      f"held-out splits would be trained on; name one split's folder, e.g. data.source={folder / example}")


def _check_pairs(visible: list[Path], files: list[Path], source: str) -> None:
    """In a folder of Megatron pairs, a .bin without its .idx is a missing half, not a file to leave out."""
    if not any(is_indexed_dataset(path) for path in files):
        return
    lone = next((p for p in visible if p.suffix.lower() == ".bin" and not is_indexed_dataset(p)), None)
    if lone is not None:
        raise ConfigError(f"data.source={source}: {lone} has no {index_path(lone).name} beside it: a Megatron "
                          "indexed dataset is the pair PREFIX.bin and PREFIX.idx")


def _once_each(files: list[Path]) -> tuple[list[Path], dict[Path, Path]]:
    """A file linked under several names is read once, under its first name in order: read twice it
    would be trained on twice, and a copy sorted last would land in the held-out tail. Returns the
    names read and, for each name dropped, the name its file is read under."""
    first_name, once, links = {}, [], {}
    for path in files:
        identity = file_identity(path)
        if identity in first_name:
            links[path] = first_name[identity]
        else:
            first_name[identity] = path
            once.append(path)
    return once, links


def file_identity(path: Path) -> tuple[int, int] | Path:
    """What tells files apart whatever their names (hard links, symlinks): the device and inode, or the
    resolved path where the filesystem gives no inode numbers (0)."""
    stat = path.stat()
    return (stat.st_dev, stat.st_ino) if stat.st_ino else path.resolve()


def reads_keyed_records(files: list[Path]) -> bool:
    """Whether any of `files` reads its documents by data.text_key (JSON lines and tables do; plain text
    and Megatron datasets do not, so the key cannot change what they pack)."""
    return any(source_kind(path) in ("jsonl", "parquet", "hf_dataset") for path in files)


def is_json_lines(path: Path) -> bool:
    """Whether `path` holds one JSON record a line (compressed or not), rather than one document."""
    return path.name.lower().endswith(JSON_LINES_SUFFIXES)


def _relative_name(root: Path, path: Path) -> str:
    return str(path.relative_to(root))


def _visible_sources_under(root: Path, source: str) -> list[Path]:
    """Every file under `root` outside hidden folders (.git, .venv, .cache hold tooling, not training
    text), and every Hugging Face dataset folder (one source, not descended into), following symlinked
    folders as a corpus assembled from links needs; each real folder is read once, so a link loop ends,
    under the first of its names in sorted order (the walk visits subfolders sorted, so the names, and
    the document order, do not depend on the filesystem). A DatasetDict's folder under `root` is refused."""
    seen, found = set(), []
    for folder, subfolders, names in os.walk(root, followlinks=True):
        real = os.path.realpath(folder)
        if real in seen:
            subfolders[:] = []
            continue
        seen.add(real)
        subfolders[:] = sorted(name for name in subfolders if not name.startswith("."))
        layouts = {name: hf_dataset_layout(Path(folder) / name) for name in subfolders}
        for name in subfolders:
            if layouts[name] == "dataset_dict":
                _refuse_dataset_dict(Path(folder) / name, f"data.source={source} holds {Path(folder) / name},")
        datasets = [name for name in subfolders if layouts[name] == "dataset"]
        found.extend(Path(folder) / name for name in datasets)
        subfolders[:] = [name for name in subfolders if name not in datasets]
        found.extend(p for name in names if not name.startswith(".") and (p := Path(folder) / name).is_file())
    return found


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


def stored_files(path: Path) -> list[Path]:
    """The files one source is stored in: a dataset folder's files, a Megatron pair, or the file itself."""
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.is_file())
    return [path, index_path(path)] if is_indexed_dataset(path) else [path]


def stored_size(path: Path) -> int:
    return sum(p.stat().st_size for p in stored_files(path))


def sources_fingerprint(sources: list[Path]) -> str:
    """Cheap fingerprint of the corpus: absolute path, size, mtime and content of every file stored, whole
    up to 64 KiB, else 16 pages of 4 KiB spread evenly from its first to its last byte. The content catches
    a file replaced by another of the same size with its mtime kept (`cp -p`, `rsync -t`, an archive of
    another version), which size and mtime alone miss; in a larger file, a same-size edit between the
    pages with the mtime kept is not seen (remove its tokens-* and tokenizer-* folders to re-pack)."""
    digest = hashlib.sha256()
    for path in (file for source in sources for file in stored_files(source)):
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
