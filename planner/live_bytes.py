"""What a trace on the meta device holds, beyond what autograd saves: the bytes of every live storage as
ops make and drop them (the loss's scratch), and the storages a closure keeps alive (a zero-bubble W's
deferred weight-gradient GEMMs hold their operands in closures, not in autograd's saved tensors).

Meta storages have no address: a storage's identity is its object's, and its end is its finalizer's.
"""

import weakref
from collections.abc import Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    """The bytes of the storages ops made that are still alive, and their peak since `reset_peak`."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._sizes: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t.untyped_storage())
        return out

    def _track(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        if key in self._sizes:
            return
        self._sizes[key] = storage.nbytes()
        self.live += storage.nbytes()
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._release, key)

    def _release(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)

    def reset_peak(self) -> None:
        self.peak = self.live


def captured(fn: Callable) -> Iterator[object]:
    """Every object a function's closure holds, through the functions it holds in turn."""
    pending, seen = [fn], set()
    while pending:
        f = pending.pop()
        if id(f) in seen:
            continue
        seen.add(id(f))
        for cell in getattr(f, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:  # a cell not yet assigned
                continue
            if callable(value) and getattr(value, "__closure__", None):
                pending.append(value)
            yield value


def storage_bytes(tensors: list[torch.Tensor]) -> int:
    """The bytes of the distinct storages under `tensors`."""
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())
