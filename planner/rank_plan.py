"""The plan of one layout: per pipeline stage (every rank of a stage holds the same shapes) its parameters,
its peak memory by category, the same at the peak of what the CPU snapshot measures, and the pipeline
program's simulated bubble.

Categories: what mem_snapshot_stop_step measures (memory.py; the unsharded gradients of the reductions
in flight, in reduce_dtype, among them), plus the buffers it does not see:
  p2p_buffers         a pipeline rank's tensors in transit: two outgoing (a send is waited at the next
                      batch) and a batch's receives (the program's widest; posted a batch ahead on CPU)
  fp8_state           the fp8 GEMMs' amax histories and scales (buffers of the blocks, from the meta model),
                      and each GEMM's fp8 weight cast, made on a step's first microbatch and kept for the
                      others (model/fp8.py; none with fp8_all_gather, whose gathered fp8 weight is used)
  deferred_weight_grads  zero-bubble programs: the operands of the Bs whose W has not run (memory.py)
  loss_buffers        the loss's scratch at its peak, on the rank holding the head (memory.py)
  parameter_gradients a unit's compute-dtype parameter gradients, which autograd holds until it hands
                      them to the unit's accumulator at the end of the unit's backward (memory.py)
  exchange_buffers    TP's gathered sequence (SP) and CP's gathered (or in-flight ring) keys and values
  recompute           activation checkpointing's recomputed block (full) or attention core (selective)
"""

import dataclasses
from dataclasses import dataclass
from functools import lru_cache

import torch

from model.fp8 import Fp8Gemm
from model.transformer import TransformerBlock
from parallel.fsdp.flat_param import aliases_shard
from parallel.mesh import ParallelDims
from parallel.pipeline.schedule import (RECV_B, RECV_F, batched, effective_schedule, pipeline_actions,
                                      splits_backward)
from parallel.pipeline.simulate import Timeline, simulate, uniform_costs
from parallel.tensor_parallel import TPContext
from planner.activations import ActivationKey, ChunkActivations, chunk_activations
from planner.deferred_grads import DeferredOperands, chunk_deferred
from planner.memory import ShardingPlan, UnitPlan, compute_steps, peak_memory
from planner.units import rank_chunks, unit_sizes
from trainer.config.schema import ModelConfig, TrainConfig
from trainer.config.vocab import planned_vocabulary
from trainer.parallelize import DTYPES


@dataclass(frozen=True)
class StagePlan:
    pp_rank: int
    ranks: tuple[int, int]  # first and last global rank of the stage
    parameters: int  # TP-local parameters of this rank
    memory: dict[str, int]  # bytes at the peak by category, and "peak_bytes" (their sum)
    snapshot: dict[str, int]  # at the peak of what mem_snapshot_stop_step measures, in its categories


def compute_dtype(cfg: TrainConfig) -> torch.dtype:
    """As the run resolves it: bf16 on CUDA, fp32 on CPU unless compute_dtype says."""
    return DTYPES[cfg.compute_dtype or ("bf16" if torch.cuda.is_available() else "fp32")]


def activation_key(cfg: TrainConfig, dtype: torch.dtype, layer_ckpt: str | None = None) -> ActivationKey:
    model = cfg.model if layer_ckpt is None else dataclasses.replace(cfg.model, layer_ckpt=layer_ckpt)
    return ActivationKey(model, cfg.model_parallel_size, cfg.context_parallel_size, cfg.model.sequence_parallel,
                         cfg.context_parallel_comm, cfg.seq_len, dtype)


@lru_cache(maxsize=64)
def fp8_state_bytes(model: ModelConfig, tp: int) -> int:
    """One block's fp8 scaling buffers, as the block registers them, and its fp8 GEMMs' weight casts (one
    element of the recipe's forward dtype per TP-local weight element)."""
    if not model.use_fp8:
        return 0
    with torch.device("meta"):
        block = TransformerBlock(0, model, TPContext(size=tp, rank=0))
    buffers = sum(b.numel() * b.element_size() for b in block.buffers())
    if model.fp8_all_gather:
        return buffers
    casts = sum(m.weight.numel() * m.gemm.recipe.forward_dtype.itemsize for m in block.modules()
                if isinstance(getattr(m, "gemm", None), Fp8Gemm))
    return buffers + casts


@lru_cache(maxsize=256)
def _rank_program(schedule: str, pp: int, vpp: int, microbatches: int, pp_rank: int) -> tuple[tuple, int]:
    """A rank's compute steps (memory.py) and the most receives one of its batches holds: a long step's
    program is walked once, not once per variant of a layout."""
    program = pipeline_actions(schedule, pp, vpp, microbatches)[pp_rank]
    receives = max((sum(a.op in (RECV_F, RECV_B) for a in step) for step in batched(program)), default=0)
    return compute_steps(program), receives


