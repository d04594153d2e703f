"""TransformerEngine blocks (`model.use_te_layers=true`, CUDA only): the Llama block of
model/transformer.py with TE's fused modules doing its norms and linears.

    attention_norm + wqkv  -> te.LayerNormLinear (RMSNorm, column parallel)
    wo                     -> te.Linear (row parallel)
    ffn_norm + w13         -> te.LayerNormLinear (RMSNorm, column parallel)
    w2                     -> te.Linear (row parallel)

RoPE and the attention core (with context parallelism) stay ours. The block has exactly the in-tree
block's parameters, under the same names and TP layouts: the norm weights stay in the block's
`attention_norm` / `ffn_norm` and are handed to TE's module at each forward, so initialization,
checkpoints, HF import/export and every FSDP layout treat both blocks alike.

The flat-parameter FSDP owns the weights: TE reads the views FSDP installs, and with
`fuse_wgrad_accumulation` TE writes each weight gradient into the weight's `main_grad`, which FSDP
binds to the unit's fp32 accumulator (`wgrad_into_main_grad`), so the once-per-step reduction holds.
The scheduler's `is_first_microbatch` reaches TE's forward (it caches the fp8 weight casts for the
step). Under sequence parallelism TE gathers and scatters along dim 0, so the block runs sequence-first
inside and transposes at its edges.

The blocks run inside TE's autocast (`TEBlocks.region`), with a DelayedScaling recipe from the same
`model.fp8_*` keys as the in-tree fp8 and the amax reduction group the in-tree fp8 uses. TE keeps its
fp8 scaling state (per linear: scale and amax history of each operand, forward and backward) outside
parameters and buffers; each block hands it to checkpoints as live tensors (`scaling_state`), so a
resume continues it bitwise. It is identical on every rank of the amax group, as the in-tree state is.
"""

from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
from torch import nn
from torch.distributed import ProcessGroup

from model.args import ModelArgs
from model.attention import AttentionCore, Documents, apply_rotary
from model.fp8 import Fp8Recipe
from model.transformer import RMSNorm
from parallel.context_parallel import CPContext
from parallel.tensor_parallel import TPContext, mark_tp_dim


def _te():
    import transformer_engine.pytorch as te

    return te


AUTOCAST_SINCE = (2, 9)  # TE 2.9 renamed fp8_autocast to autocast (the old name remains, deprecated)


def te_version() -> tuple[int, int]:
    """The installed TransformerEngine's (major, minor)."""
    import transformer_engine

    major, minor = (int("".join(c for c in part if c.isdigit()) or 0)
                    for part in (transformer_engine.__version__.split(".") + ["0"])[:2])
    return major, minor


def _autocast(enabled: bool, recipe: object | None, group: ProcessGroup | None) -> AbstractContextManager:
    """TE's autocast under the installed version's name: `autocast` from 2.9 on, `fp8_autocast` before."""
    te = _te()
    if te_version() >= AUTOCAST_SINCE:
        return te.autocast(enabled=enabled, recipe=recipe, amax_reduction_group=group)
    return te.fp8_autocast(enabled=enabled, fp8_recipe=recipe, fp8_group=group)


# TE's per-direction scaling state (a DelayedScaling recipe state).
_SCALING_KEYS = ("scaling_fwd", "scaling_bwd")
_SCALING_FIELDS = ("scale", "amax_history")


def scaling_state(module: nn.Module, fp8_region: Callable[[], AbstractContextManager]) -> dict[str, torch.Tensor]:
    """The fp8 scaling tensors of the TE linears in `module`, live, by name ("wo.scaling_fwd.scale").
    A linear that has not run in fp8 yet (a resume builds this before any step) first creates its state
    inside `fp8_region`, as its first fp8 forward would; TE then keeps it, so a checkpoint loads into it.
    That region runs without grad: TE updates scales at an fp8 region's exit only with grad enabled, and
    a save must not touch the state it saves."""
    te = _te()
    linears = [(name, m) for name, m in module.named_modules() if isinstance(m, (te.LayerNormLinear, te.Linear))]
    uninitialized = [m for _, m in linears if not all(key in m.fp8_meta for key in _SCALING_KEYS)]
    if uninitialized:
        with torch.no_grad(), fp8_region():
            for linear in uninitialized:
                linear.init_fp8_metadata(num_gemms=1)
    return {f"{name}.{key}.{field}": getattr(linear.fp8_meta[key], field)
            for name, linear in linears for key in _SCALING_KEYS for field in _SCALING_FIELDS}


