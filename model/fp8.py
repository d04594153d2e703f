"""fp8 GEMMs with delayed per-tensor scaling: TransformerEngine's DelayedScaling recipe, in-tree.

Each fp8 linear owns an `Fp8Gemm` holding the scaling state of its three operands (the input, the
weight and the output gradient) as buffers, so FSDP materializes them and checkpoints save them:

    amax_history [history_len, 3]   row 0: the amaxes of the running step (max over its microbatches)
    scale        [3]                what each operand is multiplied by before the cast to fp8
    scale_is_set [3]                whether a step's amax has set that scale yet

After a step, `update_scaling` reduces row 0 of every gemm of the rank in ONE all-reduce (max) over
the amax group, so every rank holds the same scales; then each gemm computes its new scales from the
history and rolls it (row 0 starts the next step at zero). The next step quantizes with them: delayed
scaling. As in TransformerEngine: scale = fp8_max / amax / 2^margin with amax the history's max
("max") or row 0 ("most_recent"); a zero or non-finite amax keeps the previous scale.

Unlike TransformerEngine, the first step does not cast with the initial scale of 1: step 1's output
gradients (the loss is divided by the global token count) are ~1e-5..1e-7, below what E5M2 holds at
scale 1, so whole weight gradients would come out exactly zero. Until a step has set it, an
activation operand (input, output gradient) is cast with the scale of its own amax ("current"
scaling, rank-local: each GEMM dequantizes its own operands). Weights are known before any data: the
trainer records their amaxes in a "step 0" update (`record_weight_amax`, then `update_scaling`), so
step 1 casts them with a recipe scale that is the same on every rank, as the fp8 all-gather needs.

Formats: "hybrid" casts inputs and weights to E4M3 and output gradients to E5M2 (more range, the
gradients need it); "e4m3" uses E4M3 for all three. GEMMs run through torch._scaled_mm with the
inverse scales and return the compute dtype. With `wgrad=False` the weight gradient is computed in the
compute dtype from the saved high-precision input (and the unquantized output gradient).
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed import ProcessGroup, ReduceOp

from parallel import comm, weight_grads
from parallel.regional_compile import eager_region

INPUT, WEIGHT, GRAD_OUTPUT = 0, 1, 2
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
# The GEMM shapes torch._scaled_mm accepts on CUDA (the CPU kernel has no such rule).
GEMM_MULTIPLE = 16


@dataclass(frozen=True)
class Fp8Recipe:
    format: str = "hybrid"  # hybrid | e4m3
    margin: int = 0
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"  # max | most_recent
    wgrad: bool = True

    @property
    def forward_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn

    @property
    def backward_dtype(self) -> torch.dtype:
        return torch.float8_e5m2 if self.format == "hybrid" else torch.float8_e4m3fn

    def fp8_max(self) -> torch.Tensor:
        """Per operand (input, weight, output gradient): the largest finite value of its format."""
        return torch.tensor([self.operand_max(op) for op in (INPUT, WEIGHT, GRAD_OUTPUT)], dtype=torch.float32)

    def operand_max(self, operand: int) -> float:
        return FP8_MAX[self.backward_dtype if operand == GRAD_OUTPUT else self.forward_dtype]


def amax_is_valid(amax: torch.Tensor) -> torch.Tensor:
    return (amax > 0) & torch.isfinite(amax)


def recipe_scale(amax: torch.Tensor, fp8_max: torch.Tensor | float, margin: int, fallback: torch.Tensor) -> torch.Tensor:
    """fp8_max / amax / 2^margin; `fallback` where the amax is zero or non-finite. An amax below ~1e-34
    makes the quotient overflow: as TransformerEngine does, it becomes float32's largest value, whose
    inverse still dequantizes (an inf scale would turn every product into 0 or NaN)."""
    scale = (fp8_max / amax / 2.0**margin).clamp(max=torch.finfo(torch.float32).max)
    return torch.where(amax_is_valid(amax), scale, fallback)


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Saturating cast of x * scale to an fp8 format (the cast alone would turn overflow into NaN)."""
    limit = FP8_MAX[dtype]
    return (x.float() * scale).clamp_(-limit, limit).to(dtype)


