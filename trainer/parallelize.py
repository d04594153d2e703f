"""Apply the parallelisms: PP picks each rank's layers and TP shapes them as the model chunks are built;
then activation checkpointing and FSDP, one root per chunk; and the rank's pipeline program over them.

The units are the embedding, each transformer block and the output head a chunk holds, in forward
order. FSDP shards over dp_shard x cp and, with dp_replicate > 1, all-reduces over replicas (HSDP).
"""

import torch

from model.attention_kernels import check_attention_kernel
from model.init import ModelInitializer
from model.te import TEBlocks
from model.transformer import TIED_COPY, TIED_WEIGHT, BlockFactory, OutputHead, Transformer
from parallel.activation_checkpoint import checkpoint_forward
from parallel.context_parallel import CPContext
from parallel.context_parallel.lse import pair_kernel_problem
from parallel.errors import ConfigError
from parallel.fsdp import FSDPConfig, FSDPRoot, TiedCopy, TPGroups, fully_shard
from parallel.mesh import ParallelMesh
from parallel.pipeline.channels import channel_count
from parallel.pipeline.runtime import PipelineRuntime
from parallel.pipeline.layers import chunk_layers, rank_stages
from parallel.pipeline.schedule import schedule_actions
from parallel.regional_compile import compile_forward
from parallel.tensor_parallel import TPContext
from trainer.config.fp8_rules import check_fp8_device
from trainer.config.schema import TrainConfig

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def compute_dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype:
    name = cfg.compute_dtype or ("bf16" if device.type == "cuda" else "fp32")
    return DTYPES[name]


