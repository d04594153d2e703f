"""A CPU stand-in for transformer_engine.pytorch, for tests only.

It has the constructor arguments and the contracts model/te.py relies on: column- and row-parallel
linears whose sequence parallelism gathers and scatters along dim 0, RMSNorm fused into
LayerNormLinear, `fuse_wgrad_accumulation` writing the weight gradient into `weight.main_grad`
(overwriting it on the first microbatch, adding otherwise) and returning none, `is_first_microbatch`
in forward (which reads `weight.main_grad` at forward, as TE 2.0 does: the tensor it writes in
backward is the one bound then), and an autocast region with a recipe and an amax reduction group, under TE's name
of the installed version: `fp8_autocast(fp8_recipe=, fp8_group=)` in 2.0-2.8, `autocast(recipe=,
amax_reduction_group=)` from 2.9 on (where `fp8_autocast` remains, deprecated). Set the stand-in's
`transformer_engine.__version__` to pick a release.

fp8 is modelled by TE's delayed-scaling state, not by fp8 GEMMs: inside an enabled region each linear
keeps `fp8_meta["scaling_fwd"]` (input, weight, output) and `fp8_meta["scaling_bwd"]` (output
gradient, input gradient), each a scale and an amax history, created by `init_fp8_metadata` at its
first fp8 forward. The weight's cast is made on the first microbatch and reused by the others.
Operands are quantized and dequantized with those scales (E4M3; E5M2 gradients
under HYBRID) and their amaxes recorded. As in TE, the outermost enabled region's exit reduces the
forward amaxes in one all-reduce (max) over the amax group and updates scales and histories as
DelayedScaling does (a zero or non-finite amax keeps the old scale, an overflowing one is clamped to
fp32's largest value, as TE's default scale computation does), and the backward of the region's first
fp8 module (its last backward) does the same for the backward amaxes. So the losses depend on that state, as TE's do. It checks our wiring, not
TransformerEngine (the GPU tests do that).
"""

import torch
import torch.distributed as dist
from torch import nn

AUTOCAST_REGIONS: list[tuple[bool, object, object]] = []  # (enabled, recipe, amax group) per region entered
AUTOCAST_NAMES: list[str] = []  # the API each region was entered by: "autocast" or "fp8_autocast"
FIRST_MICROBATCH_FLAGS: list[bool | None] = []  # is_first_microbatch of every linear forward
MAIN_GRAD_WRITES: list[int] = []  # one per weight gradient written into main_grad
AMAX_REDUCTIONS: list[int] = []  # the number of amaxes of each reduction
_FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
AUTOCAST_SINCE = (2, 9)  # TE 2.9 renamed fp8_autocast to autocast


def _version() -> tuple[int, int]:
    import transformer_engine

    major, minor = transformer_engine.__version__.split(".")[:2]
    return int(major), int(minor)


class _Region:
    """The innermost autocast region's settings, and the modules whose forward (backward) amaxes await
    the next update."""

    enabled, recipe, group, depth = False, None, None, 0
    pending_fwd: dict[int, "_ParallelLinear"] = {}
    pending_bwd: dict[int, "_ParallelLinear"] = {}


class _Autocast:
    """TE >= 2.9's `autocast`."""

    name = "autocast"

    def __init__(self, enabled: bool = True, calibrating: bool = False, recipe=None, amax_reduction_group=None):
        self.entry = (enabled, recipe, amax_reduction_group)

    def __enter__(self):
        AUTOCAST_REGIONS.append(self.entry)
        AUTOCAST_NAMES.append(self.name)
        self.outer = (_Region.enabled, _Region.recipe, _Region.group)
        _Region.enabled, _Region.recipe, _Region.group = self.entry
        _Region.depth += 1
        return self

    def __exit__(self, *exc) -> None:
        _Region.depth -= 1
        enabled, recipe, group = self.entry
        if enabled and _Region.depth == 0 and torch.is_grad_enabled():
            _update_scaling(_Region.pending_fwd, "scaling_fwd", recipe, group)
        _Region.enabled, _Region.recipe, _Region.group = self.outer


class fp8_autocast(_Autocast):
    """TE 2.0-2.8's name and keywords (deprecated, still there, from 2.9 on)."""

    name = "fp8_autocast"

    def __init__(self, enabled: bool = True, calibrating: bool = False, fp8_recipe=None, fp8_group=None):
        super().__init__(enabled, calibrating, fp8_recipe, fp8_group)


