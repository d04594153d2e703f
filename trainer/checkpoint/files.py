"""Checkpoints with torch.distributed.checkpoint: atomic, verified, resumable bitwise.

Layout: {dump_dir}/checkpoints/step_N/ holds DCP's shard files, its .metadata, extra files (config,
tokenizer) and, written last, manifest.json with every file's size and sha256. A save goes to a
hidden temp folder that is renamed to step_N only once complete, so a crash mid-save never leaves a
checkpoint that looks complete and never touches an existing one. Loading verifies the manifest
(sizes on every rank, checksums split across ranks) and unpickles DCP's metadata with an allow-list,
so a corrupt or hostile checkpoint is an error line, not arbitrary code.
"""

import hashlib
import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

from torch.distributed import ProcessGroup

from parallel import comm
from parallel.errors import ConfigError

MANIFEST = "manifest.json"
# Files every checkpoint carries besides the state (tokenizer, config, fingerprint): a path is copied
# at each save, bytes are what was read once at start (the tokenizer in use, whatever its file becomes).
ExtraFiles = Mapping[str, Path | bytes]
_STEP_PREFIX = "step_"
_DELETED_PREFIX = ".old_"  # a checkpoint folder being deleted


class CheckpointError(ConfigError):
    """A checkpoint that is corrupt, truncated or does not match the run."""


def last_line(e: BaseException) -> str:
    """The line of an error that says what failed (DCP's gather of per-rank failures spans many)."""
    lines = str(e).strip().splitlines()
    return lines[-1] if lines else repr(e)


def write_failure(folder: Path, e: BaseException) -> str:
    """One line saying why writing into checkpoint folder `folder` failed. torch.save's zip writer
    reports a short write (a full disk, a quota) as a RuntimeError without its errno ("[enforce fail
    at inline_container.cc...] unexpected pos"): that one is named for what it almost always is."""
    cause = last_line(e)
    if "inline_container" in cause:
        try:
            free = f"{shutil.disk_usage(folder).free} bytes free there"
        except OSError:
            free = "free space unknown"
        cause = f"No space left on device, or a quota reached ({free}): torch.save's write came up short ({cause})"
    return f"checkpoint save into {folder} failed: {cause}"


def _dcp_io():
    """torch.distributed.checkpoint costs ~0.7 s of imports per process: only when a checkpoint is used."""
    from trainer.checkpoint import dcp_io

    return dcp_io


def checkpoint_step(path: Path) -> int:
    """The step a step_N folder was written after."""
    return int(path.name[len(_STEP_PREFIX):])


def latest_checkpoint(root: Path, before: int | None = None) -> Path | None:
    """The newest step_N folder with a manifest (complete), of a step below `before` if given; None if
    there is none."""
    steps = [(step, path) for step, path in _step_folders(root)
             if (path / MANIFEST).is_file() and (before is None or step < before)]
    return steps[-1][1] if steps else None


def enclosing_checkpoint(path: Path) -> Path | None:
    """The checkpoint (a folder holding a manifest) that `path` is or lies in; None if none. Writing
    there would change files the manifest vouches for, or add ones it does not list."""
    resolved = path.resolve()
    return next((folder for folder in (resolved, *resolved.parents) if (folder / MANIFEST).is_file()), None)


def _step_folders(root: Path) -> list[tuple[int, Path]]:
    """(N, path) of every step_N folder, complete or not, oldest first."""
    numbered = ((p.name[len(_STEP_PREFIX):], p) for p in root.glob(f"{_STEP_PREFIX}*"))
    # ASCII digits only: str.isdigit() also takes "²", which int() refuses.
    return sorted((int(n), p) for n, p in numbered if n.isascii() and n.isdigit())