def _transient(cfg: TrainConfig, dtype: torch.dtype, acts: ChunkActivations, batch_receives: int) -> dict[str, int]:
    m, tp, cp, mb = cfg.model, cfg.model_parallel_size, cfg.context_parallel_size, cfg.microbatch_size
    size = dtype.itemsize
    local_seq = cfg.seq_len // cp
    hop = mb * (local_seq // tp if m.sequence_parallel and tp > 1 else local_seq) * m.dim * size
    kv = 2 * mb * (m.n_kv_heads // tp) * m.head_dim * size
    exchange = (mb * local_seq * m.dim * size if m.sequence_parallel and tp > 1 else 0)
    if cp > 1:
        exchange += kv * (cfg.seq_len if cfg.context_parallel_comm == "all_gather" else 2 * local_seq)
    recompute = 0
    if m.layer_ckpt != "none":
        recompute = chunk_activations(activation_key(cfg, dtype, "none"), mb).block - acts.block
    return {"p2p_buffers": (2 + batch_receives) * hop if cfg.pipeline_parallel_size > 1 else 0,
            "exchange_buffers": exchange, "recompute": recompute}


def stage_plan(cfg: TrainConfig, dims: ParallelDims, pp_rank: int) -> StagePlan:
    cfg = planned_vocabulary(cfg)
    dtype = compute_dtype(cfg)
    acts = chunk_activations(activation_key(cfg, dtype), cfg.microbatch_size)
    held = (chunk_deferred(activation_key(cfg, dtype), cfg.microbatch_size) if splits_backward(cfg.pipeline_schedule)
            else DeferredOperands(0, 0))
    together = cfg.pipeline_parallel_size * cfg.virtual_pipeline_stages == 1 and cfg.model.tie_embeddings
    sizes = unit_sizes(cfg.model, dims.tp, together)
    units = []
    for chunk in rank_chunks(cfg, pp_rank):
        activation = [acts.embedding] * chunk.embedding + [acts.block] * chunk.blocks + [acts.head] * chunk.head
        activation[0] += acts.chunk
        deferred = [0] * chunk.embedding + [held.block] * chunk.blocks + [held.head] * chunk.head
        units.append([UnitPlan(n, a, deferred=d) for n, a, d in zip(chunk.unit_numels(sizes), activation, deferred)])
        if chunk.head:  # the loss runs after the head's forward and before its backward
            units[-1][-1] = dataclasses.replace(units[-1][-1], outside=acts.loss, outside_forward=acts.loss_forward,
                                                outside_backward=acts.loss_backward)
    # A reduction's collectives: SP's norm-gradient all-reduce over TP, the reduce-scatter, HSDP's all-reduce.
    before_last = int(cfg.model.sequence_parallel and dims.tp > 1) + int(dims.dp_shard * dims.cp > 1)
    world = dims.dp_shard * dims.cp
    plan = ShardingPlan(world, dtype.itemsize, cfg.reshard_after_forward, cfg.grad_reduce == "per_microbatch",
                        before_last + int(dims.dp_replicate > 1), before_last,
                        aliases_shard=aliases_shard(world, dtype, cfg.model.fp8_all_gather),
                        fuses=cfg.gradient_accumulation_fusion and dtype == torch.float32,
                        cuts_views=cfg.optimize_backward_concat and cfg.grad_reduce == "last_microbatch",
                        reduce_bytes=DTYPES[cfg.reduce_dtype].itemsize)
    steps, batch_receives = _rank_program(cfg.pipeline_schedule, dims.pp, cfg.virtual_pipeline_stages,
                                          cfg.num_microbatches, pp_rank)
    measured, snapshot = peak_memory(steps, units, plan)
    blocks = sum(c.blocks for c in rank_chunks(cfg, pp_rank))
    memory = {key: value for key, value in measured.items() if key != "total"}
    memory.update(_transient(cfg, dtype, acts, batch_receives),
                  fp8_state=blocks * fp8_state_bytes(cfg.model, dims.tp))
    memory["peak_bytes"] = sum(memory.values())
    per_stage = dims.world_size // dims.pp
    return StagePlan(pp_rank, (pp_rank * per_stage, (pp_rank + 1) * per_stage - 1),
                     sum(u.numel for chunk in units for u in chunk), memory, snapshot)


def pipeline_timeline(cfg: TrainConfig) -> Timeline:
    """The step's programs on the simulator at uniform costs (backward twice a forward)."""
    pp, vpp = cfg.pipeline_parallel_size, cfg.virtual_pipeline_stages
    programs = pipeline_actions(cfg.pipeline_schedule, pp, vpp, cfg.num_microbatches)
    return simulate(programs, pp, vpp, uniform_costs(), sends_block=False, v_shape=cfg.pipeline_v_shape)


def schedule_name(cfg: TrainConfig) -> str:
    return effective_schedule(cfg.pipeline_schedule, cfg.virtual_pipeline_stages)