def _cast_scale(scale: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """The scale to cast x with, given x's amax: NaN when the amax is not finite (an inf or NaN in x), so
    that the whole cast is NaN rather than saturated. Saturated, an inf in an output gradient would give
    finite input and weight gradients, the step's finite check would apply it, and its inf amax would
    freeze the scale for the whole history. A scalar operation: no extra pass over x."""
    return torch.where(torch.isfinite(amax), scale, torch.nan)


def scaled_mm(a: torch.Tensor, b_rows: torch.Tensor, inv_a: torch.Tensor, inv_b: torch.Tensor,
              out_dtype: torch.dtype) -> torch.Tensor:
    """a @ b_rows^T for fp8 a [m, k] and b_rows [n, k], dequantized by the inverse scales.

    On CUDA: torch._scaled_mm. torch's CPU _scaled_mm is a reference loop (~60 ns per multiply-add,
    2000x an fp32 GEMM), so on CPU the same product runs as an fp32 GEMM of the fp8 operands: fp8 values
    and their pairwise products are exact in fp32 and both accumulate in fp32, so the two differ only
    in summation order (tests/unit/model/test_fp8.py holds them together)."""
    if a.device.type != "cpu":
        return torch._scaled_mm(a.contiguous(), b_rows.contiguous().t(), scale_a=inv_a, scale_b=inv_b,
                                out_dtype=out_dtype)
    return ((a.float() @ b_rows.float().t()) * (inv_a * inv_b)).to(out_dtype)


class _Fp8Linear(torch.autograd.Function):
    """y = x @ W^T with fp8 operands. `weight` (the parameter) is an input only so that its gradient
    is routed; the GEMMs read `w_fp8`, its cast (cached or gathered in fp8)."""

    @staticmethod
    def forward(ctx, x, weight, gemm, w_fp8):
        recipe = gemm.recipe
        rows = x.reshape(-1, x.shape[-1])
        scale_x = gemm.activation_scale(INPUT, rows)
        x_fp8 = quantize(rows, scale_x, recipe.forward_dtype)
        inv_x, inv_w = scale_x.reciprocal(), gemm.scale[WEIGHT].reciprocal()
        out = scaled_mm(x_fp8, w_fp8, inv_x, inv_w, x.dtype)
        # The fp8 weight is kept as an attribute: an FSDP fp8 gather refills its storage in place with
        # the same bytes before the backward, which the saved-tensor version check would reject.
        ctx.gemm, ctx.w_fp8, ctx.inv_w, ctx.x_shape, ctx.inv_x = gemm, w_fp8, inv_w, x.shape, inv_x
        ctx.sink = weight_grads.sink_of(weight)  # a zero-bubble step's W takes the weight gradient
        ctx.save_for_backward(x_fp8 if recipe.wgrad else rows)
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        gemm, recipe = ctx.gemm, ctx.gemm.recipe
        (saved_x,) = ctx.saved_tensors
        grad_rows = grad_out.reshape(-1, grad_out.shape[-1])
        scale_g = gemm.activation_scale(GRAD_OUTPUT, grad_rows)
        g_fp8 = quantize(grad_rows, scale_g, recipe.backward_dtype)
        inv_g = scale_g.reciprocal()
        grad_x = scaled_mm(g_fp8, ctx.w_fp8.t(), inv_g, ctx.inv_w, grad_out.dtype)
        weight_grad = _fp8_weight_grad(g_fp8, saved_x, inv_g, ctx.inv_x, grad_out.dtype) if recipe.wgrad \
            else _weight_grad(grad_rows, saved_x)

        if weight_grads.defer_weight_grad(ctx.sink, weight_grad):
            return grad_x.view(ctx.x_shape), None, None, None
        return grad_x.view(ctx.x_shape), weight_grad(), None, None


def _fp8_weight_grad(g_fp8: torch.Tensor, x_fp8: torch.Tensor, inv_g: torch.Tensor, inv_x: torch.Tensor,
                     dtype: torch.dtype) -> Callable[[], torch.Tensor]:
    """The weight gradient's fp8 GEMM, holding only its fp8 operands (a zero-bubble W may run it much
    later); their amaxes are already recorded (the input's in forward, the gradient's in backward)."""
    return lambda: scaled_mm(g_fp8.t(), x_fp8.t(), inv_g, inv_x, dtype)


def _weight_grad(grad_rows: torch.Tensor, rows: torch.Tensor) -> Callable[[], torch.Tensor]:
    """The weight gradient in the compute dtype, holding only the gradient and the input rows."""
    return lambda: grad_rows.t() @ rows


class Fp8Gemm(nn.Module):
    """The fp8 matmul of one linear, with its scaling state; a tensor-parallel linear calls it as
    `gemm(x, weight)` in place of a plain matmul.

    The weight's fp8 cast is made on the step's first microbatch and reused by the others (the
    scheduler's marks arrive through `set_microbatch`); without marks it is made on every call. With
    FSDP's fp8 all-gather the unit casts its weight shard and hands over the gathered fp8 weight."""

    def __init__(self, recipe: Fp8Recipe):
        super().__init__()
        self.recipe = recipe
        self.register_buffer("amax_history", torch.zeros(recipe.amax_history_len, 3))
        self.register_buffer("scale", torch.ones(3))
        self.register_buffer("scale_is_set", torch.zeros(3, dtype=torch.bool))
        self.is_first_microbatch: bool | None = None
        # A host copy of "input and gradient scales both set" (note_set_scales): then the current-amax
        # scale is not computed at all. True only once known, so a gemm nobody told stays correct.
        self.activation_scales_set = False
        self._weight_cast: torch.Tensor | None = None
        self._gathered: torch.Tensor | None = None
        self._fp8_max: torch.Tensor | None = None  # recipe.fp8_max() on the scales' device

    @eager_region
    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # Eager under compile=true: the host-side state (the first microbatch's cast, activation_scales_set)
        # changes between microbatches and steps and would recompile the block.
        return _Fp8Linear.apply(x, weight, self, self._fp8_weight(weight))

    def _apply(self, fn, recurse: bool = True) -> "Fp8Gemm":
        """A cast of the model (`.bfloat16()`, `.to(dtype)`) leaves the scaling state fp32, as TE keeps
        its fp8 metadata: _scaled_mm takes fp32 scales only, and a bf16 amax history would round."""
        before = dict(self._buffers)
        super()._apply(fn, recurse)
        for name, old in before.items():  # fn's device, the old values (a meta tensor has none)
            new = self._buffers[name]
            self._buffers[name] = new.to(old.dtype) if old.is_meta else old.to(new.device)
        return self

    def _fp8_weight(self, weight: torch.Tensor) -> torch.Tensor:
        if self._gathered is not None:
            return self._gathered
        if self.is_first_microbatch is False and self._weight_cast is not None:
            return self._weight_cast
        w = weight.detach()
        amax = self.record_amax(WEIGHT, w)
        cast = quantize(w, _cast_scale(self.scale[WEIGHT], amax), self.recipe.forward_dtype)
        self._weight_cast = cast if self.is_first_microbatch is not None else None
        return cast

    @torch.no_grad()
    def record_amax(self, operand: int, x: torch.Tensor) -> torch.Tensor:
        """Fold x's amax into the step's row; returns that amax (zero for an empty x)."""
        amax = x.detach().abs().max().float() if x.numel() else self.amax_history.new_zeros(())
        slot = self.amax_history[0, operand]
        slot.copy_(torch.maximum(slot, amax))
        return amax

    @torch.no_grad()
    def activation_scale(self, operand: int, x: torch.Tensor) -> torch.Tensor:
        """The scale to cast activation x with: the delayed scale once set, else x's own (see above)."""
        amax = self.record_amax(operand, x)
        if self.activation_scales_set:
            return _cast_scale(self.scale[operand], amax)
        current = recipe_scale(amax, self.recipe.operand_max(operand), self.recipe.margin, self.scale[operand])
        return _cast_scale(torch.where(self.scale_is_set[operand], self.scale[operand], current), amax)

    def record_weight_amax(self, piece: torch.Tensor) -> None:
        """Step 0: fold (a piece of) the weight's amax into the row the next update reads."""
        self.record_amax(WEIGHT, piece)

    @torch.no_grad()
    def update_scale(self) -> None:
        """The recipe's step-end update, once row 0 holds the reduced amaxes of the step."""
        history = self.amax_history
        amax = history.max(dim=0).values if self.recipe.amax_compute_algo == "max" else history[0]
        if self._fp8_max is None or self._fp8_max.device != amax.device:
            # Made once per device: a host tensor copied to a GPU each step would sync the stream per GEMM.
            self._fp8_max = self.recipe.fp8_max().to(amax.device)
        self.scale.copy_(recipe_scale(amax, self._fp8_max, self.recipe.margin, self.scale))
        # Set only by an amax the recipe used: an inf kept in a "max" history keeps the scale where it was.
        self.scale_is_set |= amax_is_valid(amax)
        history.copy_(torch.roll(history, -1, dims=0))
        history[0].zero_()

    # --- the microbatch protocol (FSDP's scheduler marks) -----------------------------------------
    def set_microbatch(self, is_first: bool | None, is_last: bool) -> None:
        self.is_first_microbatch = is_first
        if is_first is None:  # unmarked: no cast is reused, so none is kept
            self._weight_cast = None

    # --- FSDP's fp8 all-gather ---------------------------------------------------------------------
    @property
    def fp8_weight_dtype(self) -> torch.dtype:
        return self.recipe.forward_dtype

    def cast_weight_shard(self, piece: torch.Tensor) -> torch.Tensor:
        """This rank's piece of the weight, cast with the step's weight scale (its amax recorded)."""
        amax = self.record_amax(WEIGHT, piece)
        return quantize(piece, _cast_scale(self.scale[WEIGHT], amax), self.recipe.forward_dtype)

    def use_gathered_weight(self, weight_fp8: torch.Tensor) -> torch.Tensor:
        """Take the gathered fp8 weight for the coming GEMMs; returns its dequantized fp32 value."""
        self._gathered = weight_fp8
        return weight_fp8.float() / self.scale[WEIGHT]


def fp8_gemms(modules: list[nn.Module]) -> list[Fp8Gemm]:
    """Every fp8 gemm of some modules, in a fixed order (the same on every rank of a pipeline stage)."""
    return [m for module in modules for m in module.modules() if isinstance(m, Fp8Gemm)]


def update_scaling(gemms: list[Fp8Gemm], group: ProcessGroup | None) -> None:
    """Step end: ONE all-reduce (max) of every gemm's step amaxes over `group`, then new scales."""
    if not gemms:
        return
    amax = torch.stack([g.amax_history[0] for g in gemms])
    if group is not None and group.size() > 1:
        comm.all_reduce(amax, group, op=ReduceOp.MAX, label="fp8 amax")
    for gemm, reduced in zip(gemms, amax):
        gemm.amax_history[0].copy_(reduced)
        gemm.update_scale()
    note_set_scales(gemms)


def note_set_scales(gemms: list[Fp8Gemm]) -> None:
    """Tell each gemm, on the host, whether its input and gradient scales are set (one device sync for
    all of them, at step end or after a load): from then on no GEMM computes a current-amax scale."""
    if gemms:
        flags = torch.stack([g.scale_is_set for g in gemms]).tolist()
        for gemm, (is_set_input, _, is_set_grad) in zip(gemms, flags):
            gemm.activation_scales_set = is_set_input and is_set_grad


@torch.no_grad()
def discard_step_amaxes(gemms: list[Fp8Gemm]) -> None:
    """Forget the amaxes recorded since the last update (e.g. by evaluation forwards between steps)."""
    for gemm in gemms:
        gemm.amax_history[0].zero_()


def initial_buffer(name: str, like: torch.Tensor) -> torch.Tensor:
    """The value an fp8 scaling buffer starts from: an empty history, unit scales, none of them set."""
    if name.endswith("scale_is_set"):
        return torch.zeros(like.shape, dtype=torch.bool)
    if name.endswith("amax_history"):
        return torch.zeros(like.shape)
    if name.endswith("scale"):
        return torch.ones(like.shape)
    raise KeyError(f"no initial value for buffer {name}")
