"""A CPU stand-in for transformer_engine.pytorch, for tests only.

It has the constructor arguments and the contracts model/te.py relies on: column- and row-parallel
linears whose sequence parallelism gathers and scatters along dim 0, RMSNorm fused into
LayerNormLinear, `fuse_wgrad_accumulation` writing the weight gradient into `weight.main_grad`
(overwriting it on the first microbatch, adding otherwise) and returning none, `is_first_microbatch`
in forward, and an autocast region with a recipe and an amax reduction group. It computes in the
input's dtype without fp8: it checks our wiring, not TransformerEngine (the GPU tests do that).
"""

import torch
import torch.distributed as dist
from torch import nn

AUTOCAST_REGIONS: list[tuple[bool, object, object]] = []  # (enabled, recipe, amax group) per region entered
FIRST_MICROBATCH_FLAGS: list[bool | None] = []  # is_first_microbatch of every linear forward
MAIN_GRAD_WRITES: list[int] = []  # one per weight gradient written into main_grad


class autocast:
    def __init__(self, enabled: bool = True, calibrating: bool = False, recipe=None, amax_reduction_group=None):
        self.entry = (enabled, recipe, amax_reduction_group)

    def __enter__(self):
        AUTOCAST_REGIONS.append(self.entry)
        return self

    def __exit__(self, *exc) -> None:
        return None


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
    """x @ weight^T. With `fuse` the weight gradient goes into weight.main_grad (overwritten on the first
    microbatch, added otherwise) and none is returned; without it, it is returned as usual."""

    @staticmethod
    def forward(ctx, x, weight, is_first_microbatch, fuse):
        ctx.save_for_backward(x)
        ctx.weight, ctx.is_first_microbatch, ctx.fuse = weight, is_first_microbatch, fuse
        return x @ weight.t()

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        grad_x = grad_out @ ctx.weight
        wgrad = grad_out.reshape(-1, grad_out.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        if not ctx.fuse:
            return grad_x, wgrad, None, None
        main_grad = ctx.weight.main_grad
        main_grad.copy_(wgrad) if ctx.is_first_microbatch else main_grad.add_(wgrad)
        MAIN_GRAD_WRITES.append(1)
        return grad_x, None, None, None


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

    def _gemm(self, x: torch.Tensor, is_first_microbatch: bool | None) -> torch.Tensor:
        FIRST_MICROBATCH_FLAGS.append(is_first_microbatch)
        return FusedWgradLinear.apply(x, self.weight, is_first_microbatch, self.fuse)


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
