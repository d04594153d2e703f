"""Per-step metrics: one JSON object per logged step in {dump_dir}/metrics.jsonl, and a human line.

Exactly one rank writes. `loss` is written with repr-precision, so bitwise comparisons can read it.
"""

import json
import resource
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

GIB = 1024**3


def peak_memory_gib(device: torch.device) -> float:
    """Peak allocated device memory on CUDA; peak resident set size of this process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / GIB
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib * 1024 / GIB


@dataclass
class StepMetrics:
    step: int
    loss: float
    grad_norm: float
    lr: float
    tokens_per_s: float
    step_time_s: float
    tflops: float
    mfu: float | None
    mem_peak_gib: float
    comm: dict[str, dict[str, int]]

    def record(self) -> dict:
        return dict(self.__dict__)


class MetricsLog:
    def __init__(self, dump_dir: Path, is_writer: bool, total_steps: int, start_step: int) -> None:
        self.is_writer = is_writer
        self.total_steps = total_steps
        self.path = dump_dir / "metrics.jsonl"
        self._step_times: list[float] = []
        if is_writer:
            self._keep_until(start_step)

    def _keep_until(self, start_step: int) -> None:
        """A resumed job redoes the steps after its checkpoint: drop their old records, so the file
        keeps one record per step (a fresh start, start_step 0, empties it)."""
        if not self.path.exists():
            return
        kept = [line for line in self.path.read_text().splitlines() if json.loads(line)["step"] <= start_step]
        self.path.write_text("".join(line + "\n" for line in kept))

    def log(self, m: StepMetrics) -> None:
        self._step_times.append(m.step_time_s)
        if not self.is_writer:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(m.record(), allow_nan=False) + "\n")
        print(self.human_line(m), file=sys.stdout, flush=True)

    def human_line(self, m: StepMetrics) -> str:
        recent = self._step_times[-10:]
        eta_s = int(sum(recent) / len(recent) * (self.total_steps - m.step))
        mfu = "n/a" if m.mfu is None else f"{100 * m.mfu:.1f}%"
        return (
            f"step {m.step}/{self.total_steps} | loss {m.loss:.4f} | lr {m.lr:.2e} | gnorm {m.grad_norm:.3f}"
            f" | {m.tokens_per_s:,.0f} tok/s | {m.tflops:.3f} TFLOP/s/dev | MFU {mfu}"
            f" | mem {m.mem_peak_gib:.2f} GiB | ETA {eta_s // 3600}:{eta_s % 3600 // 60:02d}:{eta_s % 60:02d}"
        )
