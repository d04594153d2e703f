"""Execute one rank's pipeline program for one optimizer step: compute, p2p, FSDP microbatch marks.

The runtime is the FSDP microbatch scheduler. From the program it knows, for each local model chunk,
which microbatch the chunk runs forward first and which it runs backward last; before every forward
and backward it tells that chunk's FSDP root `is_first_microbatch` / `is_last_microbatch`. So each
chunk reduces its gradients during its own last backward (chunks finish at different times under
interleaving), once per step, and nothing waits for the schedule's end to start reducing.

Tensors between stages have a fixed shape and dtype (no shape exchange): activations forward,
their gradients backward. Received activations become leaves that require grad; their `.grad` after
the chunk's backward is what goes upstream. A hand-over between two chunks of one rank (the last
stage of a round feeding the first of the next when pp = 1, or the V's turn under zbv) skips the network.

A program with W actions (zb_h1, zbv) splits each backward: B runs under parallel/weight_grads.py's
deferring, so the linears compute only input gradients and queue their weight-gradient GEMMs, and the
FSDP reductions of the microbatch that reduces queue behind them; W runs that queue. The marks stay
where they were; what moves is the reduction: into the chunk's last W, its last B's, so each unit
still concatenates and reduces once per step.

What a rank holds for p2p does not grow with the microbatch count: a stage output's data is freed as
soon as it is handed to its send (the autograd node stays for the backward, as Megatron's
deallocate_output_tensor), and a posted send is waited, and its tensor dropped, at the rank's next
communication batch. `peak_p2p_tensors` / `peak_p2p_bytes` count the most held at once in a step.

Receives and sends are posted in calls of their own, one per channel (see channels.py): on NCCL, where a
call is one work, no receive waits for a send, and a channel's works, which run in order on one stream,
only receive or only send. On the CPU (gloo) receives go out one batch ahead: each batch posts the next
batch's receives (buffers for one batch, whatever M), so a peer's send finds its receive posted. Not on
NCCL: a receive posted ahead may carry data that depends on this rank's own next send, and a device-wide
synchronization in between (the caching allocator frees memory with cudaFree when an allocation fails)
would wait for it forever.
"""

import time
from collections.abc import Callable
from contextlib import nullcontext

import torch
from torch import nn
from torch.autograd.variable import Variable
from torch.distributed import ProcessGroup, Work
from torch.profiler import record_function

from parallel import comm, weight_grads
from parallel.fsdp import FSDPRoot
from parallel.pipeline.channels import channel_count, split_batch
from parallel.pipeline.layers import rank_stages
from parallel.pipeline.schedule import (
    BACKWARD, FORWARD, RECV_B, RECV_F, WEIGHT, Action, batched, downstream, following_batches, forward_only,
    transfer_key,
)

Inputs = Callable[[int], torch.Tensor]  # microbatch -> the first stage's input (token ids)
Loss = Callable[[torch.Tensor, int], torch.Tensor]  # (last stage's output, microbatch) -> loss to backward
# microbatch -> keyword arguments every stage's chunk gets besides its input (e.g. document ids)
ChunkKwargs = Callable[[int], dict[str, torch.Tensor]]


def _no_kwargs(microbatch: int) -> dict[str, torch.Tensor]:
    return {}


class PlainChunkRoot:
    """The root of a chunk of plain modules, without FSDP units (a benchmark's, a test's): what the runtime
    tells a chunk's root is nothing to it."""

    def begin_step(self) -> None:
        pass

    def set_microbatch(self, is_first: bool | None, is_last: bool) -> None:
        pass

    def clear_microbatch(self) -> None:
        pass


