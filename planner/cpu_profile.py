"""This CPU as a device profile, measured on the spot, per core: a rank runs one thread
(OMP_NUM_THREADS=1 under torchrun).

- GEMM: one thread's fp32 matmul throughput at several row counts, fitted to the profile's curve
  peak x rows / (rows + half_size), so small microbatches and TP-local widths cost what they cost here.
- Links: gloo all-reduces between processes, as the training ranks run: a small one among one rank
  per core (the latency), the same among two ranks per core (a rank that waits gives its core up
  and is woken at the scheduler's pace: several times slower), a large one between two ranks (the
  bandwidth).
- Memory: a large copy (the optimizer's bandwidth), what a block's elementwise ops reach per byte the
  step-time model counts for them (the model's RMSNorm and rotary, forward and backward under
  autograd at one sequence's size: dispatch, broadcasts and reductions included) and the RAM over
  the cores.
"""

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from model.attention import apply_rotary
from model.transformer import RMSNorm
from parallel import comm

GB = 1e9
REPO = Path(__file__).resolve().parents[1]
GEMM_ROWS = (16, 32, 64, 128, 256, 512)
GEMM_DIM = 512
SMALL_NUMEL, LARGE_NUMEL = 16, 2**20


def measure_cpu() -> dict:
    cores = max(1, len(os.sched_getaffinity(0)))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        peak, half_size = gemm_curve({rows: _matmul_flops(rows) for rows in GEMM_ROWS})
        elementwise_gbps = _elementwise_gbps()
        alone_s, shared_s, link_gbps = _gloo_links(cores)
    finally:
        torch.set_num_threads(threads)
    ram_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    tflops = peak / 1e12
    return {"memory_gib": ram_gib / cores, "bf16_tflops": tflops, "fp32_tflops": tflops, "fp8_tflops": tflops,
            "hbm_gbps": _copy_gbps(), "intra_node_gbps": link_gbps, "inter_node_gbps": link_gbps,
            "gpus_per_node": cores, "intra_node_latency_us": alone_s * 1e6, "inter_node_latency_us": alone_s * 1e6,
            "shared_core_latency_us": shared_s * 1e6, "gemm_efficiency": 1.0, "gemm_half_size": half_size,
            "elementwise_gbps": elementwise_gbps}


def gemm_curve(flops_per_s: dict[int, float]) -> tuple[float, int]:
    """(peak FLOP/s, half size) of throughput = peak x rows / (rows + half): a least-squares line through
    1 / throughput = 1 / peak + (half / peak) / rows."""
    xs = [1 / rows for rows in flops_per_s]
    ys = [1 / f for f in flops_per_s.values()]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    intercept = my - slope * mx
    if intercept <= 0:  # throughput still climbing at the largest size: its value is the peak
        return max(flops_per_s.values()), 0
    return 1 / intercept, max(0, round(slope / intercept))


def _matmul_flops(rows: int) -> float:
    a, b = torch.randn(rows, GEMM_DIM), torch.randn(GEMM_DIM, GEMM_DIM)
    a @ b
    reps = max(3, 1024 // rows)
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * rows * GEMM_DIM**2 * reps / (time.perf_counter() - start)


def _copy_gbps() -> float:
    x = torch.empty(2**24)
    y = torch.empty_like(x)
    start = time.perf_counter()
    for _ in range(4):
        y.copy_(x)
    return 2 * x.numel() * 4 * 4 / (time.perf_counter() - start) / GB


def _elementwise_gbps() -> float:
    """Bytes per second of the model's RMSNorm and rotary over 128 tokens at dim 512 (8 heads of 64),
    forward and backward, counted as step_time counts them (7 and 10 elements per element
    forward, the backward twice that)."""
    rows, dim, heads = 128, 512, 8
    norm = RMSNorm(dim, 1e-5)
    x = torch.randn(1, rows, dim, requires_grad=True)
    cos, sin = torch.randn(rows, dim // heads), torch.randn(rows, dim // heads)

    def forward_backward() -> None:
        q = norm(x).view(1, rows, heads, dim // heads).transpose(1, 2)
        apply_rotary(q, cos, sin).sum().backward()

    forward_backward()
    reps = 50
    start = time.perf_counter()
    for _ in range(reps):
        forward_backward()
    return 3 * (7 + 10) * rows * dim * 4 * reps / (time.perf_counter() - start) / GB


def _gloo_links(cores: int) -> tuple[float, float, float]:
    """(seconds per small all-reduce with one rank per core, the same with two ranks per core, GB/s one
    way) of gloo between processes on this host, as the training ranks run: on at most two cores (the
    ranks pinned there), so a large machine starts four processes, not hundreds. The ranks are fresh
    interpreters running this module (multiprocessing's would re-import the caller's main)."""
    pinned = sorted(os.sched_getaffinity(0))[:min(cores, 2)]
    cores, ranks = len(pinned), 2 * len(pinned)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    with tempfile.TemporaryDirectory() as folder:
        processes = [subprocess.Popen([sys.executable, "-m", __name__, str(r), str(ranks), ",".join(map(str, pinned)),
                                       f"{folder}/store"],
                                      cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                     for r in range(ranks)]
        outputs = [p.communicate(timeout=120) for p in processes]
    if any(p.returncode for p in processes):
        failed = next(err for p, (_, err) in zip(processes, outputs) if p.returncode)
        raise RuntimeError(f"measuring gloo between local processes failed: {failed.strip().splitlines()[-1:]}")
    alone, shared, large = json.loads(outputs[0][0])
    # A two-rank all-reduce sends and receives half the tensor each way, twice (reduce, then gather).
    return alone, shared, LARGE_NUMEL * 4 / max(large - alone, 1e-9) / GB


def _link_rank(rank: int, world: int, pinned: list[int], store_file: str) -> None:
    """One rank of the measurement, on the `pinned` cores: all-reduces within the first one rank per
    core while the rest wait on the store (asleep, off the cores), then among every rank; rank 0 prints
    the seconds."""
    os.sched_setaffinity(0, pinned)
    cores = len(pinned)
    torch.set_num_threads(1)
    store = dist.FileStore(store_file, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        first, pair = dist.new_group(list(range(cores))), dist.new_group([0, 1])
        seconds = {}
        if rank < cores:
            seconds["alone"] = _all_reduce_s(torch.ones(SMALL_NUMEL), first, 50)
        if rank < 2:
            seconds["large"] = _all_reduce_s(torch.ones(LARGE_NUMEL), pair, 8)
        if rank == 0:
            store.set("measured_alone", "1")
        store.wait(["measured_alone"])
        seconds["shared"] = _all_reduce_s(torch.ones(SMALL_NUMEL), dist.group.WORLD, 30)
        if rank == 0:
            print(json.dumps([seconds["alone"], seconds["shared"], seconds["large"]]))
    finally:
        dist.destroy_process_group()


def _all_reduce_s(x: torch.Tensor, group, reps: int) -> float:
    for _ in range(5):  # the first calls set their buffers up
        comm.all_reduce(x, group)
    start = time.perf_counter()
    for _ in range(reps):
        comm.all_reduce(x, group)
    return (time.perf_counter() - start) / reps


if __name__ == "__main__":
    _link_rank(int(sys.argv[1]), int(sys.argv[2]), [int(c) for c in sys.argv[3].split(",")], sys.argv[4])
