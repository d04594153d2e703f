"""Static config rules: checked on every rank before any process group exists.

Order matters for the user: value ranges and enums first, then divisibility rules of the model and
the parallel layout, then capabilities that are not built yet (so a layout that could never work
is reported as such, not as "not supported yet").
"""

from parallel.errors import ConfigError
from parallel.mesh import ParallelDims
from parallel.pipeline.schedule import pipeline_actions
from trainer.config import ENUMS, NOT_SUPPORTED_YET, TrainConfig, get_key
from trainer.fingerprint import ALLOWABLE

_POSITIVE = (
    "steps", "batch_size", "microbatch_size", "seq_len", "log_freq",
    "model.n_layers", "model.dim", "model.n_heads", "model.n_kv_heads", "model.vocab_size",
    "model.multiple_of", "model.norm_eps", "model.rope_theta", "optim.lr", "data.prepare_timeout_s",
    "model_parallel_size", "pipeline_parallel_size", "context_parallel_size", "dp_replicate",
)
_NON_NEGATIVE = (
    "seed", "profile_freq", "checkpoint.freq", "checkpoint.keep", "optim.warmup_steps", "optim.clip_grad_norm",
    "optim.weight_decay", "optim.eps",
)
_OPTIONAL_POSITIVE = ("optim.decay_steps", "model.ffn_dim_multiplier", "num_layers_per_virtual_pipeline_stage")
_UNIT_INTERVAL = ("optim.beta1", "optim.beta2")  # [0, 1)


def validate(cfg: TrainConfig, world_size: int) -> ParallelDims:
    """Check every static rule; returns the parallel layout of `world_size` ranks."""
    _check_ranges(cfg)
    _check_enums(cfg)
    _check_resume_keys(cfg)
    _check_model(cfg)
    _check_parallel_divisibility(cfg)
    # Builds (and caches) the schedule: a layout or microbatch count it cannot run fails here.
    pipeline_actions(cfg.pipeline_schedule, cfg.pipeline_parallel_size, cfg.virtual_pipeline_stages, cfg.num_microbatches)
    dims = ParallelDims.from_sizes(
        world_size, cfg.model_parallel_size, cfg.pipeline_parallel_size, cfg.context_parallel_size, cfg.dp_replicate
    )
    _check_supported(cfg)
    return dims


def _check_ranges(cfg: TrainConfig) -> None:
    for key in _POSITIVE:
        if get_key(cfg, key) <= 0:
            raise ConfigError(f"{key}={get_key(cfg, key)} must be > 0")
    for key in _NON_NEGATIVE:
        if get_key(cfg, key) < 0:
            raise ConfigError(f"{key}={get_key(cfg, key)} must be >= 0")
    for key in _OPTIONAL_POSITIVE:
        if get_key(cfg, key) is not None and get_key(cfg, key) <= 0:
            raise ConfigError(f"{key}={get_key(cfg, key)} must be > 0 (or null)")
    for key in _UNIT_INTERVAL:
        if not 0.0 <= get_key(cfg, key) < 1.0:
            raise ConfigError(f"{key}={get_key(cfg, key)} must be in [0, 1)")
    if not 0.0 <= cfg.optim.min_lr_ratio <= 1.0:
        raise ConfigError(f"optim.min_lr_ratio={cfg.optim.min_lr_ratio} must be in [0, 1]")
    for key in ("dump_profile_traces", "profile_with_stack"):
        if get_key(cfg, key) and not cfg.profile_freq:
            raise ConfigError(f"{key}=true needs profile_freq > 0 (which steps to profile)")
    if cfg.batch_size % cfg.microbatch_size:
        raise ConfigError(f"batch_size={cfg.batch_size} is not divisible by microbatch_size={cfg.microbatch_size}")


def _check_enums(cfg: TrainConfig) -> None:
    for key, allowed in ENUMS.items():
        value = get_key(cfg, key)
        if value not in allowed:
            choices = " | ".join("null" if a is None else str(a) for a in allowed)
            raise ConfigError(f"{key}={value} is not one of: {choices}")


def _check_resume_keys(cfg: TrainConfig) -> None:
    for key in cfg.resume.allow_changed:
        if key not in ALLOWABLE:
            raise ConfigError(
                f"resume.allow_changed: {key} cannot change on resume (only {', '.join(ALLOWABLE)} can)"
            )


def _check_model(cfg: TrainConfig) -> None:
    m = cfg.model
    _divisible("model.dim", m.dim, "model.n_heads", m.n_heads)
    _divisible("model.n_heads", m.n_heads, "model.n_kv_heads", m.n_kv_heads)
    if (m.dim // m.n_heads) % 2:
        raise ConfigError(f"model.dim / model.n_heads = {m.dim // m.n_heads} must be even for rotary embeddings")


def _check_parallel_divisibility(cfg: TrainConfig) -> None:
    m, tp = cfg.model, cfg.model_parallel_size
    _divisible("model.n_heads", m.n_heads, "model_parallel_size", tp)
    _divisible("model.n_kv_heads", m.n_kv_heads, "model_parallel_size", tp)
    _divisible("ffn hidden size (model.dim, model.ffn_dim_multiplier, model.multiple_of)",
               cfg.model_args().ffn_hidden_dim, "model_parallel_size", tp)
    _divisible("model.vocab_size", m.vocab_size, "model_parallel_size", tp)
    if m.sequence_parallel:
        _divisible("seq_len", cfg.seq_len, "model_parallel_size (model.sequence_parallel=true)", tp)
    if cfg.context_parallel_size > 1:
        _divisible("seq_len", cfg.seq_len, "2 x context_parallel_size", 2 * cfg.context_parallel_size)
    _divisible("model.n_layers", m.n_layers, "pipeline_parallel_size", cfg.pipeline_parallel_size)
    if cfg.num_layers_per_virtual_pipeline_stage is not None:
        stage_layers = cfg.pipeline_parallel_size * cfg.num_layers_per_virtual_pipeline_stage
        _divisible("model.n_layers", m.n_layers,
                   "pipeline_parallel_size x num_layers_per_virtual_pipeline_stage", stage_layers)


def _check_supported(cfg: TrainConfig) -> None:
    for key, supported in NOT_SUPPORTED_YET:
        value = get_key(cfg, key)
        if value != supported:
            raise ConfigError(f"{key}={value} is not supported yet (only {supported} is)")


def _divisible(key: str, value: int, by_key: str, by: int) -> None:
    if by <= 0 or value % by:
        raise ConfigError(f"{key}={value} is not divisible by {by_key}={by}")