class PipelineRuntime:
    def __init__(
        self, program: list[Action], pp: int, chunks: list[nn.Module], roots: list[FSDPRoot | PlainChunkRoot],
        group: ProcessGroup | None, activation_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
        channels: list[ProcessGroup] | None = None, v_shape: bool = False,
    ):
        """`chunks[c]` is local chunk c (stage c * pp + rank, or layers.stage_index's V under `v_shape`) and
        `roots[c]` its FSDP root. `channels`: the communicators over the pipeline ranks that transfers are
        spread over (channel_count of them); None: every transfer on `group`."""
        self.pp, self.chunks, self.roots, self.group = pp, chunks, roots, group
        self.channels = channels or [group]
        if device.type == "cuda" and pp > 1 and len(self.channels) != channel_count(pp, len(chunks)):
            # On one NCCL stream a batch's receive would queue behind its send, and the peer's likewise.
            raise ValueError(f"pipeline runtime on CUDA needs {channel_count(pp, len(chunks))} channels "
                             f"(channels.channel_count), got {len(self.channels)}")
        # Receives posted a batch ahead (gloo moves data only once its receive is posted); see above.
        self.receives_ahead = device.type == "cpu"
        self.rank, self.v_shape = program[0].rank, v_shape
        self.num_stages = pp * len(chunks)
        self.stages = rank_stages(pp, len(chunks), self.rank, v_shape)  # of each local chunk
        self.steps = batched(program)
        self.forward_steps = batched(forward_only(program))
        self.shape, self.dtype, self.device = activation_shape, dtype, device
        computes = [a for a in program if a.is_compute]
        # Per chunk: the microbatch it runs forward first and backward last (the FSDP marks).
        self.first_forward = {a.chunk: a.microbatch for a in reversed(computes) if a.op == FORWARD}
        self.last_backward = {a.chunk: a.microbatch for a in computes if a.op == BACKWARD}
        first_backward = {a.chunk: a.microbatch for a in reversed(computes) if a.op == BACKWARD}
        if first_backward != self.first_forward:
            # A module that overwrites its gradient on the first microbatch (TransformerEngine's fused
            # accumulation) would otherwise drop the gradients of backwards that ran before it.
            raise ValueError(f"pipeline program: each chunk's first backward must be of the microbatch it runs "
                             f"forward first ({first_backward} vs {self.first_forward})")
        self.splits_backward = any(a.op == WEIGHT for a in computes)
        last_weight = {a.chunk: a.microbatch for a in computes if a.op == WEIGHT}
        if self.splits_backward and last_weight != self.last_backward:
            # The last B defers the step's reduction into its W, which must come after every other W.
            raise ValueError(f"pipeline program: each chunk's last W must be of its last backward's microbatch "
                             f"({last_weight} vs {self.last_backward})")
        self._weight_work: dict[tuple[int, int], list[weight_grads.Work]] = {}  # (chunk, mb) -> B's deferred work
        self._inbox: dict[tuple, torch.Tensor] = {}  # received or handed over, by transfer key
        self._outbox: dict[tuple, torch.Tensor] = {}  # waiting for their SEND
        self._sending: list[tuple[Work, torch.Tensor, ProcessGroup]] = []  # posted sends, waited at the next batch
        self._receiving: dict[tuple, tuple[torch.Tensor, Work, ProcessGroup, str]] = {}  # posted receives, by key
        self._saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (chunk, mb) -> (input, output)
        # Set to a list to record (first action, wall-clock start, end) of every step: measured bubbles.
        self.trace: list[tuple[Action, float, float]] | None = None
        self.peak_p2p_tensors = self.peak_p2p_bytes = 0  # outgoing tensors held at once, this step

    def run_step(self, inputs: Inputs, loss: Loss, chunk_kwargs: ChunkKwargs = _no_kwargs) -> None:
        """Run every forward and backward of the step; gradients are left in the FSDP units."""
        for root in self.roots:
            root.begin_step()
        self._run(self.steps, inputs, loss, chunk_kwargs, keep_for_backward=True)

    def run_forward(self, inputs: Inputs, loss: Loss, chunk_kwargs: ChunkKwargs = _no_kwargs) -> None:
        """Forwards only (evaluation, under no_grad): the step's program without its backward half."""
        self._run(self.forward_steps, inputs, loss, chunk_kwargs, keep_for_backward=False)

    def _run(self, steps: list[list[Action]], inputs: Inputs, loss: Loss, chunk_kwargs: ChunkKwargs,
             keep_for_backward: bool) -> None:
        self.peak_p2p_tensors = self.peak_p2p_bytes = 0
        with weight_grads.deferring() if keep_for_backward and self.splits_backward else nullcontext():
            self._run_steps(steps, inputs, loss, chunk_kwargs, keep_for_backward)
        self._wait_sends()
        for root in self.roots:
            root.clear_microbatch()
        if self._saved or self._inbox or self._outbox or self._receiving or self._weight_work:
            raise RuntimeError(f"pipeline rank {self.rank}: the program left tensors behind (a schedule bug)")

    def _run_steps(self, steps: list[list[Action]], inputs: Inputs, loss: Loss, chunk_kwargs: ChunkKwargs,
                   keep_for_backward: bool) -> None:
        for step, following in zip(steps, following_batches(steps)):
            a, start = step[0], time.time()
            if self.num_stages > 1:
                comm.set_where("stage", f"pipeline {' '.join(map(str, step))}")
            if not a.is_compute:
                self._exchange(step, following)
            elif a.op == FORWARD:
                with record_function(str(a)):
                    self._forward(a, inputs, loss, chunk_kwargs, keep_for_backward)
            elif a.op == BACKWARD:
                with record_function(str(a)):
                    self._backward(a)
            else:
                with record_function(str(a)):
                    self._weight(a)
            if self.trace is not None:
                self.trace.append((a, start, time.time()))

    def _mark(self, a: Action) -> None:
        self.roots[a.chunk].set_microbatch(
            is_first=a.microbatch == self.first_forward[a.chunk], is_last=a.microbatch == self.last_backward[a.chunk]
        )

    def _forward(self, a: Action, inputs: Inputs, loss: Loss, chunk_kwargs: ChunkKwargs,
                 keep_for_backward: bool) -> None:
        self._mark(a)
        stage = self.stages[a.chunk]
        if stage == 0:
            x = inputs(a.microbatch)
        else:
            x = self._inbox.pop((FORWARD, stage, a.microbatch)).requires_grad_()
        y = self.chunks[a.chunk](x, **chunk_kwargs(a.microbatch))
        if stage == self.num_stages - 1:
            y = loss(y, a.microbatch)
        elif self._route(a, FORWARD, stage, y.detach()) and y._base is None:
            # The outgoing tensor keeps the data until its send is done; the backward needs only y's
            # autograd node (a view's data belongs to its base, which may still be in use).
            y.data = torch.empty(0, dtype=y.dtype, device=y.device)
        if keep_for_backward:
            self._saved[(a.chunk, a.microbatch)] = (x, y)

    def _backward(self, a: Action) -> None:
        self._mark(a)
        stage = self.stages[a.chunk]
        x, y = self._saved.pop((a.chunk, a.microbatch))
        if stage == self.num_stages - 1:
            torch.autograd.backward(y)
        else:
            # The engine itself: torch.autograd.backward compares the gradient's shape with y's data,
            # which may be freed (sent); the engine checks it against y's autograd metadata.
            grad = self._inbox.pop((BACKWARD, stage, a.microbatch))
            Variable._execution_engine.run_backward((y,), (grad,), False, False, (), True, True)
        if self.splits_backward:
            self._weight_work[(a.chunk, a.microbatch)] = weight_grads.take()
        if stage > 0:
            self._route(a, BACKWARD, stage, x.grad)

    @torch.no_grad()  # as in the backward the work was deferred from
    def _weight(self, a: Action) -> None:
        """W: the weight-gradient GEMMs its B deferred, and the FSDP reductions queued behind them."""
        for work in self._weight_work.pop((a.chunk, a.microbatch)):
            work()

    def _route(self, a: Action, op: str, stage: int, tensor: torch.Tensor) -> bool:
        """Hand an output to its consumer; True when it goes out through the network."""
        consumer = downstream(stage, op, self.num_stages)
        key = (op, consumer, a.microbatch)
        if consumer in self.stages:
            self._inbox[key] = tensor.contiguous()
            return False
        if tensor.shape != self.shape or tensor.dtype != self.dtype:
            # The peer receives into a buffer of the fixed shape and dtype: NCCL would hang or corrupt.
            raise RuntimeError(
                f"pipeline stage {stage} (rank {self.rank}, chunk {a.chunk}) microbatch {a.microbatch}: "
                f"{'activation' if op == FORWARD else 'input gradient'} to send is {tuple(tensor.shape)} "
                f"{tensor.dtype}, stage {consumer} receives {tuple(self.shape)} {self.dtype}"
            )
        self._outbox[key] = tensor.contiguous()
        self._count_held()
        return True

    def _count_held(self) -> None:
        """Outgoing tensors held: waiting for their SEND, or posted and not yet waited. Only a new
        outgoing tensor raises the count, so it is taken there."""
        held = list(self._outbox.values()) + [t for _, t, _ in self._sending]
        self.peak_p2p_tensors = max(self.peak_p2p_tensors, len(held))
        self.peak_p2p_bytes = max(self.peak_p2p_bytes, sum(t.numel() * t.element_size() for t in held))

    def _wait_sends(self) -> None:
        """Wait the posted sends and drop their tensors. Waited at the next batch (slot t), they cannot
        deadlock: their receives sit in the peers' batches of earlier slots, which every rank reaches
        without waiting for slot t (see schedule.py)."""
        for work, _, group in self._sending:
            comm.wait(work, "send", group)
        self._sending.clear()

    def _exchange(self, batch: list[Action], following: list[Action]) -> None:
        """Post the batch's sends and its receives (or, receiving ahead, the next batch's); wait for this
        batch's receives only. A receive posted ahead lets the peer's send go out as soon as it is posted
        (gloo moves the data once the receive is posted: posted at the wait, the round trip needs the
        sender's communication thread, which on a busy core waits for the scheduler). A send's tensor is
        never written again, so its wait is deferred to the next batch and the rank computes meanwhile.
        The order of posting on each channel, which is what must match, is the program's."""
        self._wait_sends()
        self._post(batch, receives=False)
        self._post(batch, receives=True)  # unless posted ahead
        if self.receives_ahead:
            self._post(following, receives=True)
        for a in batch:
            if a.op in (RECV_F, RECV_B):
                key = transfer_key(a, self.pp, self.num_stages, self.v_shape)
                tensor, work, group, label = self._receiving.pop(key)
                comm.wait(work, "recv", group, label)
                self._inbox[key] = tensor

    def _post(self, batch: list[Action], receives: bool) -> None:
        """Post a batch's receives or its sends, one call per channel; receives already posted are skipped."""
        for channel, actions in split_batch(batch, self.pp, len(self.chunks), len(self.channels)):
            group, ops, keys = self.channels[channel], [], []
            for a in actions:
                key = transfer_key(a, self.pp, self.num_stages, self.v_shape)
                if (a.op in (RECV_F, RECV_B)) != receives or key in self._receiving:
                    continue
                keys.append(key)
                if receives:
                    ops.append((False, torch.empty(self.shape, dtype=self.dtype, device=self.device), a.peer))
                else:
                    ops.append((True, self._outbox.pop(key), a.peer))
            if not ops:
                continue
            label = " ".join(str(a) for a in actions)  # e.g. "r1 SEND_F c0 m3 -> r2"
            for key, (_, tensor, _), work in zip(keys, ops, comm.batch_isend_irecv(ops, group, label)):
                if receives:
                    self._receiving[key] = (tensor, work, group, label)
                else:
                    self._sending.append((work, tensor, group))  # the tensor must outlive the send