def __getattr__(name: str):
    """`autocast` exists only from TE 2.9 on."""
    if name == "autocast" and _version() >= AUTOCAST_SINCE:
        return _Autocast
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _ScalingMeta:
    """One direction's delayed-scaling state: per operand a scale and an amax history (row 0: now)."""

    def __init__(self, operands: int, history_len: int, dtype: torch.dtype):
        self.scale = torch.ones(operands)
        self.amax_history = torch.zeros(history_len, operands)
        self.dtype = dtype

    def qdq(self, operand: int, x: torch.Tensor) -> torch.Tensor:
        """x through this operand's fp8 cast and back, its amax recorded."""
        with torch.no_grad():
            slot = self.amax_history[0, operand]
            slot.copy_(torch.maximum(slot, x.detach().abs().max().float()))
        scale, limit = self.scale[operand], _FP8_MAX[self.dtype]
        return ((x.float() * scale).clamp(-limit, limit).to(self.dtype).float() / scale).to(x.dtype)

    def update(self, recipe) -> None:
        history = self.amax_history
        amax = history.max(dim=0).values if recipe.amax_compute_algo == "max" else history[0]
        self.scale.copy_(default_scale(amax, self.scale, _FP8_MAX[self.dtype], recipe.margin))
        history.copy_(torch.roll(history, -1, dims=0))
        history[0].zero_()


def default_scale(amax: torch.Tensor, scale: torch.Tensor, fp8_max: float, margin: int) -> torch.Tensor:
    """TE's default scale computation (DelayedScaling): fp8_max / amax / 2^margin, the old scale where the
    amax is zero or not finite, fp32's largest value where the quotient overflows."""
    new = fp8_max / amax / 2.0**margin
    new = torch.where(amax > 0.0, new, scale)
    new = torch.where(torch.isfinite(amax), new, scale)
    return torch.where(torch.isinf(new), torch.full_like(new, torch.finfo(torch.float32).max), new)


def _update_scaling(pending: dict, key: str, recipe, group) -> None:
    metas = [m.fp8_meta[key] for m in pending.values()]
    pending.clear()
    if not metas:
        return
    amaxes = torch.cat([meta.amax_history[0] for meta in metas])
    if group is not None and group.size() > 1:
        dist.all_reduce(amaxes, op=dist.ReduceOp.MAX, group=group)
    AMAX_REDUCTIONS.append(amaxes.numel())
    for meta, reduced in zip(metas, amaxes.split([meta.scale.numel() for meta in metas])):
        meta.amax_history[0].copy_(reduced)
        meta.update(recipe)


def _gather0(x: torch.Tensor, group) -> torch.Tensor:
    out = torch.empty((x.shape[0] * group.size(), *x.shape[1:]), dtype=x.dtype)
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out