def _linear_options(tp: TPContext) -> dict:
    # TE defers its own initialization only for device == "meta" as a string (a torch.device never
    # equals it): otherwise it would draw every weight on the GPU before FSDP shards it.
    device = "meta" if torch.empty(0).is_meta else torch.empty(0).device
    return dict(bias=False, tp_group=tp.group, tp_size=tp.size, sequence_parallel=tp.sequence_parallel,
                fuse_wgrad_accumulation=True, params_dtype=torch.float32, device=device)


def _owned_by_fsdp(linear: nn.Module, tp_dim: int, parts: tuple[int, ...] | None = None) -> nn.Module:
    """Mark a TE module's weight as the in-tree linear's would be, and as writing its own gradient."""
    mark_tp_dim(linear.weight, tp_dim, parts)
    linear.weight.wgrad_into_main_grad = True
    return linear


def norm_linear(args: ModelArgs, tp: TPContext, parts: tuple[int, ...]) -> nn.Module:
    """RMSNorm + column-parallel linear with fused outputs `parts`; the norm weight is the block's."""
    linear = _te().LayerNormLinear(args.dim, sum(parts), eps=args.norm_eps, normalization="RMSNorm",
                                   parallel_mode="column", **_linear_options(tp))
    del linear._parameters["layer_norm_weight"]  # the block's norm owns it, under the in-tree name
    return _owned_by_fsdp(linear, 0, parts if len(parts) > 1 else None)


def row_linear(in_features: int, out_features: int, tp: TPContext) -> nn.Module:
    return _owned_by_fsdp(_te().Linear(in_features, out_features, parallel_mode="row", **_linear_options(tp)), 1)


class _MicrobatchMarks(nn.Module):
    """Receives the scheduler's marks (FSDP's set_microbatch) for the TE modules it calls. With
    `cache_fp8_weights` TE gets is_first_microbatch and keeps each weight's fp8 cast for the step's other
    microbatches (and past the step: a whole TP-local copy per module); without it (ZeRO-3, where that
    copy would undo the sharding, as TE itself decides under FSDP2) it gets None and casts every time."""

    def __init__(self, cache_fp8_weights: bool):
        super().__init__()
        self.cache_fp8_weights = cache_fp8_weights
        self.is_first_microbatch: bool | None = None

    def set_microbatch(self, is_first: bool | None, is_last: bool) -> None:
        self.is_first_microbatch = is_first if self.cache_fp8_weights else None


def _give_norm_weight(linear: nn.Module, weight: torch.Tensor) -> None:
    # Into the instance dict, never registered: the block's norm owns the parameter.
    linear.__dict__["layer_norm_weight"] = weight


class TEAttention(_MicrobatchMarks):
    def __init__(self, args: ModelArgs, tp: TPContext, cp: CPContext, cache_fp8_weights: bool):
        super().__init__(cache_fp8_weights)
        self.head_dim = args.head_dim
        self.core = AttentionCore(args.efficient_attn, cp)
        kv = args.n_kv_heads * args.head_dim
        parts = (args.n_heads * args.head_dim, kv, kv)
        self.local_sizes = [tp.local_size(p, "out_features") for p in parts]
        self.wqkv = norm_linear(args, tp, parts)
        self.wo = row_linear(args.n_heads * args.head_dim, args.dim, tp)

    def forward(self, x: torch.Tensor, norm_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                seq_first: bool, documents: Documents | None = None) -> torch.Tensor:
        _give_norm_weight(self.wqkv, norm_weight)
        qkv = self.wqkv(x, is_first_microbatch=self.is_first_microbatch)
        if seq_first:
            qkv = qkv.transpose(0, 1)
        bsz, seq, _ = qkv.shape
        q, k, v = (t.reshape(bsz, seq, -1, self.head_dim).transpose(1, 2) for t in qkv.split(self.local_sizes, -1))
        out = self.core(apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v, documents).transpose(1, 2)
        out = out.transpose(0, 1) if seq_first else out
        return self.wo(out.reshape(*out.shape[:2], -1).contiguous(), is_first_microbatch=self.is_first_microbatch)


