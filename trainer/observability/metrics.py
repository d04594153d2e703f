"""Per-step metrics: one JSON object per logged step in {dump_dir}/metrics.jsonl, and a human line.

Exactly one rank writes. `loss` is written with repr-precision, so bitwise comparisons can read it.
The file is only appended to or repaired, never silently cut: a resumed job moves the records of the
steps it redoes (and a partial last line a crash left) to metrics.superseded.jsonl, and a new job
refuses a dump_dir whose metrics no checkpoint continues.
"""

import json
import math
import os
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from parallel.errors import ConfigError
from trainer.outputs import JOB_FILE, METRICS_FILE, REWRITE_FILE, SUPERSEDED_FILE

GIB = 1024**3


def start_memory_peak(device: torch.device) -> None:
    """At a step's start: the CUDA peak counts from here (a process's peak RSS cannot be reset)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gib(device: torch.device) -> float:
    """Peak allocated device memory since start_memory_peak on CUDA; peak resident set size of this
    process so far on CPU."""
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
    tflops_compute: float  # model FLOPs over the step time not spent blocked on communication
    comm_wait_s: float  # time blocked on communication, host or (CUDA) compute stream (comm.LEDGER.wait_s)
    mfu: float | None
    mfu_compute: float | None  # the MFU of tflops_compute (CUDA only, like mfu)
    mem_peak_gib: float
    comm: dict[str, dict[str, int]]
    eval_loss: float | None = None  # held-out loss after this step, on evaluation steps only
    # metrics.unit_norms: {unit: L2 norm} of each FSDP unit's gradient (before clipping) and of its
    # parameters (before the update), whole model, every pipeline stage's units
    unit_grad_norms: dict[str, float] | None = None
    unit_param_norms: dict[str, float] | None = None
    skipped_steps: int = 0  # optimizer steps skipped so far for a NaN/Inf loss or gradient (nan_policy=skip)
    profiled: bool | None = None  # True on a step run under the profiler: its times include the profiler's cost
    wall_time: float = field(default_factory=time.time)  # when the step ended (seconds since the epoch)

    def record(self) -> dict:
        """The JSON record: a NaN or Inf number becomes null (JSON has none) and `nonfinite` names which
        (so that a NaN and an Inf do not compare equal), nested ones by field and key
        ("unit_grad_norms.layers.0"); optional fields only when set."""
        logged = {k: v for k, v in self.__dict__.items() if k not in _OPTIONAL or v is not None}
        kinds = _nonfinite_kinds(logged)
        return {k: _json_value(v) for k, v in logged.items()} | ({"nonfinite": kinds} if kinds else {})


_OPTIONAL = ("eval_loss", "unit_grad_norms", "unit_param_norms", "profiled")


def _nonfinite_kinds(values: dict, prefix: str = "") -> dict[str, str]:
    """{dotted key: "nan" | "inf" | "-inf"} of the non-finite floats in `values` and its nested dicts."""
    kinds: dict[str, str] = {}
    for k, v in values.items():
        if isinstance(v, dict):
            kinds |= _nonfinite_kinds(v, f"{prefix}{k}.")
        elif isinstance(v, float) and not math.isfinite(v):
            kinds[f"{prefix}{k}"] = repr(v)
    return kinds


def _json_value(v: object) -> object:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _json_value(x) for k, x in v.items()}
    return v


def _is_record(line: str) -> bool:
    """A JSON object with an integer "step", as every line this log writes."""
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):
        return False
    return isinstance(record, dict) and type(record.get("step")) is int


def read_history(path: Path) -> tuple[list[str], str | None]:
    """The records of a metrics file, and its partial last line (a crash mid-write) if any. A damaged
    line anywhere else is one error line: the file is the user's, it is not ours to guess."""
    if not path.exists():
        return [], None
    text = path.read_text()
    lines = text.splitlines()
    partial = lines.pop() if lines and (not text.endswith("\n") or not _is_record(lines[-1])) else None
    for number, line in enumerate(lines, 1):
        if not _is_record(line):
            raise ConfigError(f"{path} line {number} is not a step record (a JSON object with an integer \"step\"); "
                              "repair the file or move it away")
    return lines, partial


