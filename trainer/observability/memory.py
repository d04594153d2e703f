"""mem_snapshot_stop_step=N: where memory goes, for steps 1..N, per rank.

On CUDA the allocator records its history (torch.cuda.memory._record_memory_history) until step N
ends, then each rank dumps one snapshot, {dump_dir}/memory_snapshots/rank{R}.pickle, which PyTorch's
memory viz (https://pytorch.org/memory_viz) reads. A CPU has no such allocator history: instead each
rank follows its live tensor bytes by category and writes the breakdown at the peak,
{dump_dir}/memory_snapshots/rank{R}_live_bytes.json:

    parameters       FSDP's fp32 shards, plus unsharded (gathered) parameters while they exist
    gradients        fp32 gradient shards and unsharded accumulators
    reducing_gradients  the unsharded gradients handed to reductions still in flight
    optimizer_state  Adam's moments, from the first update on (before it they do not exist)
    activations      tensors autograd saved for backward (by storage, parameters excluded)

Activations are followed with saved-tensor hooks; the total is sampled whenever autograd saves or
reads back a tensor, which brackets the forward's growth and the backward's release.
"""

import json
import sys
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import torch
from torch.autograd.graph import saved_tensors_hooks

from parallel.fsdp import FSDPRoot
from trainer.optimizer import NamedAdamW
from trainer.outputs import SNAPSHOTS_DIR

CUDA_HISTORY_ENTRIES = 100_000


def _nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


class _Saved:
    """A tensor autograd saved; it stops counting when autograd drops it."""

    __slots__ = ("tracker", "tensor", "key")

    def __init__(self, tracker: "LiveBytes", tensor: torch.Tensor, key: int):
        self.tracker, self.tensor, self.key = tracker, tensor, key

    def __del__(self) -> None:
        self.tracker.release(self.key)


class LiveBytes:
    """Live tensor bytes by category on this rank, and the breakdown at their peak."""

    def __init__(self, roots: list[FSDPRoot], optimizer: NamedAdamW):
        self.roots, self.optimizer = roots, optimizer
        self._saved: dict[int, list[int]] = {}  # storage pointer -> [references, bytes]
        self.activations = 0
        self.peak: dict[str, int] = {"total": -1}
        self.peak_step = 0
        self.step = 0
        self.hooks = saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> _Saved:
        key = t.untyped_storage().data_ptr()
        entry = self._saved.get(key)
        if entry is None and key not in self._parameter_storages():
            self._saved[key] = entry = [0, _nbytes(t)]
            self.activations += entry[1]
        if entry is not None:
            entry[0] += 1
        self.sample()
        return _Saved(self, t, key)

    def _unpack(self, saved: _Saved) -> torch.Tensor:
        self.sample()
        return saved.tensor

    def release(self, key: int) -> None:
        entry = self._saved.get(key)
        if entry is not None:
            entry[0] -= 1
            if entry[0] == 0:
                self.activations -= entry[1]
                del self._saved[key]

    def _parameter_storages(self) -> set[int]:
        return {ptr for root in self.roots for unit in root.units for ptr in unit.parameter_storages()}

    def sample(self) -> None:
        units = [unit for root in self.roots for unit in root.units]
        now = {
            "parameters": sum(unit.memory_bytes()["parameters"] for unit in units),
            "gradients": sum(unit.memory_bytes()["gradients"] for unit in units),
            "reducing_gradients": sum(root.reductions.bytes_in_flight for root in self.roots),
            "optimizer_state": sum(_nbytes(t) for state in self.optimizer.allocated_state().values()
                                   for t in state.values() if t.dim() > 0),
            "activations": self.activations,
        }
        now["total"] = sum(now.values())
        if now["total"] > self.peak["total"]:
            self.peak, self.peak_step = now, self.step


class MemorySnapshots:
    def __init__(self, stop_step: int | None, start_step: int, dump_dir: Path, rank: int, device: torch.device,
                 roots: list[FSDPRoot], optimizer: NamedAdamW):
        """Inactive without a stop step, or when a resumed job starts past it."""
        self.stop_step = stop_step if stop_step is not None and stop_step > start_step else None
        self.rank, self.device = rank, device
        self.folder = dump_dir / SNAPSHOTS_DIR
        self.live: LiveBytes | None = None
        if self.stop_step is None:
            if stop_step is not None and rank == 0:
                print(f"notice: mem_snapshot_stop_step={stop_step} is not past the resumed step {start_step}: "
                      f"nothing is recorded (raise it to record again)", file=sys.stderr, flush=True)
            return
        if device.type == "cuda":
            torch.cuda.memory._record_memory_history(max_entries=CUDA_HISTORY_ENTRIES)
            return
        self.live = LiveBytes(roots, optimizer)
        if rank == 0:
            print(f"notice: mem_snapshot_stop_step on CPU: no allocator history (CUDA only); each rank writes "
                  f"its live tensor bytes by category at their peak up to step {stop_step} to {self.folder}",
                  file=sys.stderr, flush=True)

    def recording(self, step: int) -> AbstractContextManager:
        """Context of training step `step`: the saved-tensor hooks while the CPU breakdown runs."""
        if self.live is None:
            return nullcontext()
        self.live.step = step
        return self.live.hooks

    def after_step(self, step: int) -> None:
        if step != self.stop_step:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        if self.device.type == "cuda":
            torch.cuda.memory._dump_snapshot(str(self.folder / f"rank{self.rank}.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
            return
        report = {"last_step": step, "peak_step": self.live.peak_step, "peak_bytes": self.live.peak}
        (self.folder / f"rank{self.rank}_live_bytes.json").write_text(json.dumps(report, indent=1))
        if self.rank == 0:
            mib = {k: f"{v / 2**20:.1f}" for k, v in self.live.peak.items()}
            print(f"memory at the peak (rank 0, step {self.live.peak_step}), MiB: " +
                  ", ".join(f"{k} {v}" for k, v in mib.items()), file=sys.stderr, flush=True)
        self.live = None


