"""The plan of one layout: per pipeline stage (every rank of a stage holds the same shapes) its parameters,
its peak memory by category, the same at the peak of what the CPU snapshot measures, and the pipeline
program's simulated bubble.

Categories: what mem_snapshot_stop_step measures (memory.py), plus the buffers it does not see:
  reducing_gradients  the unsharded fp32 gradients of the reductions in flight
  p2p_buffers         a pipeline rank's tensors in transit: two outgoing (a send is waited at the next
                      batch) and a batch's receives (the program's widest; posted a batch ahead on CPU)
  fp8_state           the fp8 GEMMs' amax histories and scales (buffers of the blocks, from the meta model)
  exchange_buffers    TP's gathered sequence (SP) and CP's gathered (or in-flight ring) keys and values
  recompute           activation checkpointing's recomputed block (full) or attention core (selective)
"""

import dataclasses
from dataclasses import dataclass
from functools import lru_cache

import torch

from model.transformer import TransformerBlock
from parallel.fsdp.flat_param import aliases_shard
from parallel.mesh import ParallelDims
from parallel.pipeline.schedule import RECV_B, RECV_F, Action, batched, effective_schedule, pipeline_actions
from parallel.pipeline.simulate import Timeline, simulate, uniform_costs
from parallel.tensor_parallel import TPContext
from planner.activations import ActivationKey, ChunkActivations, chunk_activations
from planner.memory import ShardingPlan, UnitPlan, peak_memory
from planner.units import rank_chunks, unit_sizes
from trainer.config.schema import ModelConfig, TrainConfig
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
    """One block's fp8 scaling buffers, as the block registers them."""
    if not model.use_fp8:
        return 0
    with torch.device("meta"):
        block = TransformerBlock(0, model, TPContext(size=tp, rank=0))
    return sum(b.numel() * b.element_size() for b in block.buffers())


def _transient(cfg: TrainConfig, dtype: torch.dtype, acts: ChunkActivations, program: list[Action]) -> dict[str, int]:
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
    batch_receives = max((sum(a.op in (RECV_F, RECV_B) for a in step) for step in batched(program)), default=0)
    return {"p2p_buffers": (2 + batch_receives) * hop if cfg.pipeline_parallel_size > 1 else 0,
            "exchange_buffers": exchange, "recompute": recompute}


def stage_plan(cfg: TrainConfig, dims: ParallelDims, pp_rank: int) -> StagePlan:
    dtype = compute_dtype(cfg)
    acts = chunk_activations(activation_key(cfg, dtype), cfg.microbatch_size)
    together = cfg.pipeline_parallel_size * cfg.virtual_pipeline_stages == 1 and cfg.model.tie_embeddings
    sizes = unit_sizes(cfg.model, dims.tp, together)
    units = []
    for chunk in rank_chunks(cfg, pp_rank):
        activation = [acts.embedding] * chunk.embedding + [acts.block] * chunk.blocks + [acts.head] * chunk.head
        activation[0] += acts.chunk
        outside = [0] * (len(activation) - 1) + [acts.loss if chunk.head else 0]
        units.append([UnitPlan(*u) for u in zip(chunk.unit_numels(sizes), activation, outside)])
    # A reduction's collectives: SP's norm-gradient all-reduce over TP, the reduce-scatter, HSDP's all-reduce.
    before_last = int(cfg.model.sequence_parallel and dims.tp > 1) + int(dims.dp_shard * dims.cp > 1)
    world = dims.dp_shard * dims.cp
    plan = ShardingPlan(world, dtype.itemsize, cfg.reshard_after_forward, cfg.grad_reduce == "per_microbatch",
                        before_last + int(dims.dp_replicate > 1), before_last,
                        aliases_shard=aliases_shard(world, dtype, cfg.model.fp8_all_gather))
    program = pipeline_actions(cfg.pipeline_schedule, dims.pp, cfg.virtual_pipeline_stages, cfg.num_microbatches)
    measured, snapshot = peak_memory(list(program[pp_rank]), units, plan)
    blocks = sum(c.blocks for c in rank_chunks(cfg, pp_rank))
    memory = {key: value for key, value in measured.items() if key != "total"}
    memory.update(_transient(cfg, dtype, acts, list(program[pp_rank])),
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
