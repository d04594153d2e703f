"""One FSDP unit: a module whose parameters live in one sharded fp32 flat parameter.

An explicit state machine with small named transitions:

    SHARDED --start_unshard--> GATHERING --wait_unshard--> UNSHARDED --reshard--> SHARDED

While SHARDED only the fp32 shard (`flat_param`, what the optimizer sees) exists. Unsharding casts
the shard to the compute dtype and all-gathers it into `_buffer`; the module's parameters become
views of `_full`, an autograd leaf over that buffer, made by one autograd function whose backward
writes all of their gradients into the unit's fp32 flat gradient (the concat). Resharding frees the
buffer's storage; saved views keep aliasing it, so re-gathering before backward makes them valid again.
While SHARDED the module's parameter attributes are meta tensors of the parameters' shapes: a view of
the freed buffer read from outside (a user's probe of `layer.wq.weight`) would read freed memory.
"""

import weakref
from dataclasses import dataclass
from enum import Enum, auto
from functools import partial
from typing import Protocol, runtime_checkable

import torch
from torch import nn
from torch.distributed import ProcessGroup

from parallel import comm, weight_grads
from parallel.fsdp.flat_param import (
    FlatParamSpec, aliases_shard, allocate_storage, flatten, free_storage, shard_of, split_views, trainable_owners,
)
from parallel.fsdp.fp8_gather import Fp8Gather, fp8_params_of, shard_pieces
from parallel.fsdp.grad_sync import (ParamGradSink, accumulate_param_grad, refuse_late_gradient, write_flat_grad,
                                     zeroed_slice)
from parallel.fsdp.hooks import BackwardTicket
from parallel.fsdp.state_dict import TPSplit, fill_shard
from parallel.fsdp.tied import TiedCopy


