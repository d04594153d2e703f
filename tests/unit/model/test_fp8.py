"""The in-tree fp8 GEMM against an explicit quantize-dequantize reference, and the delayed-scaling
recipe step by step against hand-computed values."""

import pytest
import torch

from model.fp8 import FP8_MAX, GRAD_OUTPUT, Fp8Gemm, Fp8Recipe, scaled_mm, update_scaling

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def qdq(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """What an fp8 operand holds, back in fp32: round(x * scale) in the format, divided by scale."""
    limit = FP8_MAX[dtype]
    return (x * scale).clamp(-limit, limit).to(dtype).to(torch.float32) / scale


def operands(grad_std: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 24, 48, generator=gen).requires_grad_()
    weight = (torch.randn(32, 48, generator=gen) * 0.05).requires_grad_()
    return x, weight, torch.randn(2, 24, 32, generator=gen) * grad_std


@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
@pytest.mark.parametrize("wgrad", [True, False])
def test_fp8_gemm_matches_quantize_dequantize_reference(fmt: str, wgrad: bool) -> None:
    x, weight, grad_out = operands(1e-3)
    gemm = Fp8Gemm(Fp8Recipe(format=fmt, wgrad=wgrad))
    scales = (3.0, 600.0, 2.0**14)  # input, weight, output gradient: none of them one
    gemm.scale.copy_(torch.tensor(scales))
    gemm.scale_is_set.fill_(True)
    check_against_reference(gemm, x, weight, grad_out, scales)


def check_against_reference(gemm: Fp8Gemm, x: torch.Tensor, weight: torch.Tensor, grad_out: torch.Tensor,
                            scales: tuple[float, float, float]) -> None:
    out = gemm(x, weight)
    out.backward(grad_out)
    fmt, wgrad = gemm.recipe.format, gemm.recipe.wgrad
    grad_dtype = E5M2 if fmt == "hybrid" else E4M3
    xq, wq = qdq(x.detach(), scales[0], E4M3), qdq(weight.detach(), scales[1], E4M3)
    gq = qdq(grad_out, scales[2], grad_dtype)
    torch.testing.assert_close(out, xq @ wq.t(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad, gq @ wq, rtol=1e-5, atol=1e-9)
    rows_g, rows_x = grad_out.reshape(-1, 32), x.detach().reshape(-1, 48)
    expected_wgrad = gq.reshape(-1, 32).t() @ xq.reshape(-1, 48) if wgrad else rows_g.t() @ rows_x
    torch.testing.assert_close(weight.grad, expected_wgrad, rtol=1e-5, atol=1e-9)
    # The GEMMs recorded each operand's amax of the step in row 0.
    amaxes = [x.detach().abs().max(), weight.detach().abs().max(), grad_out.abs().max()]
    assert gemm.amax_history[0].tolist() == torch.stack(amaxes).tolist()
    assert gemm.amax_history[1:].count_nonzero() == 0


@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
def test_an_infinite_operand_is_not_saturated_into_finite_gradients(fmt: str) -> None:
    """A finite value beyond the format's range saturates; an inf (an overflow upstream) must reach the
    gradients as non-finite, so that the step's finite check halts or skips the step."""
    x, weight, grad_out = operands(1e-3)
    gemm = Fp8Gemm(Fp8Recipe(format=fmt, wgrad=True))
    gemm.scale.copy_(torch.tensor([3.0, 600.0, 2.0**14]))
    gemm.scale_is_set.fill_(True)
    huge = grad_out.clone()
    huge[0, 0, 0] = 1e30  # finite, far beyond the range: saturated
    gemm(x, weight).backward(huge)
    assert torch.isfinite(x.grad).all() and torch.isfinite(weight.grad).all()
    x.grad = weight.grad = None
    grad_out[0, 0, 0] = float("inf")
    gemm(x, weight).backward(grad_out)
    assert not torch.isfinite(x.grad[0, 0]).all() and not torch.isfinite(weight.grad).all()


def test_first_step_scales_activations_by_their_own_amax() -> None:
    """Before any step set them, the input and output-gradient scales come from the tensors' own
    amaxes: step 1's tiny gradients survive E5M2, where the initial scale of 1 flushes them to zero."""
    x, weight, grad_out = operands(1e-7)
    stale = Fp8Gemm(Fp8Recipe(wgrad=True))
    stale.scale_is_set.fill_(True)  # what casting with the initial scales would do
    stale(x, weight).backward(grad_out)
    assert x.grad.count_nonzero() == 0 and weight.grad.count_nonzero() == 0
    x.grad = weight.grad = None

    gemm = Fp8Gemm(Fp8Recipe(wgrad=True))
    scales = (448.0 / x.detach().abs().max().item(), 1.0, 57344.0 / grad_out.abs().max().item())
    check_against_reference(gemm, x, weight, grad_out, scales)
    assert weight.grad.count_nonzero() == weight.numel()
    update_scaling([gemm], group=None)
    weight_scale = 448.0 / weight.detach().abs().max().item()
    assert gemm.scale_is_set.all() and gemm.activation_scales_set  # the host knows: no more current scales
    assert torch.allclose(gemm.scale, torch.tensor([scales[0], weight_scale, scales[2]]).float())


def test_a_scale_is_set_only_by_an_amax_the_recipe_used() -> None:
    """An inf amax kept in a "max" history keeps the gradient scale at 1 for the history's length: the
    scale must not count as set then, or step 2's small gradients would flush to zero after all."""
    gemm = Fp8Gemm(Fp8Recipe(amax_history_len=4))
    for row in ([1.0, 0.05, float("inf")], [1.0, 0.05, 1e-5]):
        gemm.amax_history[0] = torch.tensor(row)
        update_scaling([gemm], group=None)
    assert gemm.scale[GRAD_OUTPUT] == 1.0 and gemm.scale_is_set.tolist() == [True, True, False]
    assert not gemm.activation_scales_set
    x, weight, grad_out = operands(1e-6)
    gemm(x, weight).backward(grad_out)
    assert x.grad.count_nonzero() == x.numel()


def test_a_tiny_amax_gives_the_largest_finite_scale() -> None:
    """A gradient amax of 1e-36 (a dead layer) would give scale 57344 / 1e-36 = inf, and every later
    gradient would dequantize to 0 (or NaN at exact zeros); as in TransformerEngine it is float32's max."""
    gemm = Fp8Gemm(Fp8Recipe(amax_history_len=1))
    gemm.amax_history[0] = torch.tensor([1.0, 0.05, 1e-36])
    update_scaling([gemm], group=None)
    assert gemm.scale[GRAD_OUTPUT].item() == torch.finfo(torch.float32).max
    x, weight, grad_out = operands(1e-3)
    grad_out[0, 0] = 0.0
    gemm(x, weight).backward(grad_out)
    assert torch.isfinite(x.grad).all() and x.grad.count_nonzero() > 0


def test_fp8_cast_saturates_instead_of_overflowing() -> None:
    gemm = Fp8Gemm(Fp8Recipe())
    gemm.scale_is_set.fill_(True)
    x = torch.full((16, 16), 1e6)
    out = gemm(x, torch.eye(16))
    assert torch.isfinite(out).all() and out.max().item() == 448.0


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_delayed_scaling_recipe_step_by_step(algo: str) -> None:
    recipe = Fp8Recipe(format="hybrid", margin=1, amax_history_len=3, amax_compute_algo=algo)
    gemm = Fp8Gemm(recipe)
    steps = [  # amaxes a step records for (input, weight, grad output)
        (4.0, 2.0, 0.0),  # no gradient amax this step: that scale must stay, and stay unset
        (1.0, 8.0, 0.5),
        (2.0, 1.0, 0.25),
        (0.5, 0.5, float("inf")),  # an overflowed gradient: its scale must stay
    ]
    history: list[tuple[float, float, float]] = []
    scale = [1.0, 1.0, 1.0]
    seen = [False, False, False]
    fmax = (448.0, 448.0, 57344.0)
    for amaxes in steps:
        gemm.amax_history[0] = torch.tensor(amaxes)
        update_scaling([gemm], group=None)
        history = ([amaxes] + history)[:3]
        for i in range(3):
            amax = max(h[i] for h in history) if algo == "max" else amaxes[i]
            if amax > 0 and amax != float("inf"):
                scale[i] = fmax[i] / amax / 2.0
        assert gemm.scale.tolist() == torch.tensor(scale).tolist()
        seen = [seen_i or 0 < a < float("inf") for seen_i, a in zip(seen, amaxes)]
        assert gemm.scale_is_set.tolist() == seen
        # Rolled: row 0 waits at zero for the next step, older steps follow newest first from the end.
        expected_rows = [(0.0, 0.0, 0.0), *reversed(history[:2])] if len(history) == 3 else None
        assert gemm.amax_history[0].count_nonzero() == 0
        if expected_rows is not None:
            assert gemm.amax_history.tolist() == torch.tensor(expected_rows).tolist()
    if algo == "max":  # the inf lives on in the history but never becomes a scale
        assert scale[2] == 57344.0 / 0.5 / 2.0


def test_weight_cast_is_cached_across_the_steps_microbatches() -> None:
    gemm = Fp8Gemm(Fp8Recipe())
    x = torch.ones(4, 16)
    weight = torch.full((16, 16), 0.5)
    gemm.set_microbatch(is_first=True, is_last=False)
    first = gemm(x, weight)
    gemm.set_microbatch(is_first=False, is_last=True)
    assert torch.equal(gemm(x, weight * 2), first)  # the first microbatch's cast, reused
    gemm.set_microbatch(is_first=True, is_last=True)
    assert torch.equal(gemm(x, weight * 2), first * 2)  # a new step casts again
    plain = Fp8Gemm(Fp8Recipe())  # no scheduler marks: a cast per call
    assert torch.equal(plain(x, weight * 2), first * 2)


@pytest.mark.parametrize("b_dtype", [E4M3, E5M2])
def test_cpu_gemm_is_torch_scaled_mm_up_to_summation_order(b_dtype: torch.dtype) -> None:
    """On CPU the fp8 product runs as an fp32 GEMM (torch's CPU _scaled_mm is a slow reference loop):
    it must be the product torch._scaled_mm computes."""
    gen = torch.Generator().manual_seed(1)
    a = (torch.randn(32, 48, generator=gen) * 30).to(E4M3)
    b_rows = (torch.randn(16, 48, generator=gen) * 1000).to(b_dtype)
    inv_a, inv_b = torch.tensor(0.25), torch.tensor(1 / 512)
    ours = scaled_mm(a, b_rows, inv_a, inv_b, torch.float32)
    torch_mm = torch._scaled_mm(a, b_rows.t(), scale_a=inv_a, scale_b=inv_b, out_dtype=torch.float32)
    torch.testing.assert_close(ours, torch_mm, rtol=1e-6, atol=1e-5)


def test_a_cast_of_the_model_leaves_the_scaling_state_fp32() -> None:
    """model.bfloat16() must not round the amax history or hand _scaled_mm bf16 scales (CUDA's refuses them)."""
    gemm = Fp8Gemm(Fp8Recipe())
    gemm.scale.copy_(torch.tensor([3.0, 601.0, 2.0**14]))  # 601 is not a bf16 number
    block = torch.nn.Sequential(gemm).bfloat16()
    assert (gemm.scale.dtype, gemm.amax_history.dtype, gemm.scale_is_set.dtype) == (
        torch.float32, torch.float32, torch.bool)
    assert gemm.scale.tolist() == [3.0, 601.0, 2.0**14]
    x = torch.ones(4, 16, dtype=torch.bfloat16)
    assert block[0](x, torch.full((16, 16), 0.5, dtype=torch.bfloat16)).dtype == torch.bfloat16
