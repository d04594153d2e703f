"""Static config rules: checked on every rank before any process group exists.

Order matters for the user: value ranges and enums first, then divisibility rules of the model and
the parallel layout, then capabilities that are not built yet (so a layout that could never work
is reported as such, not as "not supported yet").
"""

from dataclasses import fields
from pathlib import Path

from model.attention_kernels import check_deterministic_kernel
from model.fp8 import GEMM_MULTIPLE
from parallel.errors import ConfigError
from parallel.mesh import ParallelDims
from parallel.pipeline.layers import check_virtual_split, stage_layer_counts
from parallel.pipeline.schedule import pipeline_actions, splits_backward
from trainer.checkpoint.fingerprint import ALLOWABLE
from trainer.checkpoint.hf_folder import check_hf_folder, check_token_ids, check_vocab, read_hf_config
from trainer.checkpoint.resume import resumed_checkpoint
from trainer.config.data_sources import check_sources
from trainer.config.fp8_rules import check_te_sequence_parallel
from trainer.config.ranges import MAX_SCHEDULED_FORWARDS, check_ranges
from trainer.config.te_rules import check_te_combinations, check_transformer_engine
from trainer.config.schema import ENUMS, NOT_SUPPORTED_YET, ModelConfig, TrainConfig, as_written, get_key, setting
from trainer.data.tokenizer import choose_tokenizer, load_tokenizer
from trainer.observability.wandb_run import check_wandb_installed

FP8_KEYS = tuple(f"model.{f.name}" for f in fields(ModelConfig) if f.name.startswith("fp8_"))
_DEFAULTS = TrainConfig()


def _check_schedule_size(cfg: TrainConfig) -> None:
    chunks = cfg.pipeline_parallel_size * cfg.virtual_pipeline_stages
    forwards = cfg.num_microbatches * chunks
    if forwards > MAX_SCHEDULED_FORWARDS:
        raise ConfigError(
            f"batch_size / microbatch_size = {cfg.num_microbatches} microbatches through {chunks} pipeline chunks "
            f"(pipeline_parallel_size x virtual stages) is {forwards} scheduled forwards per step, more than "
            f"{MAX_SCHEDULED_FORWARDS}; raise microbatch_size (or lower batch_size, which is per data-parallel rank)")


def validate(cfg: TrainConfig, world_size: int) -> ParallelDims:
    """Check every static rule; returns the parallel layout of `world_size` ranks."""
    check_ranges(cfg)
    check_sources(cfg.data)
    _check_enums(cfg)
    _check_rope_scaling(cfg)
    _check_resume_keys(cfg)
    _check_model(cfg)
    _check_parallel_divisibility(cfg)
    _check_compile(cfg)
    _check_fp8(cfg)
    _check_keys_with_effect(cfg)
    check_wandb_installed(cfg)
    dims = _check_layout(cfg, world_size)
    _check_supported(cfg)
    if cfg.checkpoint.init_from_hf:
        resumed = resumed_checkpoint(cfg)
        choice = choose_tokenizer(cfg.data.tokenizer, cfg.checkpoint.init_from_hf, resumed)
        if resumed is None:  # a resume reads its weights from the checkpoint: the folder may be gone
            folder = Path(cfg.checkpoint.init_from_hf)
            check_hf_folder(folder, cfg.model)
            config, tokenizer = read_hf_config(folder), load_tokenizer(choice.path, choice.key, choice.origin)
            check_token_ids(config, tokenizer, folder)
            check_vocab(config, tokenizer, folder, padded=cfg.make_vocab_size_divisible_by is not None)
    return dims


def check_launchable(cfg: TrainConfig, world_size: int | None) -> None:
    """What a launcher checks before it starts (or submits) a job: values in range and the layout rules
    that need neither files nor devices, with the layout of `world_size` ranks where it is known."""
    check_model_config(cfg)
    _check_parallel_divisibility(cfg)
    _check_layout(cfg, world_size)


def _check_layout(cfg: TrainConfig, world_size: int | None) -> ParallelDims | None:
    """The pipeline program and the parallel layout of `world_size` ranks (None: not known, not checked)."""
    _check_schedule_size(cfg)
    # Builds (and caches) the schedule: a layout or microbatch count it cannot run fails here.
    pipeline_actions(cfg.pipeline_schedule, cfg.pipeline_parallel_size, cfg.virtual_pipeline_stages,
                     cfg.num_microbatches)
    if world_size is None:
        return None
    return ParallelDims.from_sizes(world_size, cfg.model_parallel_size, cfg.pipeline_parallel_size,
                                   cfg.context_parallel_size, cfg.dp_replicate)


