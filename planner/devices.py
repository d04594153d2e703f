"""Device profiles (conf/device/<name>.yaml): memory, dense bf16 / fp8 throughput and how much of it a
GEMM of a given size reaches, HBM bandwidth (and what elementwise ops reach, where it differs), the
per-GPU bandwidth and latency of the links inside a node
and between nodes, whether communication overlaps compute, and GPUs per node. GPUs come from their
published numbers; `cpu` is measured on the spot (planner/cpu_profile.py), one device per core. More CPU
ranks than cores share them (step_time.py).
"""

from dataclasses import dataclass, replace
from pathlib import Path

import yaml

from parallel.errors import ConfigError
from planner.cpu_profile import measure_cpu

DEVICE_DIR = Path(__file__).resolve().parents[1] / "conf" / "device"
GB = 1e9
# The default budget keeps back what no memory category counts (budget_bytes). Of a GPU: the CUDA context
# and the kernels' workspaces (cuBLAS, attention: about 0.5-1 GiB) and NCCL's buffers (each communicator
# holds its own, and a layout opens several: TP, CP, FSDP, HSDP, the pipeline's p2p: 1-2 GiB), 3 GiB in
# all; of a CPU rank, the interpreter, torch and the trainer's modules (about 0.5 GiB resident). Of either,
# a share for what the allocator cannot hand out: a GPU shows a little less than its nominal size (an
# "80 GB" H100 79.2 GiB) and the caching allocator's segments are split by blocks of other sizes.
RESERVE_GIB = {"gpu": 3.0, "cpu": 0.5}
FRAGMENTATION = 0.05


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    memory_gib: float
    bf16_tflops: float
    fp32_tflops: float
    fp8_tflops: float
    hbm_gbps: float
    intra_node_gbps: float
    inter_node_gbps: float
    gpus_per_node: int
    intra_node_latency_us: float  # one collective or transfer of a small message
    inter_node_latency_us: float
    gemm_efficiency: float  # the fraction of the peak a large GEMM reaches
    gemm_half_size: int  # the GEMM rows or width at which half of that is lost
    overlaps_communication: bool  # False: a collective's time adds to the compute's (gloo on shared cores)
    shared_core_latency_us: float | None = None  # a CPU's collective latency with two ranks per core
    # What an elementwise op (a norm, an add) reaches on activation-sized tensors; None: hbm_gbps (a
    # GPU's activations do not fit its caches; a CPU's may, and it pays a dispatch per op).
    elementwise_gbps: float | None = None

    def latencies_for(self, ranks: int) -> "DeviceProfile":
        """The profile as `ranks` ranks see it: where they outnumber a CPU's cores, a rank that waits
        gives its core up and is woken at the scheduler's pace, so every collective takes the shared
        latency."""
        if not oversubscribed_cores(self, ranks):
            return self
        return replace(self, intra_node_latency_us=self.shared_core_latency_us,
                       inter_node_latency_us=self.shared_core_latency_us)

    def without_latency(self) -> "DeviceProfile":
        return replace(self, intra_node_latency_us=0.0, inter_node_latency_us=0.0, shared_core_latency_us=0.0)

    @property
    def elementwise_bytes_per_s(self) -> float:
        return (self.elementwise_gbps or self.hbm_gbps) * GB

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * 2**30)

    @property
    def budget_bytes(self) -> int:
        """The default memory budget: the memory less the reserve (RESERVE_GIB, FRAGMENTATION)."""
        reserve = RESERVE_GIB["cpu" if self.name == "cpu" else "gpu"]
        return int((self.memory_gib * (1 - FRAGMENTATION) - reserve) * 2**30)

    def flops(self, dtype_bytes: int, fp8: bool = False) -> float:
        """Dense peak FLOP/s of a GEMM in this precision."""
        tflops = self.fp8_tflops if fp8 else self.fp32_tflops if dtype_bytes == 4 else self.bf16_tflops
        return tflops * 1e12

    def efficiency(self, rows: int, width: int) -> float:
        """The fraction of the peak a GEMM reaches whose smaller side is min(rows, width)."""
        size = min(rows, width)
        return self.gemm_efficiency * size / (size + self.gemm_half_size)


def oversubscribed_cores(device: DeviceProfile, ranks: int) -> int:
    """The cores `ranks` CPU processes share when they outnumber them (gpus_per_node), else 0: a GPU is
    never shared."""
    return device.gpus_per_node if device.name == "cpu" and ranks > device.gpus_per_node else 0


def known_devices() -> list[str]:
    return sorted(p.stem for p in DEVICE_DIR.glob("*.yaml"))


def load_device(name: str) -> DeviceProfile:
    path = DEVICE_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(f"device profile {name!r} is unknown: one of {', '.join(known_devices())} "
                          f"(conf/device/<name>.yaml)")
    values = yaml.safe_load(path.read_text())
    if values.pop("measured", False):
        values.update(measure_cpu())
    return DeviceProfile(**values)