def refuse_damaged_newer(root: Path, after: int) -> None:
    """A step_N folder newer than the checkpoint a run resumes from, without a manifest, is no save of
    ours (a save is renamed into place only after its manifest is written): damaged, or put there by
    hand. The run would write step N over it, so it is refused, not silently replaced."""
    for step, path in _step_folders(root):
        if step > after and not (path / MANIFEST).is_file():
            start = f"step {after}" if after else "scratch"
            raise CheckpointError(
                f"checkpoint {path} has no {MANIFEST}: it is damaged or not a checkpoint, and this run (resuming "
                f"from {start}) would overwrite it; move it out of {root} (keep it: it may be repairable)")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def save_checkpoint(
    root: Path, step: int, state: dict, group: ProcessGroup, rank: int, extra_files: ExtraFiles
) -> Path:
    tmp = prepare_save(root, step, group, rank)
    try:
        _dcp_io().save_state(state, tmp, group)
    except CheckpointError:  # DCP raises on every rank when any rank's write fails: all agree
        discard_save(tmp, group, rank)
        raise
    return complete_save(tmp, own_files(tmp, rank), group, rank, extra_files)


def prepare_save(root: Path, step: int, group: ProcessGroup, rank: int) -> Path:
    """The hidden folder a save writes into (rank 0 first removes any that crashed saves or deletions
    left)."""
    tmp = root / f".tmp_{_STEP_PREFIX}{step}"
    if rank == 0:
        for stale in [*root.glob(f".tmp_{_STEP_PREFIX}*"), *root.glob(f"{_DELETED_PREFIX}{_STEP_PREFIX}*")]:
            if stale.is_dir() and not stale.is_symlink():
                shutil.rmtree(stale, ignore_errors=True)
            else:  # a file or link in the hidden folder's place would fail the mkdir below
                stale.unlink(missing_ok=True)
        tmp.mkdir(parents=True)
    comm.barrier(group)
    return tmp


def own_files(tmp: Path, rank: int) -> dict[str, dict]:
    """Size and sha256 of the shard files this rank wrote."""
    return {p.name: _file_entry(p) for p in tmp.glob(f"__{rank}_*")}


def complete_save(tmp: Path, mine: dict[str, dict], group: ProcessGroup, rank: int,
                  extra_files: ExtraFiles) -> Path:
    """Every rank's files are written: rank 0 checks that it sees them all, writes the manifest (last)
    and renames the folder into place; every rank gets its verdict. Returns the checkpoint's final
    path. A save rank 0 cannot complete raises CheckpointError on every rank (so nothing is pruned on
    its account) and its hidden folder is removed."""
    final = tmp.with_name(tmp.name.removeprefix(".tmp_"))
    entries = comm.all_gather_object(mine, group)
    problem = _finish_or_problem(tmp, final, entries, extra_files) if rank == 0 else None
    problems = [p for p in comm.all_gather_object(problem, group) if p]
    if problems:
        discard_save(tmp, group, rank)
        raise CheckpointError(problems[0])
    return final


def discard_save(tmp: Path, group: ProcessGroup, rank: int) -> None:
    """Every rank, once all have agreed that the save into `tmp` failed: rank 0 removes the folder, which
    would otherwise hold the disk space until the next save (and, on a full disk, make it fail too). The
    barrier makes sure no rank is still writing into it."""
    comm.barrier(group)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)


def _finish_or_problem(tmp: Path, final: Path, entries: list, extra_files: ExtraFiles) -> str | None:
    """Rank 0: complete the save, or say why not (a rank that raised alone would leave the others waiting)."""
    for writer, rank_entries in enumerate(entries):
        for name, entry in rank_entries.items():
            seen = (tmp / name).stat().st_size if (tmp / name).is_file() else None
            if seen != entry["size"]:
                state = "missing" if seen is None else f"{seen} bytes, written as {entry['size']}"
                return (f"checkpoint save into {tmp}: rank {writer}'s file {name} is {state} as rank 0 sees it; "
                        f"dump_dir must be one folder that every rank shares")
    try:
        _finish(tmp, final, entries, extra_files)
    except OSError as e:
        return f"checkpoint save into {tmp} could not be completed: {e}"
    return None


def _file_entry(path: Path) -> dict:
    return {"size": path.stat().st_size, "sha256": _sha256(path)}