class TEFeedForward(_MicrobatchMarks):
    def __init__(self, args: ModelArgs, tp: TPContext, cache_fp8_weights: bool):
        super().__init__(cache_fp8_weights)
        hidden = args.ffn_hidden_dim
        self.local_sizes = [tp.local_size(hidden, "ffn hidden size")] * 2
        self.w13 = norm_linear(args, tp, (hidden, hidden))  # gate, up
        self.w2 = row_linear(hidden, args.dim, tp)

    def forward(self, x: torch.Tensor, norm_weight: torch.Tensor) -> torch.Tensor:
        _give_norm_weight(self.w13, norm_weight)
        gate, up = self.w13(x, is_first_microbatch=self.is_first_microbatch).split(self.local_sizes, -1)
        return self.w2(nn.functional.silu(gate) * up, is_first_microbatch=self.is_first_microbatch)


class TETransformerBlock(nn.Module):
    """The pre-norm block with TE modules; same parameters, names and layouts as TransformerBlock.
    `fp8_region` (fp8 runs only): an autocast region with fp8 on, in which TE creates scaling state."""

    def __init__(self, layer_id: int, args: ModelArgs, tp: TPContext, cp: CPContext | None = None,
                 cache_fp8_weights: bool = True, fp8_region: Callable[[], AbstractContextManager] | None = None):
        super().__init__()
        self.layer_id, self.sequence_parallel, self.fp8_region = layer_id, tp.sequence_parallel, fp8_region
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)  # weight only: TE's module normalizes
        self.attention = TEAttention(args, tp, cp or CPContext(), cache_fp8_weights)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = TEFeedForward(args, tp, cache_fp8_weights)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                documents: Documents | None = None) -> torch.Tensor:
        seq_first = self.sequence_parallel
        h = x.transpose(0, 1).contiguous() if seq_first else x
        h = h + self.attention(h, self.attention_norm.weight, cos, sin, seq_first, documents)
        h = h + self.feed_forward(h, self.ffn_norm.weight)
        return h.transpose(0, 1).contiguous() if seq_first else h

    def scaling_state(self) -> dict[str, torch.Tensor]:
        """TE's fp8 scaling state of this block, for checkpoints ({} without fp8)."""
        return {} if self.fp8_region is None else scaling_state(self, self.fp8_region)


def delayed_scaling(recipe: Fp8Recipe) -> object:
    """TE's DelayedScaling from the in-tree recipe's settings."""
    from transformer_engine.common.recipe import DelayedScaling, Format

    return DelayedScaling(margin=recipe.margin, fp8_format=Format.HYBRID if recipe.format == "hybrid" else Format.E4M3,
                          amax_history_len=recipe.amax_history_len, amax_compute_algo=recipe.amax_compute_algo)


class TEBlocks:
    """Builds the TE blocks of a model (Transformer's `blocks`) and the region they run in: TE's
    autocast, fp8 with the recipe when model.use_fp8, amaxes reduced over `amax_group`.

    Forwards without grad (evaluation) run with fp8 off: TE's amax history has no way to forget what
    a forward recorded, and an evaluation must leave no trace in training."""

    def __init__(self, args: ModelArgs, amax_group: ProcessGroup | None, cache_fp8_weights: bool = True):
        self.args, self.amax_group, self.cache_fp8_weights = args, amax_group, cache_fp8_weights
        recipe = args.fp8_recipe()
        self.recipe = delayed_scaling(recipe) if recipe is not None else None

    def __call__(self, layer_id: int, args: ModelArgs, tp: TPContext, cp: CPContext) -> TETransformerBlock:
        fp8_region = self.fp8_region if self.recipe is not None else None
        return TETransformerBlock(layer_id, args, tp, cp, self.cache_fp8_weights, fp8_region)

    def region(self) -> AbstractContextManager:
        return _autocast(self.recipe is not None and torch.is_grad_enabled(), self.recipe, self.amax_group)

    def fp8_region(self) -> AbstractContextManager:
        return _autocast(True, self.recipe, self.amax_group)