def _reduce_scatter0(x: torch.Tensor, group) -> torch.Tensor:
    out = torch.empty((x.shape[0] // group.size(), *x.shape[1:]), dtype=x.dtype)
    dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
    return out


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    out = x.clone()
    dist.all_reduce(out, group=group)
    return out


class _Collective(torch.autograd.Function):
    """forward(x) then backward(grad) through two given collectives (None: identity)."""

    @staticmethod
    def forward(ctx, x, group, fwd, bwd):
        ctx.group, ctx.bwd = group, bwd
        return x if fwd is None else fwd(x, group)

    @staticmethod
    def backward(ctx, grad):
        return (grad if ctx.bwd is None else ctx.bwd(grad, ctx.group)), None, None, None


class FusedWgradLinear(torch.autograd.Function):
    """x @ weight^T. With `main_grad` (the weight's, read by the module's forward with grad enabled, as TE
    2.0 reads it) the weight gradient goes into it (overwritten on the first microbatch, added otherwise)
    and none is returned; without it (None), it is returned as usual. With fp8
    (`fp8`: the module, whether it is its region's first, the region's recipe and group), operands go
    through the module's fp8 casts."""

    @staticmethod
    def forward(ctx, x, weight, is_first_microbatch, main_grad, fp8=None):
        w = weight
        if fp8 is not None:
            x, w = fp8[0].fp8_meta["scaling_fwd"].qdq(0, x), fp8[0].fp8_weight(weight, is_first_microbatch)
        ctx.save_for_backward(x, w)
        ctx.is_first_microbatch, ctx.main_grad, ctx.fp8 = is_first_microbatch, main_grad, fp8
        return x @ w.t()

    @staticmethod
    def backward(ctx, grad_out):
        x, w = ctx.saved_tensors
        if ctx.fp8 is not None:
            owner, region_first, recipe, group = ctx.fp8
            grad_out = owner.fp8_meta["scaling_bwd"].qdq(0, grad_out)
            _Region.pending_bwd[id(owner)] = owner
            if region_first:
                _update_scaling(_Region.pending_bwd, "scaling_bwd", recipe, group)
        grad_x = grad_out @ w
        wgrad = grad_out.reshape(-1, grad_out.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        main_grad = ctx.main_grad
        if main_grad is None:
            return grad_x, wgrad, None, None, None
        main_grad.copy_(wgrad) if ctx.is_first_microbatch else main_grad.add_(wgrad)
        MAIN_GRAD_WRITES.append(1)
        return grad_x, None, None, None, None


class _ParallelLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, parallel_mode: str, bias: bool = True, tp_group=None,
                 tp_size: int = 1, sequence_parallel: bool = False, fuse_wgrad_accumulation: bool = False,
                 params_dtype: torch.dtype = torch.float32, device="cuda"):
        super().__init__()
        assert not bias and parallel_mode in ("column", "row")
        # TE defers its initialization only for the string "meta" (torch.device("meta") != "meta").
        assert not (isinstance(device, torch.device) and device.type == "meta"), "pass device='meta' to TE"
        self.parallel_mode, self.tp_group, self.tp_size = parallel_mode, tp_group, tp_size
        self.sequence_parallel, self.fuse = sequence_parallel, fuse_wgrad_accumulation
        out_local = out_features // tp_size if parallel_mode == "column" else out_features
        in_local = in_features // tp_size if parallel_mode == "row" else in_features
        self.weight = nn.Parameter(torch.empty(out_local, in_local, dtype=params_dtype, device=device))
        self.fp8, self.fp8_meta = False, {}
        self._weight_cast: torch.Tensor | None = None

    def fp8_weight(self, weight: torch.Tensor, is_first_microbatch: bool | None) -> torch.Tensor:
        """As TE: the first microbatch's cast (amax recorded) is reused by the later ones, which record
        no weight amax; None casts on every call and keeps nothing."""
        if is_first_microbatch is False:
            assert self._weight_cast is not None, "is_first_microbatch=False before a first microbatch"
            return self._weight_cast
        cast = self.fp8_meta["scaling_fwd"].qdq(1, weight.detach())
        self._weight_cast = cast if is_first_microbatch else None
        return cast

    def init_fp8_metadata(self, num_gemms: int = 1) -> None:
        """The fp8 state, created in the first enabled region and kept from then on."""
        self.fp8 = _Region.enabled
        if self.fp8 and "scaling_fwd" not in self.fp8_meta:
            recipe = _Region.recipe
            backward = torch.float8_e5m2 if recipe.fp8_format.value == "hybrid" else torch.float8_e4m3fn
            self.fp8_meta["scaling_fwd"] = _ScalingMeta(3 * num_gemms, recipe.amax_history_len, torch.float8_e4m3fn)
            self.fp8_meta["scaling_bwd"] = _ScalingMeta(2 * num_gemms, recipe.amax_history_len, backward)

    def _gemm(self, x: torch.Tensor, is_first_microbatch: bool | None) -> torch.Tensor:
        FIRST_MICROBATCH_FLAGS.append(is_first_microbatch)
        self.init_fp8_metadata()
        fp8 = None
        if self.fp8:
            fp8 = (self, not _Region.pending_fwd, _Region.recipe, _Region.group)
            _Region.pending_fwd[id(self)] = self
        # TE 2.0 reads main_grad at forward (later releases defer it to backward): it must be bound by then.
        main_grad = self.weight.main_grad if self.fuse and torch.is_grad_enabled() else None
        return FusedWgradLinear.apply(x, self.weight, is_first_microbatch, main_grad, fp8)


class LayerNormLinear(_ParallelLinear):
    def __init__(self, in_features: int, out_features: int, eps: float = 1e-5, normalization: str = "LayerNorm",
                 **options):
        super().__init__(in_features, out_features, **options)
        assert normalization == "RMSNorm"
        self.eps = eps
        self.layer_norm_weight = nn.Parameter(torch.ones(in_features, device=options.get("device")))

    def forward(self, inp: torch.Tensor, is_first_microbatch: bool | None = None) -> torch.Tensor:
        h = inp.float()
        h = self.layer_norm_weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(inp.dtype)
        if self.tp_size > 1:
            fwd, bwd = (_gather0, _reduce_scatter0) if self.sequence_parallel else (None, _all_reduce)
            h = _Collective.apply(h, self.tp_group, fwd, bwd)
        return self._gemm(h, is_first_microbatch)


class Linear(_ParallelLinear):
    def forward(self, inp: torch.Tensor, is_first_microbatch: bool | None = None) -> torch.Tensor:
        y = self._gemm(inp, is_first_microbatch)
        if self.tp_size > 1:
            fwd, bwd = (_reduce_scatter0, _gather0) if self.sequence_parallel else (_all_reduce, None)
            y = _Collective.apply(y, self.tp_group, fwd, bwd)
        return y