def _finish(tmp: Path, final: Path, entries: list, extra_files: ExtraFiles) -> None:
    files: dict[str, dict] = {}
    for rank_entries in entries:
        files.update(rank_entries)
    for name, src in extra_files.items():
        if isinstance(src, bytes):
            (tmp / name).write_bytes(src)
        else:
            shutil.copyfile(src, tmp / name)
    for path in tmp.iterdir():
        if path.name not in files:
            files[path.name] = _file_entry(path)
            _fsync(path)  # DCP syncs its shard files; these copies are ours
    manifest = tmp / MANIFEST
    manifest.write_text(json.dumps({"files": files}, indent=1, sort_keys=True))
    _fsync(manifest)
    _fsync(tmp)
    if final.exists():
        _delete(final)
    os.replace(tmp, final)
    # The rename on disk before anything is pruned: after a node crash (not just a killed process) the
    # newest checkpoint must not be missing while the older ones are gone.
    _fsync(final.parent)


def _fsync(path: Path) -> None:
    """Flush a file's data, or a folder's entries, to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def prune_checkpoints(root: Path, keep: int) -> None:
    """Delete all but the newest `keep` complete checkpoints (keep=0 keeps all)."""
    if keep <= 0:
        return
    complete = [path for _, path in _step_folders(root) if (path / MANIFEST).is_file()]
    for path in complete[:-keep]:
        _delete(path)


def _delete(path: Path) -> None:
    """Remove a checkpoint folder: renamed to a hidden name first (atomic), so that a kill while its files
    are deleted leaves no step_N folder that still looks complete (rmtree may delete the shards before
    the manifest); the next save clears what is left."""
    hidden = path.with_name(f"{_DELETED_PREFIX}{path.name}")
    shutil.rmtree(hidden, ignore_errors=True)
    os.replace(path, hidden)
    shutil.rmtree(hidden)


def file_is_intact(path: Path, name: str) -> bool:
    """Whether checkpoint file `name` has the size and sha256 its manifest lists (one small file,
    read before the whole checkpoint is verified)."""
    try:
        entry = json.loads((path / MANIFEST).read_text())["files"][name]
        return _file_problem(path, name, entry, checksum=True) is None
    except (OSError, ValueError, KeyError, TypeError):
        return False


def verify_checkpoint(path: Path, group: ProcessGroup, rank: int, world: int, checksums: bool) -> None:
    """Raise CheckpointError on every rank if any file is missing, truncated or (with checksums) altered."""
    problem = checkpoint_files_problem(path, rank, world, checksums)
    problems = [p for p in comm.all_gather_object(problem, group) if p]
    if problems:
        raise CheckpointError(problems[0])


def checkpoint_files_problem(path: Path, rank: int, world: int, checksums: bool) -> str | None:
    """What is wrong with the files of a checkpoint (None if nothing); checksums of every world-th file.
    Never raises: a rank that raised here would leave the others waiting in the exchange of verdicts."""
    try:
        return _files_problem(path, rank, world, checksums)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"checkpoint {path} has an unreadable or malformed {MANIFEST}: {e!r}"


def _files_problem(path: Path, rank: int, world: int, checksums: bool) -> str | None:
    files = json.loads((path / MANIFEST).read_text())["files"]
    for i, (name, entry) in enumerate(sorted(files.items())):
        problem = _file_problem(path, name, entry, checksum=checksums and i % world == rank)
        if problem is not None:
            return problem
    try:
        checkpoint_keys(path)  # sizes alone (verify_checksums=false) pass a flipped byte in .metadata
    except CheckpointError as e:
        return str(e)
    return None


def _file_problem(path: Path, name: str, entry: dict, checksum: bool) -> str | None:
    """What is wrong with one file of checkpoint `path` against its manifest entry, or None."""
    file = path / name
    if not file.is_file():
        return f"checkpoint {path} is missing {name}"
    size = file.stat().st_size
    if size != entry["size"]:
        how = "truncated" if size < entry["size"] else "changed since it was saved"
        return f"checkpoint {path} is {how}: {name} has {size} bytes, expected {entry['size']}"
    if checksum and _sha256(file) != entry["sha256"]:
        return f"checkpoint {path} is corrupt: {name} fails its sha256 check"
    return None


def checkpoint_keys(path: Path) -> set[str]:
    """Flattened keys stored in a checkpoint (e.g. 'trainer.step')."""
    return _dcp_io().checkpoint_keys(path)


def load_checkpoint(path: Path, state: dict, group: ProcessGroup | None) -> None:
    """Load into the tensors of `state` in place; any failure becomes one CheckpointError line."""
    _dcp_io().load_state(path, state, group)
