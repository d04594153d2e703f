"""The torch.distributed.checkpoint half of checkpoints: write and read a state dict, and DCP's metadata
through an allow-listed unpickler (a corrupt or hostile .metadata is an error line, not code).

Importing DCP pulls in DTensor and sympy (about 0.7 s per process), so trainer/checkpoint/files.py imports
this module only when a checkpoint is written or read.
"""

import math
import pickle
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed import ProcessGroup
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.staging import AsyncStager

from parallel import comm
from parallel.fsdp.state_dict import BoxedParameter
from trainer.checkpoint.files import CheckpointError, last_line, write_failure


def save_state(state: dict, folder: Path, group: ProcessGroup) -> None:
    """Write `state` into `folder`; any failure (a full disk, a rank's I/O error) is one CheckpointError
    line on every rank."""
    try:
        dcp.save(state, storage_writer=FileSystemWriter(folder), process_group=group)
    except (Exception, CheckpointException) as e:  # DCP's wrapper of per-rank failures is a BaseException
        raise CheckpointError(write_failure(folder, e))


def host_copy(state: object) -> object:
    """A copy of a (nested) state dict in host memory: checkpoint boxes and tensors copied."""
    if isinstance(state, dict):
        return {k: host_copy(v) for k, v in state.items()}
    if isinstance(state, BoxedParameter):
        return state.host_copy()
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    return state


class HostCopyStager(AsyncStager):
    """DCP's staging step for our state: copy it to host memory, synchronously, before returning. The
    step loop stalls for this copy only; DCP writes the copy from its background thread."""

    _synchronize_after_execute = False

    def stage(self, state_dict: dict) -> dict:
        return host_copy(state_dict)

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def async_save_state(state: dict, folder: Path, group: ProcessGroup) -> Future:
    """Stage `state` to host memory, then write it in DCP's background thread, its collectives on
    `group` (a group of its own: the training's collectives run meanwhile). The staged copy is on the host
    already: no copy-ahead, whose CUDA stream calls in that thread (never given a device) would open a CUDA
    context on GPU 0 from every rank of a node."""
    return dcp.async_save(state, storage_writer=FileSystemWriter(folder, per_thread_copy_ahead=0),
                          process_group=group, async_stager=HostCopyStager())


_ALLOWED_GLOBALS = {
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
}
_ALLOWED_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's metadata is a pickle; only DCP's metadata classes, dtypes and paths may be built from it."""

    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED_GLOBALS or module in _ALLOWED_MODULES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from checkpoint metadata")


class SafeFileSystemReader(FileSystemReader):
    def read_metadata(self, *args: object, **kwargs: object) -> Metadata:
        """DCP's .metadata through an unpickler that loads only DCP's own types."""
        with (Path(self.path) / ".metadata").open("rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata


def checkpoint_keys(path: Path) -> set[str]:
    """Flattened keys stored in a checkpoint (e.g. 'trainer.step')."""
    try:
        return set(SafeFileSystemReader(path).read_metadata().state_dict_metadata)
    except Exception as e:  # a damaged pickle raises almost anything (TypeError, KeyError, MemoryError, ...)
        raise CheckpointError(f"checkpoint {path} has unreadable metadata: {e!r}")


def load_state(path: Path, state: dict, group: ProcessGroup | None) -> None:
    """Load into the tensors of `state` in place; any failure becomes one CheckpointError line. A tensor
    whose saved boxes leave a gap, or that was saved in another dtype, is refused first: DCP fills only
    what its chunks cover, and would leave the rest of a parameter as it was without a word, and casts
    without one (a float64 step count 3.9 loads as 3). The refusal is every rank's: each checks its own
    tensors (pipeline stages hold different ones), and a rank that went on into DCP's collectives alone
    would wait there for the others."""
    try:
        metadata = SafeFileSystemReader(path).read_metadata()
        refusal = first_gap(metadata) or first_dtype_change(metadata, state)
    except Exception as e:  # a damaged pickle raises almost anything
        refusal = last_line(e)
    if comm.size_of(group) > 1:
        refusal = next((r for r in comm.all_gather_object(refusal, group) if r is not None), None)
    if refusal is not None:
        raise CheckpointError(f"checkpoint {path} cannot be loaded into this run: {refusal}")
    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(path), process_group=group)
    except (Exception, CheckpointException) as e:  # DCP's wrapper of per-rank failures is a BaseException
        raise CheckpointError(f"checkpoint {path} cannot be loaded into this run: {last_line(e)}")


def first_gap(metadata: Metadata) -> str | None:
    """The first tensor whose saved chunks do not add up to its size (they never overlap: each rank writes
    the boxes it owns), said in words; None when every tensor is whole."""
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            continue
        covered = sum(math.prod(chunk.sizes) for chunk in entry.chunks)
        if covered != math.prod(entry.size):
            return (f"{key} of shape {list(entry.size)} was saved as {covered} of its {math.prod(entry.size)} elements "
                    "(no rank wrote the rest)")
    return None


def first_dtype_change(metadata: Metadata, state: dict, prefix: str = "") -> str | None:
    """The first tensor of `state` saved in another dtype than this run holds it in, said in words."""
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            found = first_dtype_change(metadata, value, f"{name}.")
            if found:
                return found
            continue
        entry = metadata.state_dict_metadata.get(name)
        if isinstance(value, torch.Tensor) and isinstance(entry, TensorStorageMetadata) \
                and entry.properties.dtype != value.dtype:
            return f"{name} was saved as {entry.properties.dtype} and this run holds it as {value.dtype}"
    return None
