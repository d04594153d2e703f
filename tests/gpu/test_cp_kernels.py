"""Context parallelism's CUDA chunk-pair kernels (flash, memory-efficient, cuDNN, and `sdpa`'s pick) against
the plain formula over the whole sequence: every CP rank (C = 2 and 4) simulated on one GPU block by block,
as both exchange modes feed the blocks; outputs and dQ/dK/dV, causal with grouped K/V and block_causal
documents, in bf16 (and fp32 where the kernel has it). The CPU twin is tests/unit/parallel/test_cp_kernels.py."""

import pytest
import torch

from tests.unit.parallel.test_cp_kernels import cp_on_one_device, inputs, whole_sequence

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CASES = [pytest.param(kernel, dtype, id=f"{kernel}-{name}") for kernel, dtype, name in (
    *((kernel, torch.bfloat16, "bf16") for kernel in ("sdpa", "flash", "cutlass", "cudnn")),
    ("sdpa", torch.float32, "fp32"), ("cutlass", torch.float32, "fp32"))]
TOLERANCE = {torch.bfloat16: 3e-2, torch.float32: 1e-4}


@pytest.mark.parametrize("kernel, dtype", CASES)
@pytest.mark.parametrize("documents", [False, True])
@pytest.mark.parametrize("size", [2, 4])
def test_cp_kernels_match_the_plain_formula(kernel, dtype, documents, size):
    (q, k, v, grad_out), ids = inputs(torch.device("cuda"), dtype, seq=256, head_dim=64)
    ids = ids if documents else None
    got = cp_on_one_device(q, k, v, grad_out, size, kernel, ids)
    want = whole_sequence(q, k, v, grad_out, ids)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        scale = b.abs().max().item()
        torch.testing.assert_close(a, b, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype] * scale, msg=name)


def test_the_pair_kernel_probe_finds_what_flash_refuses():
    """CUDA's flash kernel, called directly as the pairs call it, takes only head_dim a multiple of 8 (the
    public SDPA pads it): the probe the trainer runs before building says so; a head_dim of 64 runs."""
    from parallel.context_parallel.lse import pair_kernel_problem

    cuda = torch.device("cuda")
    assert pair_kernel_problem("sdpa", cuda, torch.bfloat16, 2, 64, True) is None
    problem = pair_kernel_problem("sdpa", cuda, torch.bfloat16, 2, 36, False)
    assert problem is not None and problem.startswith("flash kernel: ")
