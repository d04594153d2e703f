"""Context parallelism's chunk-pair kernels (parallel/context_parallel/kernels.py), by model.efficient_attn:
which kernel each name runs on each device, and every CP rank's attention, computed on one device block by
block as the exchanges feed it (attend_block / attend_block_backward: both exchange modes share them),
against attention over the whole sequence in the plain formula: outputs and dQ/dK/dV, causal with grouped
K/V and block_causal documents. Here on CPU (torch's CPU flash kernel and the plain formula); the GPU
tests (tests/gpu/test_cp_kernels.py) run the same comparison with CUDA's flash, memory-efficient and
cuDNN kernels."""

import pytest
import torch

from model.attention import block_causal_mask, causal_attention
from model.attention_kernels import KERNELS
from parallel.context_parallel.kernels import pair_kernel
from parallel.context_parallel.lse import attend_block, attend_block_backward, empty_result

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


class SimulatedRank:
    """What the block functions read of a CPContext, for one CP rank simulated on one device."""

    def __init__(self, rank: int, size: int, kernel: str):
        self.rank, self.size, self.kernel, self.unmasked_pairs = rank, size, kernel, 0


def _shard(x: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    chunks = x.chunk(2 * size, dim=2)
    return torch.cat([chunks[rank], chunks[2 * size - 1 - rank]], dim=2)


def _unshard(parts: list[torch.Tensor], size: int) -> torch.Tensor:
    chunks = [None] * (2 * size)
    for rank, part in enumerate(parts):
        chunks[rank], chunks[2 * size - 1 - rank] = part.chunk(2, dim=2)
    return torch.cat(chunks, dim=2)


def cp_on_one_device(q, k, v, grad_out, size: int, kernel: str, document_ids=None):
    """The output and dq, dk, dv of `size` CP ranks' attention, each rank's queries over every holder's block."""
    outs, grad_qs = [], []
    grad_kv = [torch.zeros((2, *_shard(k, 0, size).shape), dtype=torch.float32, device=q.device) for _ in range(size)]
    for rank in range(size):
        cp = SimulatedRank(rank, size, kernel)
        q_r, grad_out_r = _shard(q, rank, size), _shard(grad_out, rank, size)
        blocks = [torch.stack([_shard(k, h, size), _shard(v, h, size)]) for h in range(size)]
        out, lse = empty_result(q_r)
        for holder, block in enumerate(blocks):
            attend_block(q_r, block, holder, cp, out, lse, document_ids)
        grad_q = torch.zeros(q_r.shape, dtype=torch.float32, device=q.device)
        for holder, block in enumerate(blocks):
            attend_block_backward(q_r, grad_out_r, out, lse, block, holder, cp, grad_q, grad_kv[holder], document_ids)
        outs.append(out)
        grad_qs.append(grad_q)
    return (_unshard(outs, size), _unshard(grad_qs, size), _unshard([g[0] for g in grad_kv], size),
            _unshard([g[1] for g in grad_kv], size))


def whole_sequence(q, k, v, grad_out, document_ids=None):
    """The reference: the plain formula over the whole sequence, in fp32, and its gradients."""
    q, k, v = (t.detach().float().requires_grad_() for t in (q, k, v))
    mask = None if document_ids is None else block_causal_mask(document_ids)
    out = causal_attention(q, k, v, "math", mask)
    out.backward(grad_out.float())
    return out.detach(), q.grad, k.grad, v.grad


def inputs(device: torch.device, dtype: torch.dtype, seq: int = 32, head_dim: int = 16):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, seq, head_dim, generator=gen)
    k, v = (torch.randn(2, 2, seq, head_dim, generator=gen) for _ in range(2))
    grad_out = torch.randn(2, 4, seq, head_dim, generator=gen)
    ids = torch.cumsum(torch.rand(2, seq, generator=gen) < 0.15, dim=1)
    return [t.to(device, dtype) for t in (q, k, v, grad_out)], ids.to(device)


def test_each_name_picks_its_kernel_on_each_device():
    cuda = {name: pair_kernel(name, CUDA, torch.bfloat16, False) for name in KERNELS}
    assert cuda == {"sdpa": "flash", "flash": "flash", "cutlass": "cutlass", "cudnn": "cudnn", "math": "math"}
    assert pair_kernel("sdpa", CUDA, torch.float32, False) == "cutlass"  # flash has no fp32
    assert pair_kernel("flash", CUDA, torch.bfloat16, True) == "cutlass"  # flash takes no mask
    assert pair_kernel("cudnn", CUDA, torch.bfloat16, True) == "cudnn"
    assert {name: pair_kernel(name, CPU, torch.float32, masked) for name in KERNELS for masked in (False, True)} == {
        "sdpa": "cpu_flash", "flash": "cpu_flash", "cutlass": "cpu_flash", "cudnn": "cpu_flash", "math": "math"}


@pytest.mark.parametrize("kernel", ["sdpa", "math"])
@pytest.mark.parametrize("documents", [False, True])
@pytest.mark.parametrize("size", [2, 4])
def test_cp_ranks_on_cpu_match_the_whole_sequence(kernel, documents, size):
    (q, k, v, grad_out), ids = inputs(CPU, torch.float32)
    ids = ids if documents else None
    got = cp_on_one_device(q, k, v, grad_out, size, kernel, ids)
    for a, b in zip(got, whole_sequence(q, k, v, grad_out, ids), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_pair_kernel_the_device_cannot_run_is_one_line_before_building(monkeypatch):
    """The chunk pairs call torch's kernels themselves, without the public SDPA's fallback and head_dim
    padding: CUDA's flash refuses head_dim 36 or > 256, or a GPU before sm80, at step 1. The trainer probes
    them first (here with a kernel made to fail as CUDA's would: CPU's runs every shape)."""
    from types import SimpleNamespace

    from parallel.context_parallel import lse
    from parallel.errors import ConfigError
    from trainer.config.schema import from_dict
    from trainer.parallelize import check_device_kernels

    for kernel in KERNELS:
        for masked in (False, True):
            assert lse.pair_kernel_problem(kernel, CPU, torch.float32, 2, 36, masked) is None

    def refusing(kernel, q, *args):
        if q.shape[-1] % 8:
            raise RuntimeError("head_size must be a multiple of 8, this is ensured by padding!\nmore lines")
        return real(kernel, q, *args)

    real = lse.fused_forward
    monkeypatch.setattr(lse, "fused_forward", refusing)
    assert lse.pair_kernel_problem("sdpa", CPU, torch.float32, 2, 64, True) is None
    assert lse.pair_kernel_problem("sdpa", CPU, torch.float32, 2, 36, False) == (
        "cpu_flash kernel: head_size must be a multiple of 8, this is ensured by padding!")
    cfg = from_dict({"model": {"dim": 72, "n_heads": 2, "n_kv_heads": 2}})
    for cp in (1, 2):
        mesh = SimpleNamespace(dims=SimpleNamespace(cp=cp, tp=1))
        if cp == 1:  # no pairs: the public SDPA pads head_dim itself
            check_device_kernels(cfg, mesh, CPU, torch.float32)
            continue
        with pytest.raises(ConfigError, match=r"^context_parallel_size=2 with model.efficient_attn=sdpa: its chunk "
                                              r"pairs call torch's cpu_flash kernel: head_size must be a multiple of "
                                              r"8, this is ensured by padding! \(float32, head_dim 36\); pin another "
                                              r"kernel, or math$"):
            check_device_kernels(cfg, mesh, CPU, torch.float32)