class Initializer(Protocol):
    """Initial values for a model built on the meta device, by full parameter / buffer name."""

    device: torch.device

    def parameter_box(self, name: str, full_shape: tuple[int, ...], offsets: tuple[int, ...],
                      sizes: tuple[int, ...]) -> torch.Tensor:
        """The box [offsets, offsets + sizes) of the full (TP-merged) parameter's initial value."""

    def buffer(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """A buffer's initial value (e.g. fp8 scaling state)."""


class UnitState(Enum):
    SHARDED = auto()
    GATHERING = auto()
    UNSHARDED = auto()


@dataclass(frozen=True)
class TPGroups:
    """What FSDP needs of tensor parallelism: the group, and whether replicated parameters see only a
    sequence slice (SP), so their gradients are partial sums over TP."""

    group: ProcessGroup | None = None
    sequence_parallel: bool = False

    @property
    def size(self) -> int:
        return comm.size_of(self.group)

    @property
    def rank(self) -> int:
        return comm.rank_in(self.group)


@dataclass(frozen=True)
class FSDPConfig:
    compute_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype = torch.float32
    reshard_after_forward: bool = True
    optimize_backward_concat: bool = False
    fp8_all_gather: bool = False  # gather the weights of fp8 GEMMs as fp8 (see fp8_gather.py)
    gradient_accumulation_fusion: bool = False  # linears' weight-gradient GEMMs run into the accumulator
    grad_reduce: str = "last_microbatch"  # or "per_microbatch" (see grad_sync.py)
    reductions_in_flight: int = 2  # gradient reductions overlapping the backward; 0: synchronous


@runtime_checkable
class MicrobatchAware(Protocol):
    """A submodule that wants the scheduler's marks, e.g. to cache an fp8 weight cast for the step;
    is_first=None means unmarked (outside a scheduled step): nothing may be reused."""

    def set_microbatch(self, is_first: bool | None, is_last: bool) -> None: ...


class FSDPUnit:
    def __init__(
        self, name: str, module: nn.Module, shard_group: ProcessGroup, replicate_group: ProcessGroup | None,
        cfg: FSDPConfig, tp: TPGroups | None = None, init: Initializer | None = None, tied: TiedCopy | None = None,
    ):
        """`name` is the module's path in the model. A module built on the meta device gets its values from
        `init`: each rank builds only its own shard, asking for the boxes of the full parameters it holds.
        `tied`: a copy of a tied weight among the module's parameters (tied.py)."""
        self.name, self.module, self.cfg, self.tied = name, module, cfg, tied
        self.shard_group, self.replicate_group = shard_group, replicate_group
        self.tp = tp or TPGroups()
        self.rank = shard_group.rank()
        first, min_numel = (tied.param.removeprefix(f"{name}."), tied.unit_numel) if tied else (None, 0)
        self.spec = FlatParamSpec.of_module(module, shard_group.size(), first, min_numel)
        self.param_offsets = self.spec.offsets()
        owners = trainable_owners(name, module, self.spec)
        params = [getattr(sub, attr) for sub, attr in owners]
        # How each parameter is split over TP (checkpoints map shards to full parameters with it), and
        # the flat slices of those that are not split (norm weights).
        self.tp_splits = tuple(TPSplit(getattr(p, "tp_dim", None), getattr(p, "tp_parts", None)) for p in params)
        self.tp_replicated = [
            (offset, p.numel()) for offset, p, split in zip(self.param_offsets, params, self.tp_splits)
            if split.dim is None
        ]
        # Parameters whose module writes their weight gradient into `main_grad` itself instead of returning
        # it (TransformerEngine's fused accumulation): their main_grad is their slice of the accumulator.
        self.main_grad_params = _main_grad_params(name, params, self.spec, cfg)
        self._main_grad_views: list[torch.Tensor] = []  # bound since the accumulator was last handed over
        self.flat_param = nn.Parameter(self._initial_shard(init) if init is not None
                                       else shard_of(flatten(params, self.spec), self.spec, self.rank))
        for sub, attr in owners:
            del sub._parameters[attr]
        module.register_parameter("flat_param", self.flat_param)
        _materialize_buffers(name, module, init)
        self._owners = owners
        self._views: list[torch.Tensor] = []  # the latest forward's parameter views, shown while unsharded
        self._show_placeholders()
        self.norm_mask = self._norm_mask()  # fixed by the layout: built once, read every step
        device = self.flat_param.device
        fp8_params = fp8_params_of(self.spec, owners)
        self.aliases_shard = aliases_shard(self.spec.world, cfg.compute_dtype, cfg.fp8_all_gather)
        if self.aliases_shard:
            self._buffer = self.flat_param.detach()
        else:
            self._buffer = torch.empty(self.spec.padded, dtype=cfg.compute_dtype, device=device)
            free_storage(self._buffer)
        self._full = torch.empty(0, dtype=cfg.compute_dtype, device=device).requires_grad_()
        self._full.data = self._buffer  # shares storage, not the version counter: re-gathers stay legal
        self._fp8_weight_pieces = shard_pieces(fp8_params, self.rank, self.spec.shard_size)
        self._fp8 = Fp8Gather(self.spec, self.rank, shard_group, cfg.compute_dtype, fp8_params, name, device) \
            if fp8_params and cfg.fp8_all_gather else None
        self._microbatch_aware = [m for m in module.modules() if isinstance(m, MicrobatchAware)]
        self.state = UnitState.SHARDED
        self._gather: list[tuple[comm.Pending, torch.Tensor]] = []  # in flight, with the inputs kept alive
        self._gathered_version = -1  # the shard's version counter when it was last gathered
        self.is_last_microbatch = True
        self.grad_accumulator: torch.Tensor | None = None  # fp32, unsharded, across microbatches
        self.unwritten: set[int] = set()  # parameters whose accumulator slice is not written yet (grad_sync.py)
        self.gradients_pending = 0  # forwards with grad whose backward has not finished
        self.ticket: BackwardTicket | None = None  # the latest forward's (see hooks.py)
        self.shard_grad_sum: torch.Tensor | None = None  # grad_reduce=per_microbatch: fp32, shard-sized
        # Linears' GEMMs run into the accumulator only where their operands are its fp32: with bf16 the key is
        # a no-op, bitwise (a weight read twice, the tied embedding, sums its two gradients in bf16 first).
        self._fuses = cfg.gradient_accumulation_fusion and cfg.compute_dtype == torch.float32

    def _initial_shard(self, init: Initializer) -> torch.Tensor:
        shard = torch.zeros(self.spec.shard_size, device=init.device)
        return fill_shard(shard, self.spec, self.rank, self.tp_splits, self.tp.rank, self.tp.size,
                          lambda param, *box: init.parameter_box(f"{self.name}.{param}", *box))

    @property
    def full(self) -> torch.Tensor:
        return self._full

    def _norm_mask(self) -> torch.Tensor | None:
        """Which of this rank's shard elements count toward norms: TP-replicated parameters on TP rank 0 only,
        and a tied copy nowhere (the copy named as its weight counts). None means all of them."""
        skipped = self.tp_replicated if self.tp.rank else []
        if self.tied is not None and not self.tied.counted:
            skipped = [*skipped, (0, self.spec.numels[0])]  # the copy is first in the flat parameter
        if not skipped:
            return None
        mask = torch.ones(self.spec.padded, device=self.flat_param.device)
        for offset, numel in skipped:
            mask[offset : offset + numel] = 0.0
        size = self.spec.shard_size
        return mask[self.rank * size : (self.rank + 1) * size]

    @property
    def reduces_now(self) -> bool:
        """Whether this microbatch's gradient is reduced (rather than accumulated unsharded)."""
        return self.is_last_microbatch or self.cfg.grad_reduce == "per_microbatch"

    def set_microbatch(self, is_first: bool | None, is_last: bool) -> None:
        """The scheduler's marks, for this unit and the submodules that want them."""
        self.is_last_microbatch = is_last
        for module in self._microbatch_aware:
            module.set_microbatch(is_first, is_last)

    # --- state transitions -------------------------------------------------------------------
    def start_unshard(self) -> None:
        if self.state is not UnitState.SHARDED and self._gathered_version != self.flat_param._version:
            # The shard changed in place since it was gathered (an optimizer step or a load while a
            # ZeRO-2 unit stayed unsharded): the gathered weights are stale, gather them again.
            self.reshard()
        if self.state is not UnitState.SHARDED:
            return
        self._gathered_version = self.flat_param._version
        if not self.aliases_shard:  # otherwise the buffer is the shard: nothing to gather
            self._gather = self._start_gather()
        self.state = UnitState.GATHERING

    def _start_gather(self) -> list[tuple[comm.Pending, torch.Tensor]]:
        allocate_storage(self._buffer)
        if self._fp8 is not None:
            return self._fp8.start(self.flat_param.detach())
        if self.spec.world == 1:
            self._buffer.copy_(self.flat_param.detach())
            return []
        shard = self.flat_param.detach().to(self.cfg.compute_dtype)
        work = comm.all_gather_into_tensor(self._buffer, shard, self.shard_group, async_op=True, label=self.name)
        return [(work, shard)]

    def wait_unshard(self) -> None:
        if self.state is UnitState.GATHERING:
            for work, _ in self._gather:
                comm.wait(work, "all_gather", self.shard_group, self.name)
            self._gather = []
            if self._fp8 is not None:
                self._fp8.finish(self._buffer)
            self.state = UnitState.UNSHARDED
            self._show_views()  # valid again: a recompute in backward reads them from the module

    def unshard(self) -> None:
        self.start_unshard()
        self.wait_unshard()

    def reshard(self) -> None:
        self.wait_unshard()
        if self.state is UnitState.UNSHARDED:
            if not self.aliases_shard:
                free_storage(self._buffer)
            if self._fp8 is not None:
                self._fp8.free()
            self.state = UnitState.SHARDED
            self._show_placeholders()

    # --- memory accounting -------------------------------------------------------------------
    def _parameter_tensors(self) -> list[torch.Tensor]:
        """What holds this unit's parameters: the shard, the unsharded buffer, the fp8 gather."""
        held = [self.flat_param] if self.aliases_shard else [self.flat_param, self._buffer]
        return held + ([self._fp8.bytes] if self._fp8 is not None else [])

    def parameter_storages(self) -> list[int]:
        """The storages that hold this unit's parameters (shard, unsharded buffer, fp8 gather)."""
        return [t.untyped_storage().data_ptr() for t in self._parameter_tensors()]

    def memory_bytes(self) -> dict[str, int]:
        """Bytes the unit holds right now: parameters (shard + whatever is unsharded) and gradients."""
        held = self._parameter_tensors()
        grads = [t for t in (self.grad_accumulator, self.shard_grad_sum, self.flat_param.grad) if t is not None]
        return {"parameters": sum(t.untyped_storage().nbytes() for t in held),
                "gradients": sum(t.untyped_storage().nbytes() for t in grads)}

    # --- parameter views ---------------------------------------------------------------------
    def install_views(self) -> None:
        """Point the module's parameters at views of the unsharded flat parameter.

        Connected views have their gradients written into the unit's fp32 flat gradient accumulator by
        one backward (_FlatParamSplitWithSizes). With optimize_backward_concat that happens once per step, on the
        last microbatch, whose flat gradient is then reduced; on the earlier microbatches the views are
        cut from the flat parameter and each view's gradient lands in its own leaf, where a hook adds it
        in place into the accumulator, with no concat. Without the option, or when every microbatch
        reduces its own gradient (grad_reduce=per_microbatch), the views are connected on every microbatch.
        """
        cut = self.cfg.optimize_backward_concat and self.cfg.grad_reduce == "last_microbatch"
        if self.is_last_microbatch or not cut:
            views = list(_FlatParamSplitWithSizes.apply(self, self._full))
        else:
            views = _cut_views(self)
        for index, view in enumerate(views):
            weight_grads.set_sink(view, ParamGradSink(self, index, self._fuses, self.ticket))
        self._views = views
        self._show_views()
        # A view made under no_grad still says requires_grad=True but has no grad_fn: its gradient
        # would vanish without an error. Every view must have a grad_fn when grad is enabled.
        if torch.is_grad_enabled() and not self.views_have_autograd_edges():
            raise RuntimeError(f"FSDP unit {self.name}: parameter views lost their autograd edge")
        if self.main_grad_params and torch.is_grad_enabled():
            self._bind_main_grads(views)

    def _show_views(self) -> None:
        for (sub, attr), view in zip(self._owners, self._views):
            setattr(sub, attr, view)

    def _show_placeholders(self) -> None:
        """Shapes without values: reading one is a meta-device error, not a read of freed memory."""
        for (sub, attr), shape in zip(self._owners, self.spec.shapes):
            setattr(sub, attr, torch.empty(shape, dtype=self.cfg.compute_dtype, device="meta"))

    def _bind_main_grads(self, views: list[torch.Tensor]) -> None:
        """Give the views of main_grad parameters their slices of the fp32 accumulator, which therefore
        exists from the forward on (zeros until gradients land; TE may read main_grad at forward). It is
        handed to the reduction at the end of the step's last backward, after every write into it."""
        for i in self.main_grad_params:
            views[i].main_grad = zeroed_slice(self, i).view(self.spec.shapes[i])
            self._main_grad_views.append(views[i])

    def receive_view_grads(self, grads: tuple[torch.Tensor | None, ...], ticket: BackwardTicket) -> None:
        """A connected backward's parameter gradients (None: the parameter got none) are ready; `ticket`
        is the forward's whose views they are (a pipeline may have run later forwards since). Backwards
        run in forward order, so the latest forward's backward cannot have ended before these arrive
        either, unless the unit ran twice in one forward."""
        refuse_late_gradient(self, ticket)  # never reduce a gradient without it
        write_flat_grad(self, grads)

    def record_fp8_weight_amaxes(self) -> None:
        """Each fp8 GEMM whose weight lives here records the amax of its piece of this rank's shard."""
        for start, end, consumer in self._fp8_weight_pieces:
            consumer.record_weight_amax(self.flat_param.detach()[start:end])

    def views_have_autograd_edges(self) -> bool:
        """Whether the installed parameter views lead back to the flat parameter in autograd."""
        return all(getattr(sub, attr).grad_fn is not None for sub, attr in self._owners)

    def release_main_grads(self) -> None:
        """The accumulator went to its reduction: views no longer point into it, so it is freed once
        reduced instead of living on (in the installed views) until the unit's next forward."""
        for view in self._main_grad_views:
            del view.main_grad
        self._main_grad_views = []


def _main_grad_params(name: str, params: list[nn.Parameter], spec: FlatParamSpec, cfg: FSDPConfig) -> list[int]:
    """Indices of the parameters whose module writes the weight gradient into `main_grad` itself."""
    indices = [i for i, p in enumerate(params) if getattr(p, "wgrad_into_main_grad", False)]
    if indices and cfg.grad_reduce != "last_microbatch":
        raise ValueError(
            f"FSDP unit {name}: {name}.{spec.names[indices[0]]} accumulates its weight gradient into main_grad, "
            f"which needs grad_reduce=last_microbatch (with grad_reduce=per_microbatch a later microbatch's "
            f"forward could bind the accumulator an earlier one is reducing)")
    return indices


def _materialize_buffers(unit_name: str, module: nn.Module, init: Initializer | None) -> None:
    """Buffers (e.g. fp8 scaling state) of a module built on the meta device get their initial values."""
    for name, buf in list(module.named_buffers()):
        if buf.is_meta:
            if init is None:
                raise ValueError(f"buffer {unit_name}.{name} is on the meta device and nothing initializes it")
            owner, _, attr = name.rpartition(".")
            module.get_submodule(owner)._buffers[attr] = init.buffer(f"{unit_name}.{name}", buf)


class _FlatParamSplitWithSizes(torch.autograd.Function):
    """The parameter views of the unsharded flat parameter, connected to it in autograd: the engine
    collects every view's gradient and runs one backward, which hands them to the unit (the concat).
    The node holds the unit weakly: the installed views hold the node, the module holds the views, and
    a cycle through an autograd node is invisible to the garbage collector, so a strong reference would
    keep the unit, and its process groups, alive past their destruction."""

    @staticmethod
    def forward(ctx, unit: FSDPUnit, full: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.unit, ctx.ticket = weakref.ref(unit), unit.ticket
        ctx.set_materialize_grads(False)  # a parameter without a gradient stays None: no zeros to allocate
        return tuple(split_views(full, unit.spec))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None) -> tuple[None, None]:
        ctx.unit().receive_view_grads(grads, ctx.ticket)
        return None, None


CONCAT_EVENT = f"{_FlatParamSplitWithSizes.__name__}Backward"  # the concat's name in autograd profiles


def _cut_views(unit: FSDPUnit) -> list[torch.Tensor]:
    """Views cut from the flat parameter in autograd: the split runs under no_grad, each chunk is made
    a grad-requiring leaf, and the view() op runs outside no_grad so the view has a grad_fn (a view
    built entirely under no_grad would silently drop its gradient). Each chunk's gradient is added to
    the accumulator as it arrives; a chunk that gets none adds nothing. Only non-last microbatches, which
    never reduce, get these views. A view reaches its chunk's hook through autograd, where the garbage
    collector sees no cycle: the hook holds the unit weakly and nothing that holds the views."""
    with torch.no_grad():
        chunks = torch.split(unit.full[: unit.spec.total], unit.spec.numels)
    unit_ref = weakref.ref(unit)
    views = []
    for index, (chunk, shape) in enumerate(zip(chunks, unit.spec.shapes)):
        chunk.requires_grad_(True)
        chunk.register_post_accumulate_grad_hook(partial(_add_chunk_grad, unit_ref, index))
        views.append(chunk.view(shape))
    return views


def _add_chunk_grad(unit_ref: weakref.ref, index: int, chunk: torch.Tensor) -> None:
    if chunk.grad is None:  # its backward returned none: a main_grad parameter wrote it itself
        return
    accumulate_param_grad(unit_ref(), index, chunk.grad)
    chunk.grad = None