def check_model_config(cfg: TrainConfig) -> None:
    """The rules a model read back from a checkpoint or a Hugging Face folder must meet to be built
    (generation, export): a damaged or hand-edited config fails here, in one line, not in a constructor."""
    check_ranges(cfg)
    _check_enums(cfg)
    _check_rope_scaling(cfg)
    _check_model(cfg)


def _check_enums(cfg: TrainConfig) -> None:
    for key, allowed in ENUMS.items():
        value = get_key(cfg, key)
        if value not in allowed:
            choices = " | ".join("null" if a is None else str(a) for a in allowed)
            raise ConfigError(f"{key}={value} is not one of: {choices}")


def _check_rope_scaling(cfg: TrainConfig) -> None:
    """model.rope_scaling: Llama 3.1's scaling only, with values its formula can use."""
    scaling = cfg.model.rope_scaling
    if scaling is None:
        return
    if scaling.type != "llama3":
        raise ConfigError(f"model.rope_scaling.type={scaling.type} is not supported: only llama3 (Llama 3.1's RoPE "
                          "scaling) is")
    low = scaling.low_freq_factor
    bounds = {
        "factor": (scaling.factor >= 1, ">= 1"),
        "low_freq_factor": (low > 0, "> 0"),
        "high_freq_factor": (scaling.high_freq_factor > low, f"> model.rope_scaling.low_freq_factor={low}"),
        "original_max_position_embeddings": (scaling.original_max_position_embeddings > 0, "> 0"),
    }
    for name, (holds, bound) in bounds.items():
        if not holds:
            raise ConfigError(f"model.rope_scaling.{name}={getattr(scaling, name)} must be {bound}")


def _check_resume_keys(cfg: TrainConfig) -> None:
    for key in cfg.resume.allow_changed:
        if key not in ALLOWABLE:
            raise ConfigError(
                f"resume.allow_changed: {key} is not a key a resume lets change (those are: {', '.join(ALLOWABLE)}); "
                "layout keys (parallel sizes, microbatching, resharding) change freely without it, with batch_size "
                "set so that the global batch stays the same"
            )


