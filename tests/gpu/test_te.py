"""TransformerEngine blocks on CUDA (skipped without a GPU or without TransformerEngine; scripts/gpu_check.sh
runs them, and trains model=small with them). The wiring is also tested on CPU against a stand-in of TE
(tests/distributed/test_te_blocks.py); these check TransformerEngine itself."""

import dataclasses
import importlib.util
from contextlib import nullcontext

import pytest
import torch

from model.args import ModelArgs
from model.attention import RotaryEmbedding
from model.fp8 import fp8_gemms
from model.init import init_weights
from model.te import TEBlocks
from model.transformer import TransformerBlock
from parallel.tensor_parallel import TPContext

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None, reason="needs TransformerEngine"),
]

ARGS = ModelArgs(n_layers=1, dim=256, n_heads=4, n_kv_heads=2, vocab_size=512, multiple_of=64, max_seq_len=64)


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def _forward_backward(block: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor, region) -> list[torch.Tensor]:
    cos, sin = RotaryEmbedding(ARGS.head_dim, ARGS.rope_theta)(torch.arange(x.shape[1], device=x.device), x.dtype)
    x = x.clone().requires_grad_()
    with region():
        out = block(x, cos, sin)
    out.backward(grad)
    grads = {n: getattr(p, "main_grad", None) if getattr(p, "wgrad_into_main_grad", False) else p.grad
             for n, p in block.named_parameters()}
    return [out.detach(), x.grad] + [grads[n] for n in sorted(grads)]


@pytest.mark.parametrize("use_fp8", [False, True])
def test_te_block_matches_the_in_tree_block_on_the_same_weights(use_fp8):
    """One block, bf16 activations, the same weights: output, input gradient and every weight gradient
    (TE's through main_grad) within bf16 (or fp8) tolerance of the in-tree block's."""
    args = dataclasses.replace(ARGS, use_fp8=use_fp8)
    torch.manual_seed(0)
    ours = TransformerBlock(0, args, TPContext()).cuda()
    init_weights(ours, args, seed=0)
    te_blocks = TEBlocks(args, amax_group=None)
    with torch.device("cuda"):
        te_block = te_blocks(0, args, TPContext(), None)
    params = dict(ours.named_parameters())
    with torch.no_grad():
        for name, p in te_block.named_parameters():
            p.copy_(params[name])
    ours, te_block = ours.bfloat16(), te_block.bfloat16()
    for gemm in fp8_gemms(list(ours.modules())):  # cast with TE's initial scales of 1, as TE does
        gemm.scale_is_set.fill_(True)
    for p in te_block.parameters():
        if getattr(p, "wgrad_into_main_grad", False):  # what FSDP binds: TE writes the weight gradient here
            p.main_grad = torch.zeros_like(p, dtype=torch.float32)
    x = torch.randn(2, 64, args.dim, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn_like(x) * 1e-2
    want = _forward_backward(ours, x, grad, nullcontext)
    got = _forward_backward(te_block, x, grad, te_blocks.region)
    tolerance = 0.1 if use_fp8 else 2e-2
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g is not None and _relative_error(g, w) < tolerance, (i, _relative_error(g, w))


def test_te_scaling_state_is_live_and_loads_into_a_new_block():
    """scaling_state() returns TE's own tensors (a step changes them in place) and creates them in a block
    that has not run yet, so a checkpoint loads into them: the new block then computes what the old one does."""
    args = dataclasses.replace(ARGS, use_fp8=True, fp8_amax_history_len=4)
    te_blocks = TEBlocks(args, amax_group=None)
    with torch.device("cuda"):
        trained, fresh = te_blocks(0, args, TPContext(), None), te_blocks(0, args, TPContext(), None)
    fresh.load_state_dict(trained.state_dict(), strict=False)
    blocks = (trained.bfloat16(), fresh.bfloat16())
    for block in blocks:
        for p in block.parameters():
            if getattr(p, "wgrad_into_main_grad", False):
                p.main_grad = torch.zeros_like(p, dtype=torch.float32)
    x = torch.randn(2, 64, args.dim, device="cuda", dtype=torch.bfloat16)
    state = trained.scaling_state()
    assert state and all((t == 1).all() for k, t in state.items() if k.endswith(".scale"))
    for _ in range(3):
        _forward_backward(trained, x, torch.randn_like(x) * 1e-2, te_blocks.region)
    assert all((t != 1).any() for k, t in state.items() if k.endswith("scaling_fwd.scale")), state
    loaded = fresh.scaling_state()
    assert loaded.keys() == state.keys()
    for name, t in loaded.items():
        t.copy_(state[name])
    grad = torch.randn_like(x) * 1e-2
    got = _forward_backward(fresh, x, grad, te_blocks.region)
    want = _forward_backward(trained, x, grad, te_blocks.region)
    for g, w in zip(got[:2], want[:2], strict=True):
        assert torch.equal(g, w)
