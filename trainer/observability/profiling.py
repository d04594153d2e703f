"""torch.profiler around chosen steps: `profile_freq=N` profiles every Nth step.

With `dump_profile_traces=true` each rank writes a Chrome/Perfetto trace to
{dump_dir}/profile_traces/step_N/rank{R}.json; otherwise rank 0 prints the step's top operators.
Communication shows up as named ranges ("all_gather dp_shard_cp layers.3", "send_recv pp r1 SEND_F c0 m3
-> r2", "wait recv ..."), pipeline compute as "r1 F c0 m3" (parallel/comm.py, the pipeline runtime).
"""

import re
import sys
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import torch
from torch.autograd.profiler_util import EventList
from torch.profiler import ProfilerActivity, profile

from trainer.config.schema import TrainConfig
from trainer.outputs import TRACES_DIR

TOP_OPERATORS = 15
STACK_DEPTH = 5  # frames of the stack that tell calls apart in the printed table (profile_with_stack)
# Python frames, recorded with profile_with_stack on every thread: an idle one (the dump_dir lock's
# heartbeat waiting on its event) would top a table of operators.
_PYTHON_FRAME = re.compile(r"\.py\(\d+\): |^<built-in ")


class StepProfiler:
    def __init__(self, cfg: TrainConfig, rank: int, device: torch.device):
        self.freq, self.dump, self.with_stack = cfg.profile_freq, cfg.dump_profile_traces, cfg.profile_with_stack
        self.folder = Path(cfg.dump_dir) / TRACES_DIR
        self.rank = rank
        self.activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])

    def due(self, step: int) -> bool:
        """Whether optimizer step `step` runs under the profiler."""
        return bool(self.freq) and step % self.freq == 0

    def step(self, step: int) -> AbstractContextManager:
        """Wrap optimizer step `step`: a profiler when it is due, else nothing."""
        return _ProfiledStep(self, step) if self.due(step) else nullcontext()


class _ProfiledStep:
    def __init__(self, owner: StepProfiler, step: int):
        self.owner, self.step = owner, step
        self.prof = profile(activities=owner.activities, with_stack=owner.with_stack, record_shapes=owner.with_stack)

    def __enter__(self) -> None:
        self.prof.__enter__()

    def __exit__(self, *exc) -> None:
        self.prof.__exit__(*exc)
        if exc[0] is not None:
            return
        owner = self.owner
        if owner.dump:
            folder = owner.folder / f"step_{self.step}"
            folder.mkdir(parents=True, exist_ok=True)
            self.prof.export_chrome_trace(str(folder / f"rank{owner.rank}.json"))
        elif owner.rank == 0:
            # With stacks and shapes recorded, the table keeps apart the calls they tell apart.
            grouped = self.prof.key_averages(group_by_input_shape=owner.with_stack,
                                             group_by_stack_n=STACK_DEPTH if owner.with_stack else 0)
            operators = EventList([a for a in grouped if not _PYTHON_FRAME.search(a.key)])
            table = operators.table(sort_by="self_cpu_time_total", row_limit=TOP_OPERATORS)
            print(f"profile of step {self.step} (rank 0):\n{table}", file=sys.stderr, flush=True)
