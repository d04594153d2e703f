"""CUDA-only checks (skipped cleanly without a GPU; scripts/gpu_check.sh runs them on a GPU machine).
Each capability here also has a CPU test; these check the CUDA code paths themselves."""

import json
import pickle

import pytest
import torch

from model.fp8 import Fp8Gemm, Fp8Recipe
from parallel import weight_grads
from tests.e2e.launch import train_ok
from tests.unit.trainer.test_optim_flops import adamw_against_torch
from trainer.observability.flops import device_peak_flops

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_fp8_gemm_on_cuda_matches_the_cpu_path():
    """torch._scaled_mm on CUDA against the CPU path (fp32 GEMM of the fp8 operands), same scales."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 128, generator=gen)
    weight = torch.randn(96, 128, generator=gen) * 0.05
    grad = torch.randn(64, 96, generator=gen) * 1e-3
    results = {}
    for device in ("cpu", "cuda"):
        gemm = Fp8Gemm(Fp8Recipe()).to(device)
        gemm.scale.copy_(torch.tensor([3.0, 600.0, 2.0**14]))
        gemm.scale_is_set.fill_(True)
        xd, wd = x.to(device).requires_grad_(), weight.to(device).requires_grad_()
        out = gemm(xd, wd)
        out.backward(grad.to(device))
        results[device] = [t.detach().cpu() for t in (out, xd.grad, wd.grad)]
    # Hopper's fp8 tensor cores add the products in a narrower accumulator (about 14 mantissa bits) between
    # promotions to fp32: agreement to 1e-3 of the output's scale, not fp32's order-of-summation 1e-6.
    for cpu, cuda in zip(results["cpu"], results["cuda"]):
        torch.testing.assert_close(cuda, cpu, rtol=1e-3, atol=1e-3 * float(cpu.abs().max()))


def test_the_fp8_scale_update_makes_no_host_sync_after_its_first():
    """The step-end update runs once per fp8 GEMM: a host tensor copied to the GPU in it synced the stream
    per GEMM (hundreds per step in a deep model). Its first call makes the recipe's maxima on the device."""
    gemm = Fp8Gemm(Fp8Recipe()).to("cuda")
    gemm.amax_history[0].fill_(2.0)
    gemm.update_scale()
    gemm.amax_history[0].fill_(3.0)
    torch.cuda.set_sync_debug_mode("error")
    try:
        gemm.update_scale()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert bool(gemm.scale_is_set.all())


def test_memory_snapshot_on_cuda(tmp_path):
    dump = tmp_path / "run"
    train_ok(1, dump, "model=tiny", "seq_len=64", "steps=3", "mem_snapshot_stop_step=2")
    snapshot = pickle.loads((dump / "memory_snapshots" / "rank0.pickle").read_bytes())
    assert snapshot["segments"] and any(trace for trace in snapshot["device_traces"])
    record = json.loads((dump / "metrics.jsonl").read_text().splitlines()[-1])
    if device_peak_flops(torch.device("cuda")) is None:  # a GPU the peak table does not know
        assert record["mfu"] is None
    else:
        assert record["mfu_compute"] >= record["mfu"] > 0


def test_block_causal_runs_in_the_memory_efficient_kernel_and_matches_the_math_path():
    """The mask path must not fall back to SDPA's math kernel (fp32 seq x seq scores per layer): with
    only the memory-efficient kernel allowed it runs, in bf16, and agrees with the math formula."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from model.attention import block_causal_mask, causal_attention

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 256, 64, generator=gen).cuda().bfloat16().requires_grad_()
    k, v = (torch.randn(2, 2, 256, 64, generator=gen).cuda().bfloat16().requires_grad_() for _ in range(2))
    ids = torch.cumsum(torch.rand(2, 256, generator=gen) < 0.02, dim=1).cuda()
    mask = block_causal_mask(ids)
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        out = causal_attention(q, k, v, "sdpa", mask)
        out.float().square().sum().backward()
    reference = causal_attention(q.detach().float(), k.detach().float(), v.detach().float(), "math", mask)
    torch.testing.assert_close(out.float(), reference, rtol=2e-2, atol=2e-2)
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_the_wait_clock_counts_a_wait_that_blocks_only_the_stream():
    """As NCCL's waits do: the host returns at once while the stream is held (here by a sleep kernel).
    With CUDA timing events the ledger counts the stream's time; the host clock alone would not."""
    from functools import partial

    from parallel import comm

    def stream_held_for(ms: float) -> None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(1_000_000)
        end.record()
        end.synchronize()
        cycles_per_ms = 1_000_000 / start.elapsed_time(end)
        with comm.traced("wait reduce_scatter", None):
            torch.cuda._sleep(int(cycles_per_ms * ms))

    comm.LEDGER.reset()
    try:
        stream_held_for(50.0)
        host_only = comm.LEDGER.wait_s
        comm.time_waits_on_stream(partial(torch.cuda.Event, enable_timing=True))
        comm.LEDGER.reset()
        stream_held_for(50.0)
        assert 0.04 < comm.LEDGER.wait_s < 0.2, comm.LEDGER.wait_s
        assert host_only < 0.02, host_only
    finally:
        comm.time_waits_on_stream(None)
        comm.LEDGER.reset()


def test_fused_gradient_accumulation_on_cuda_matches_autograd():
    """gradient_accumulation_fusion's GEMMs on CUDA (mm into .grad, then addmm_ into it) against
    autograd's product-then-add over three microbatches, fp32."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 512, 64, generator=gen).cuda()
    weight = torch.randn(96, 64, generator=gen).cuda().requires_grad_()
    fused = weight.detach().clone().requires_grad_()
    sink = weight_grads.DotGradSink(fused, fuses=True)
    weight_grads.set_sink(fused, sink)
    for mb in range(3):
        grad_out = torch.randn(2, 512, 96, generator=gen).cuda()
        torch.nn.functional.linear(x, weight).backward(grad_out)
        weight_grads.linear(x, fused).backward(grad_out)
    assert sink.calls == 3
    torch.testing.assert_close(fused.grad, weight.grad, rtol=1e-5, atol=1e-4)


def test_fused_adamw_on_cuda_is_torch_fused_adamw_bitwise():
    """optim.fused: torch._fused_adamw_ reads the step counts on the GPU (kept there, as torch.optim keeps
    them for its fused kernel): the same bits as torch.optim.AdamW(fused=True)."""
    adamw_against_torch(fused=True, device="cuda")


def test_the_tp_stream_on_cuda_is_seeded_on_the_ranks_device_alone():
    from parallel.random import RNGStreams

    device = torch.device("cuda", torch.cuda.device_count() - 1)
    torch.cuda.manual_seed_all(0)
    current_before = torch.cuda.get_rng_state()
    streams = RNGStreams(seed=5, tp_rank=1, device=device)
    assert torch.equal(torch.cuda.get_rng_state(), current_before)  # the current device's stream untouched
    with streams.tp_region():
        inside = torch.rand(3, device=device)
    assert torch.equal(inside, torch.rand(3, device=device, generator=torch.Generator(device).manual_seed(5 + 2718 + 1)))
