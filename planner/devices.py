"""Device profiles (conf/device/<name>.yaml): memory, dense bf16 / fp8 throughput, HBM bandwidth, the
per-GPU bandwidth of the links inside a node and between nodes, and GPUs per node. GPUs come from their
published numbers; `cpu` is measured on the spot (an fp32 matmul on one thread, a large copy, the RAM), one
device per core, with the copy bandwidth standing in for gloo's links. More CPU ranks than cores share them (step_time.py).
"""

import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from parallel.errors import ConfigError

DEVICE_DIR = Path(__file__).resolve().parents[1] / "conf" / "device"
GB = 1e9


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

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * 2**30)

    def flops(self, dtype_bytes: int, fp8: bool = False) -> float:
        """Dense peak FLOP/s of a GEMM in this precision."""
        tflops = self.fp8_tflops if fp8 else self.fp32_tflops if dtype_bytes == 4 else self.bf16_tflops
        return tflops * 1e12


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


def measure_cpu() -> dict:
    """This CPU's numbers, per core: a rank runs one thread (OMP_NUM_THREADS=1 under torchrun)."""
    cores = max(1, len(os.sched_getaffinity(0)))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        n = 512
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b
        start, reps = time.perf_counter(), 8
        for _ in range(reps):
            a @ b
        tflops = 2 * n**3 * reps / (time.perf_counter() - start) / 1e12
    finally:
        torch.set_num_threads(threads)
    x = torch.empty(2**24)
    y = torch.empty_like(x)
    start = time.perf_counter()
    for _ in range(4):
        y.copy_(x)
    copy_gbps = 2 * x.numel() * 4 * 4 / (time.perf_counter() - start) / GB
    ram_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {"memory_gib": ram_gib / cores, "bf16_tflops": tflops, "fp32_tflops": tflops, "fp8_tflops": tflops, "hbm_gbps": copy_gbps,
            "intra_node_gbps": copy_gbps / 4, "inter_node_gbps": copy_gbps / 4, "gpus_per_node": cores}