def check_history(dump_dir: Path, start_step: int, job: str) -> None:
    """Every rank, before anything is written: a job without a checkpoint to continue must not take
    over an earlier run's metrics. Its own are another matter: a worker group that torchrun restarted
    (or a requeued job with the same rendezvous id) before the first checkpoint starts over, and the
    earlier attempt's records move to the superseded file."""
    records, _ = read_history(dump_dir / METRICS_FILE)
    if start_step == 0 and records and history_owner(dump_dir) != job:
        steps = [json.loads(line)["step"] for line in records]
        raise ConfigError(
            f"dump_dir={dump_dir} already holds {METRICS_FILE} of a run (steps {min(steps)}-{max(steps)}) but no "
            f"checkpoint to resume from; use a new dump_dir, or move {METRICS_FILE} away to start over"
        )


def history_owner(dump_dir: Path) -> str | None:
    """The job (torchrun's rendezvous run id) that wrote the dump_dir's metrics, if recorded."""
    try:
        return json.loads((dump_dir / JOB_FILE).read_text())["run_id"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def record_history_owner(dump_dir: Path, job: str) -> None:
    (dump_dir / JOB_FILE).write_text(json.dumps({"run_id": job}) + "\n")


class MetricsLog:
    def __init__(self, dump_dir: Path, is_writer: bool, total_steps: int, start_step: int) -> None:
        self.is_writer = is_writer
        self.total_steps = total_steps
        self.path = dump_dir / METRICS_FILE
        self._logged: list[tuple[int, float, float]] = []  # (step, wall_time, step_time_s) of recent logs
        if is_writer:
            self._continue_after(start_step)

    def _continue_after(self, start_step: int) -> None:
        """A resumed job redoes the steps after its checkpoint: their old records (and a partial line)
        move to the superseded file, so metrics.jsonl keeps one record per step and loses nothing."""
        records, partial = read_history(self.path)
        kept = [line for line in records if json.loads(line)["step"] <= start_step]
        moved = [line for line in records if json.loads(line)["step"] > start_step] + ([partial] if partial else [])
        if not moved:
            return
        superseded = self.path.parent / SUPERSEDED_FILE
        # Already there when a kill came between this append and the rewrite below: not appended twice.
        if not superseded.exists() or superseded.read_text().splitlines()[-len(moved):] != moved:
            with superseded.open("a") as f:
                f.write("".join(line + "\n" for line in moved))
        tmp = self.path.with_name(REWRITE_FILE)
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, self.path)
        what = f"{len(moved) - bool(partial)} record(s) after step {start_step}" + (" and a partial last line" if partial else "")
        print(f"notice: {METRICS_FILE}: moved {what} to {SUPERSEDED_FILE}", file=sys.stderr, flush=True)

    def log(self, m: StepMetrics) -> None:
        self._logged = [*self._logged[-10:], (m.step, m.wall_time, m.step_time_s)]
        if not self.is_writer:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(m.record(), allow_nan=False) + "\n")
        print(self.human_line(m), file=sys.stdout, flush=True)

    def seconds_per_step(self) -> float:
        """Wall time per step between recent logged steps: checkpoint saves and evaluations included,
        so the ETA stays right across them (a lone first record falls back to its step time)."""
        (first_step, first_time, first_step_s), (last_step, last_time, _) = self._logged[0], self._logged[-1]
        if last_step == first_step:
            return first_step_s
        return (last_time - first_time) / (last_step - first_step)

    def human_line(self, m: StepMetrics) -> str:
        eta_s = int(self.seconds_per_step() * (self.total_steps - m.step))
        mfu = "n/a" if m.mfu is None else f"{100 * m.mfu:.1f}% ({100 * m.mfu_compute:.1f}% computing)"
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(m.wall_time))
        return (
            f"{stamp} step {m.step}/{self.total_steps} | loss {m.loss:.4f} | lr {m.lr:.2e} | gnorm {m.grad_norm:.3f}"
            f" | {m.tokens_per_s:,.0f} tok/s | {m.tflops:.3f} TFLOP/s/dev ({m.tflops_compute:.3f} computing)"
            f" | comm wait {m.comm_wait_s * 1e3:.0f} ms | MFU {mfu}"
            f" | mem {m.mem_peak_gib:.2f} GiB" + ("" if m.eval_loss is None else f" | eval {m.eval_loss:.4f}")
            + f" | ETA {eta_s // 3600}:{eta_s % 3600 // 60:02d}:{eta_s % 60:02d}"
        )