def _check_model(cfg: TrainConfig) -> None:
    m = cfg.model
    _divisible("model.dim", m.dim, "model.n_heads", m.n_heads)
    _divisible("model.n_heads", m.n_heads, "model.n_kv_heads", m.n_kv_heads)
    if m.ffn_hidden_dim < 1:
        raise ConfigError(f"{_ffn_size_keys(m)}={m.ffn_hidden_dim} must be >= 1: the blocks would have no "
                          "feed-forward layer")
    if (m.dim // m.n_heads) % 2:
        raise ConfigError(f"model.dim / model.n_heads = {m.dim // m.n_heads} must be even for rotary embeddings")
    check_deterministic_kernel(m.efficient_attn, cfg.enable_deterministic_training)


def _ffn_size_keys(m: ModelConfig) -> str:
    """The keys that set the SwiGLU hidden size, for error lines."""
    if m.intermediate_size is not None:
        return "model.intermediate_size"
    return "ffn hidden size (model.dim, model.ffn_dim_multiplier, model.multiple_of)"


def _check_parallel_divisibility(cfg: TrainConfig) -> None:
    m, tp = cfg.model, cfg.model_parallel_size
    _divisible("model.n_heads", m.n_heads, "model_parallel_size", tp)
    _divisible("model.n_kv_heads", m.n_kv_heads, "model_parallel_size", tp)
    _divisible(_ffn_size_keys(m), m.ffn_hidden_dim, "model_parallel_size", tp)
    if cfg.make_vocab_size_divisible_by is None and m.vocab_size % tp:  # the key pads to a multiple of tp
        raise ConfigError(f"model.vocab_size={m.vocab_size} is not divisible by model_parallel_size={tp}: pad it "
                          "(make_vocab_size_divisible_by, or a larger model.vocab_size)")
    if m.sequence_parallel:
        _divisible("seq_len", cfg.seq_len, "model_parallel_size (model.sequence_parallel=true)", tp)
    if cfg.context_parallel_size > 1:
        if cfg.seq_len % (2 * cfg.context_parallel_size):
            raise ConfigError(f"seq_len={cfg.seq_len} is not divisible by 2 x context_parallel_size = "
                              f"{2 * cfg.context_parallel_size} (each CP rank takes two load-balanced halves)")
        if m.sequence_parallel:
            _divisible("seq_len / context_parallel_size", cfg.seq_len // cfg.context_parallel_size,
                       "model_parallel_size (model.sequence_parallel=true)", tp)
    _check_stage_layers(cfg)


def _check_stage_layers(cfg: TrainConfig) -> None:
    """Every pipeline stage gets a whole, non-empty block of layers (parallel/pipeline/layers.py)."""
    n, pp, per_stage = cfg.model.n_layers, cfg.pipeline_parallel_size, cfg.num_layers_per_virtual_pipeline_stage
    first, last = cfg.pipeline_first_stage_layers, cfg.pipeline_last_stage_layers
    if first is None and last is None:
        _divisible("model.n_layers", n, "pipeline_parallel_size", pp)
        if per_stage is not None:
            _divisible("model.n_layers", n, "pipeline_parallel_size x num_layers_per_virtual_pipeline_stage",
                       pp * per_stage)
        return
    if per_stage is not None:
        check_virtual_split(n, pp, per_stage, first, last)
    stage_layer_counts(n, pp, cfg.virtual_pipeline_stages, first, last)


def _check_fp8(cfg: TrainConfig) -> None:
    m = cfg.model
    if m.use_te_layers:
        check_te_combinations(cfg)
        check_transformer_engine(cfg)
    if not m.use_fp8:
        return  # the fp8 keys need it: _NEEDS
    check_te_sequence_parallel(cfg)
    for what, size in fp8_gemm_sizes(cfg):
        if size % GEMM_MULTIPLE:
            raise ConfigError(
                f"model.use_fp8=true needs every fp8 GEMM dimension divisible by {GEMM_MULTIPLE} "
                f"(torch._scaled_mm): {what} = {size} is not"
            )



# Keys that change nothing unless another key allows it: set away from the default without it, they
# would be silently ignored, so they are refused; a value that asks for what the config already gives is
# accepted. (key, what it needs, whether the config has it or asks for nothing it lacks)
_NEEDS = (
    *((key, "model.use_fp8=true (it changes fp8 GEMMs only)", lambda c: c.model.use_fp8) for key in FP8_KEYS),
    ("eval.steps", "eval.freq > 0", lambda c: c.eval.freq > 0),
    ("data.max_bad_fraction", "data.bad_records=skip (with error the first bad record stops the run)",
     lambda c: c.data.bad_records == "skip"),
    ("checkpoint.async_save", "checkpoint.freq > 0 (a save on a stop signal is synchronous)",
     lambda c: c.checkpoint.freq > 0),
    ("checkpoint.keep", "checkpoint.freq > 0 or a stop_signal (nothing else saves)",
     lambda c: c.checkpoint.freq > 0 or c.stop_signal is not None),
    # log_freq=1 asks for what log_all_steps=true gives (every step logged): nothing is ignored.
    ("log_freq", "log_all_steps=false (every step is logged)", lambda c: not c.log_all_steps or c.log_freq == 1),
    *((key, "optim.min_lr_ratio < 1 (with 1 the LR stays at optim.lr after warmup)",
       lambda c: c.optim.decays) for key in ("optim.decay_style", "optim.decay_start", "optim.decay_steps")),
    *((f"metrics.wandb_{key}", "metrics.wandb=true", lambda c: c.metrics.wandb)
      for key in ("project", "entity", "run_name", "tags")),
)


def _check_compile(cfg: TrainConfig) -> None:
    """What regional compilation (parallel/regional_compile.py) cannot trace: one line at start."""
    if not cfg.compile:
        return
    if cfg.model.use_te_layers:
        raise ConfigError("compile=true with model.use_te_layers=true is not supported: TransformerEngine's modules "
                          "(their autocast and fp8 state) do not trace under torch.compile (use the in-tree blocks)")
    if cfg.gradient_accumulation_fusion:
        raise ConfigError("compile=true with gradient_accumulation_fusion=true is not supported: the fused "
                          "weight-gradient GEMM writes into the FSDP unit's accumulator from inside the block's "
                          "backward, which a compiled graph cannot do (set one of them to false)")
    if splits_backward(cfg.pipeline_schedule):
        raise ConfigError(f"compile=true with pipeline_schedule={cfg.pipeline_schedule} is not supported: a "
                          "zero-bubble B queues its weight-gradient GEMMs from inside the block's backward, which a "
                          "compiled graph cannot do (use pipeline_schedule=1f1b, or compile=false)")


def _check_keys_with_effect(cfg: TrainConfig) -> None:
    for key, needs, has in _NEEDS:
        if get_key(cfg, key) != get_key(_DEFAULTS, key) and not has(cfg):
            raise ConfigError(f"{setting(cfg, key)} needs {needs}; without it the key changes nothing")


# Keys that change nothing on some layouts and take effect on others with the same command (a numerics
# matrix passes one set of overrides to every layout): accepted, and named in the log where they are no-ops.
_LAYOUT_NOOPS = (
    ("optimize_backward_concat", "more than one microbatch", lambda c, d: c.num_microbatches > 1),
    ("grad_reduce", "more than one microbatch", lambda c, d: c.num_microbatches > 1),
    ("reshard_after_forward", "more than one rank per FSDP shard group", lambda c, d: d.dp_shard * d.cp > 1),
    ("model.sequence_parallel", "model_parallel_size > 1", lambda c, d: d.tp > 1),
    ("context_parallel_comm", "context_parallel_size > 1", lambda c, d: d.cp > 1),
)


def inert_keys(cfg: TrainConfig, dims: ParallelDims) -> dict[str, str]:
    """{key: what it needs} of the keys that change nothing on this layout, whatever their value (a run
    comparison toggling one of them tests nothing: scripts/compare_runs.py reads them from layout.json)."""
    return {key: needs for key, needs, has in _LAYOUT_NOOPS if not has(cfg, dims)}


def layout_noops(cfg: TrainConfig, dims: ParallelDims) -> list[str]:
    """The keys set away from their default that change nothing on this layout, for the log."""
    return [f"{setting(cfg, key)} changes nothing on this layout: it needs {needs}"
            for key, needs in inert_keys(cfg, dims).items() if get_key(cfg, key) != get_key(_DEFAULTS, key)]


def fusion_note(cfg: TrainConfig, compute_dtype: str) -> str | None:
    """gradient_accumulation_fusion fuses GEMMs whose operands share the accumulator's fp32 only."""
    if not cfg.gradient_accumulation_fusion or compute_dtype == "fp32":
        return None
    return (f"gradient_accumulation_fusion=true changes nothing with {compute_dtype} compute: the weight-gradient "
            f"GEMMs' operands are {compute_dtype} and the accumulator fp32, so nothing is fused")


def start_notes(cfg: TrainConfig, dims: ParallelDims) -> list[str]:
    """What the log says at start-up about settings that are accepted but change less than they seem."""
    notes = layout_noops(cfg, dims)
    if cfg.model.use_te_layers and dims.tp > 1:
        notes.append("model.use_te_layers=true with model_parallel_size > 1: TransformerEngine issues the blocks' TP "
                     "collectives itself, so metrics' comm and comm_wait_s leave them out (tflops_compute and "
                     "mfu_compute read high)")
    if cfg.optim.lr == 0:
        notes.append("optim.lr=0: the weights will not change (the optimizer steps with a learning rate and a "
                     "weight decay of 0); the loss measures the model as loaded")
    return notes


def fp8_gemm_sizes(cfg: TrainConfig) -> list[tuple[str, int]]:
    """The in/out sizes of every TP-local block linear, and (for the fp8 weight gradient, whose inner
    dimension it is) the tokens of one microbatch on one rank."""
    args, tp = cfg.model, cfg.model_parallel_size
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    sizes = [
        ("model.dim", args.dim),
        ("(q + 2 kv heads) x head_dim / model_parallel_size", (q + 2 * kv) // tp),
        ("model.n_heads x head_dim / model_parallel_size", q // tp),
        ("2 x ffn hidden size / model_parallel_size", 2 * args.ffn_hidden_dim // tp),
        ("ffn hidden size / model_parallel_size", args.ffn_hidden_dim // tp),
    ]
    if cfg.model.fp8_wgrad:
        tokens = cfg.microbatch_size * cfg.seq_len // cfg.context_parallel_size
        sizes.append(("microbatch_size x seq_len / context_parallel_size (model.fp8_wgrad=true)", tokens))
    return sizes


def _check_supported(cfg: TrainConfig) -> None:
    for key, supported in NOT_SUPPORTED_YET:
        if get_key(cfg, key) != supported:
            raise ConfigError(f"{setting(cfg, key)} is not supported yet (only {as_written(supported)} is)")
    if cfg.model.tie_embeddings and cfg.pipeline_parallel_size == 1 and cfg.virtual_pipeline_stages > 1:
        # The embedding (first chunk) and the head (last chunk) would hold two copies on one rank.
        raise ConfigError("model.tie_embeddings=true with num_layers_per_virtual_pipeline_stage on one pipeline rank "
                          "(pipeline_parallel_size=1) is not supported yet: unset "
                          "num_layers_per_virtual_pipeline_stage, or use pipeline_parallel_size > 1")
    if cfg.model.tie_embeddings and cfg.pipeline_v_shape:
        # The V puts the embedding (stage 0) and the head (the last stage) in two chunks of rank 0.
        raise ConfigError("model.tie_embeddings=true with pipeline_schedule=zbv is not supported yet: the V places "
                          "the embedding and the head in two chunks of pipeline rank 0 (use pipeline_schedule=zb_h1 "
                          "or 1f1b)")


def _divisible(key: str, value: int, by_key: str, by: int) -> None:
    if by <= 0 or value % by:
        raise ConfigError(f"{key}={value} is not divisible by {by_key}={by}")