def check_device_kernels(cfg: TrainConfig, mesh: ParallelMesh, device: torch.device, dtype: torch.dtype) -> None:
    """What this device must have, one line before anything is built: fp8 GEMMs (model.use_fp8), and the
    attention kernel for the run's dtype and (per TP rank) head shapes: the pinned model.efficient_attn, or
    under CP the kernel its chunk pairs call themselves (kernels.py: flash's masked pairs run the
    memory-efficient kernel), as they alone run attention there."""
    check_fp8_device(cfg, device)
    m, cp, tp = cfg.model, mesh.dims.cp, mesh.dims.tp
    masked = m.attn_bias_type == "block_causal"
    if cp == 1:
        check_attention_kernel(m.efficient_attn, device, dtype, m.n_heads // tp, m.n_kv_heads // tp, m.head_dim,
                               masked)
        return
    problem = pair_kernel_problem(m.efficient_attn, device, dtype, m.n_heads // tp, m.head_dim, masked)
    if problem is not None:
        raise ConfigError(f"context_parallel_size={cp} with model.efficient_attn={m.efficient_attn}: its chunk "
                          f"pairs call torch's {problem} ({str(dtype).removeprefix('torch.')}, head_dim "
                          f"{m.head_dim}); pin another kernel, or math")


def model_unit_names(n_layers: int) -> list[str]:
    """Every FSDP unit of the whole model (all pipeline stages' chunks), in forward order."""
    return ["tok_embeddings", *(f"layers.{i}" for i in range(n_layers)), "head"]


def fsdp_unit_names(model: Transformer) -> list[str]:
    embedding = ["tok_embeddings"] if model.tok_embeddings is not None else []
    head = ["head"] if model.head is not None else []
    return [*embedding, *(f"layers.{i}" for i in model.layers), *head]


def block_factory(cfg: TrainConfig, mesh: ParallelMesh) -> BlockFactory | None:
    """TransformerEngine blocks under model.use_te_layers (their amaxes reduced over the group the in-tree
    fp8 reduces over; fp8 weight casts cached across microbatches unless ZeRO-3); None: the in-tree blocks."""
    if not cfg.model.use_te_layers:
        return None
    return TEBlocks(cfg.model, mesh.group("dp_cp_tp"), cache_fp8_weights=not cfg.reshard_after_forward)


def build_chunks(cfg: TrainConfig, tp: TPContext, pp_rank: int, cp: CPContext | None = None,
                 blocks: BlockFactory | None = None) -> list[Transformer]:
    """This pipeline rank's model chunks, on the meta device (parallelize() gives each FSDP unit its
    initial values as it shards it). Parameter names are those of the whole model, so every layout
    initializes and checkpoints the same parameters under the same names."""
    pp, vpp, n_layers, v_shape = (cfg.pipeline_parallel_size, cfg.virtual_pipeline_stages, cfg.model.n_layers,
                                  cfg.pipeline_v_shape)
    ends = cfg.pipeline_first_stage_layers, cfg.pipeline_last_stage_layers
    stages = rank_stages(pp, vpp, pp_rank, v_shape)
    with torch.device("meta"):
        return [
            Transformer(
                cfg.model, tp, chunk_layers(n_layers, pp, vpp, pp_rank, chunk, *ends, v_shape=v_shape),
                embedding=stage == 0, head=stage == pp * vpp - 1, cp=cp, blocks=blocks,
            )
            for chunk, stage in enumerate(stages)
        ]


def apply_activation_checkpointing(model: Transformer, mode: str, compile_blocks: bool = False) -> None:
    """Activation checkpointing (model.layer_ckpt) and regional compilation (compile) of each block. A
    selective checkpoint (the attention core) is traced into the block's graph; a full one wraps the
    compiled block, so its recompute runs the same compiled graph, and the collectives that run eagerly
    inside the block (TP/SP) are no obstacle to compiling the rest."""
    for block in model.layers.values():
        if mode == "selective":
            checkpoint_forward(block.attention.core)
        if compile_blocks:
            compile_forward(block)
        if mode == "full":
            checkpoint_forward(block)


def tp_context(cfg: TrainConfig, mesh: ParallelMesh) -> TPContext:
    """Built before the model: TP decides the local parameter shapes."""
    return TPContext(mesh.group("tp"), cfg.model.sequence_parallel)


def cp_context(cfg: TrainConfig, mesh: ParallelMesh) -> CPContext:
    return CPContext(mesh.group("cp") if mesh.dims.cp > 1 else None, cfg.context_parallel_comm,
                     cfg.model.efficient_attn)


def tied_embedding(model: Transformer) -> dict:
    """fully_shard's keys for model.tie_embeddings. A chunk with both the embedding and the head holds the
    weight once: the embedding's unit is gathered for the whole chunk's forward and backward, as the head
    reads it too. A chunk with only one of them holds a copy (parallel/fsdp/tied.py); the embedding's unit
    is padded to the head unit's size, so that the two copies' shards hold the same rows."""
    embedding, head = model.tok_embeddings is not None, model.head is not None
    if not model.args.tie_embeddings or not (embedding or head):
        return {}
    if embedding and head:
        return {"spans": {"tok_embeddings": ""}}
    with torch.device("meta"):
        head_numel = sum(p.numel() for p in OutputHead(model.args, model.tp).parameters())
    return {"tied": TiedCopy(TIED_WEIGHT if embedding else TIED_COPY, TIED_WEIGHT, head_numel)}


def parallelize(
    model: Transformer, cfg: TrainConfig, mesh: ParallelMesh, compute_dtype: torch.dtype, device: torch.device
) -> FSDPRoot:
    """Activation checkpointing and compilation, then FSDP over the TP-local parameters of a model built on
    the meta device: each rank draws the (layout-independent) initial values of its own shard of each unit
    only, so building never holds a whole unsharded unit, let alone the model."""
    apply_activation_checkpointing(model, cfg.model.layer_ckpt, cfg.compile)

    fsdp_cfg = FSDPConfig(
        compute_dtype=compute_dtype,
        reduce_dtype=DTYPES[cfg.reduce_dtype],
        reshard_after_forward=cfg.reshard_after_forward,
        optimize_backward_concat=cfg.optimize_backward_concat,
        gradient_accumulation_fusion=cfg.gradient_accumulation_fusion,
        fp8_all_gather=cfg.model.fp8_all_gather,
        grad_reduce=cfg.grad_reduce,
    )
    replicate = mesh.group("dp_replicate") if mesh.dims.dp_replicate > 1 else None
    tp = TPGroups(mesh.group("tp"), cfg.model.sequence_parallel)
    return fully_shard(model, fsdp_unit_names(model), mesh.group("dp_shard_cp"), replicate, fsdp_cfg, tp,
                       ModelInitializer(cfg.model, cfg.seed, device), **tied_embedding(model))


def build_runtime(
    cfg: TrainConfig, mesh: ParallelMesh, chunks: list, roots: list, dtype: torch.dtype, device: torch.device
) -> PipelineRuntime:
    """This rank's program of the step; stages exchange [microbatch, seq / cp (/tp under SP), dim] tensors."""
    pp_rank = mesh.rank_in("pp")
    program = schedule_actions(
        cfg.pipeline_schedule, cfg.pipeline_parallel_size, cfg.virtual_pipeline_stages, cfg.num_microbatches, pp_rank
    )
    seq = cfg.seq_len // cfg.context_parallel_size // (cfg.model_parallel_size if cfg.model.sequence_parallel else 1)
    shape = (cfg.microbatch_size, seq, cfg.model.dim)
    pp, vpp = cfg.pipeline_parallel_size, cfg.virtual_pipeline_stages
    return PipelineRuntime(program, pp, chunks, roots, mesh.group("pp"), shape, dtype, device,
                           mesh.pipeline_channels(channel_count(pp, vpp)), cfg.pipeline_v_shape)
