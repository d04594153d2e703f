"""The TransformerEngine stand-in (tests/fake_te) follows TE where model/te.py depends on it: the autocast
under each release's name (`fp8_autocast` for 2.0-2.8, `autocast` from 2.9), both branches of model/te.py
run; TE's default scale computation (a zero or non-finite amax keeps the old scale, an overflowing one is
clamped to fp32's largest value), which the in-tree fp8 update matches; and main_grad read at forward, as
TE 2.0 does (bound before the forward, and the gradient lands in the tensor bound then)."""

import sys
from pathlib import Path

import pytest
import torch

from model.args import ModelArgs
from model.fp8 import Fp8Gemm, Fp8Recipe
from model.te import TEBlocks

FAKE_TE = Path(__file__).resolve().parents[2] / "fake_te"
FP32_MAX = torch.finfo(torch.float32).max


@pytest.fixture
def fake_te(monkeypatch):
    monkeypatch.syspath_prepend(str(FAKE_TE))
    import transformer_engine
    import transformer_engine.pytorch as te

    yield transformer_engine, te
    for name in [m for m in sys.modules if m.startswith("transformer_engine")]:
        del sys.modules[name]


@pytest.mark.parametrize("version, name", [("2.0.0", "fp8_autocast"), ("2.8.3", "fp8_autocast"),
                                           ("2.9.0", "autocast"), ("2.10.1", "autocast")])
def test_the_autocast_of_each_release(fake_te, monkeypatch, version, name):
    transformer_engine, te = fake_te
    monkeypatch.setattr(transformer_engine, "__version__", version)
    assert hasattr(te, "autocast") == (name == "autocast") and hasattr(te, "fp8_autocast")
    group = object()
    blocks = TEBlocks(ModelArgs(use_fp8=True), amax_group=group)
    with blocks.region():
        pass
    assert te.AUTOCAST_NAMES[-1] == name
    enabled, recipe, amax_group = te.AUTOCAST_REGIONS[-1]
    assert enabled and recipe is blocks.recipe and amax_group is group  # the keywords reached TE under either name


def test_scale_update_guards_match_te_and_the_in_tree_update(fake_te):
    _, te = fake_te
    amax = torch.tensor([float("inf"), 1e-40, 2.0, 0.0, float("nan")])
    old = torch.tensor([3.0, 3.0, 3.0, 3.0, 3.0])
    expected = torch.tensor([3.0, FP32_MAX, 224.0, 3.0, 3.0])  # E4M3: 448 / 2
    assert torch.equal(te.default_scale(amax, old, 448.0, 0), expected)

    meta = te._ScalingMeta(5, 2, torch.float8_e4m3fn)
    meta.scale.copy_(old)
    meta.amax_history[0].copy_(amax)
    meta.update(Fp8Recipe(amax_compute_algo="most_recent"))
    assert torch.equal(meta.scale, expected)

    gemm = Fp8Gemm(Fp8Recipe(format="e4m3", amax_history_len=2, amax_compute_algo="most_recent"))
    for operands in (amax[:3], amax[3:].tolist() + [2.0]):  # three operands per gemm
        gemm.scale.fill_(3.0)
        gemm.amax_history[0].copy_(torch.as_tensor(operands))
        gemm.update_scale()
        want = te.default_scale(torch.as_tensor(operands, dtype=torch.float32), torch.full((3,), 3.0), 448.0, 0)
        assert torch.equal(gemm.scale, want), (operands, gemm.scale, want)


def test_main_grad_is_read_at_forward(fake_te):
    _, te = fake_te
    linear = te.Linear(4, 3, parallel_mode="row", bias=False, fuse_wgrad_accumulation=True, device="cpu")
    torch.nn.init.normal_(linear.weight)
    x = torch.randn(2, 4, requires_grad=True)
    with pytest.raises(AttributeError, match="main_grad"):
        linear(x, is_first_microbatch=True)  # nothing bound yet: TE 2.0 fails in forward too
    with torch.no_grad():
        linear(x)  # without grad nothing is read
    bound = torch.zeros(3, 4)
    linear.weight.main_grad = bound
    out = linear(x, is_first_microbatch=True)
    linear.weight.main_grad = torch.zeros(3, 4)  # rebound after the forward: the backward writes the first
    out.sum().backward()
    assert torch.allclose(bound, torch.ones(2, 3).t() @ x.detach()) and linear.weight.grad is None
    assert not linear.weight.main_grad.any()
