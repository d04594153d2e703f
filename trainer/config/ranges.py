"""The value range of each key, and the few rules between two keys that need nothing but their values:
the first rules a config meets (rules.py), so a value out of range is said as such before any rule that
combines it with the layout."""

import torch

from parallel.errors import ConfigError
from trainer.config.schema import TrainConfig, get_key

_POSITIVE = (
    "steps", "batch_size", "microbatch_size", "seq_len", "log_freq",
    "model.n_layers", "model.dim", "model.n_heads", "model.n_kv_heads", "model.vocab_size",
    "model.multiple_of", "model.norm_eps", "model.rope_theta", "data.prepare_timeout_s",
    "model_parallel_size", "pipeline_parallel_size", "context_parallel_size", "dp_replicate",
    "model.fp8_amax_history_len", "eval.steps", "comm_timeout_s",
)
# optim.lr=0 trains nothing on purpose (checking an import, measuring a frozen model): a note at start.
_NON_NEGATIVE = (
    "optim.lr", "seed", "profile_freq", "checkpoint.freq", "checkpoint.keep", "optim.warmup_steps",
    "optim.clip_grad_norm",
    "optim.weight_decay", "model.fp8_margin", "eval.freq",
)
_OPTIONAL_POSITIVE = ("optim.decay_steps", "optim.decay_start", "model.ffn_dim_multiplier", "model.intermediate_size",
                      "num_layers_per_virtual_pipeline_stage", "mem_snapshot_stop_step", "make_vocab_size_divisible_by",
                      "pipeline_first_stage_layers", "pipeline_last_stage_layers", "data.prepare_workers",
                      "world_size")
_UNIT_INTERVAL = ("optim.beta1", "optim.beta2")  # [0, 1)
SEED_MAX = 2**32 - 1
COMM_TIMEOUT_RANGE_S = (1.0, 7 * 24 * 3600.0)  # below 1 s start-up itself times out; above, C's int overflows
VOCAB_MAX = 2**31 - 1  # sentencepiece and the token ids are 32-bit
FP32_MAX = torch.finfo(torch.float32).max  # the optimizer's hyperparameters become fp32 tensors
FP32_TINY = torch.finfo(torch.float32).tiny
FP8_MARGIN_MAX = 16  # e4m3 keeps 2^-9 / 448: a margin past 16 leaves values 2 bits at most
FP8_HISTORY_MAX = 65536
# Signals a scheduler sends before a time limit or preemption (SIGINT and SIGTERM stay torchrun's).
STOP_SIGNALS = ("USR1", "USR2", "HUP")
# Microbatches per step and rank, and microbatch forwards per step over all pipeline chunks: every rank
# lists every rank's actions of a step, so a typo such as batch_size=10**9 would spend minutes and
# gigabytes on it before the data could say it has too few sequences (pp 8 x 4 chunks x 16384
# microbatches: 30 s and 0.9 GB per rank).
MAX_MICROBATCHES = 16384
MAX_SCHEDULED_FORWARDS = 65536


def check_ranges(cfg: TrainConfig) -> None:
    """Each key within its own range, and the few rules between two keys that need nothing else."""
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
    if not 0.0 <= cfg.data.held_out_fraction <= 0.5:
        raise ConfigError(f"data.held_out_fraction={cfg.data.held_out_fraction} must be in [0, 0.5]")
    if not 0.0 <= cfg.data.max_bad_fraction <= 1.0:
        raise ConfigError(f"data.max_bad_fraction={cfg.data.max_bad_fraction} must be in [0, 1]")
    if not 0.0 <= cfg.optim.min_lr_ratio <= 1.0:
        raise ConfigError(f"optim.min_lr_ratio={cfg.optim.min_lr_ratio} must be in [0, 1]")
    for key in ("dump_profile_traces", "profile_with_stack"):
        if get_key(cfg, key) and not cfg.profile_freq:
            raise ConfigError(f"{key}=true needs profile_freq > 0 (which steps to profile)")
    if cfg.stop_signal is not None and cfg.stop_signal not in STOP_SIGNALS:
        raise ConfigError(f"stop_signal={cfg.stop_signal} is not one of: {' | '.join(STOP_SIGNALS)} (or null)")
    if cfg.batch_size % cfg.microbatch_size:
        raise ConfigError(f"batch_size={cfg.batch_size} is not divisible by microbatch_size={cfg.microbatch_size}")
    if cfg.num_microbatches > MAX_MICROBATCHES:
        raise ConfigError(f"batch_size / microbatch_size = {cfg.num_microbatches} microbatches per step is more than "
                          f"{MAX_MICROBATCHES}; raise microbatch_size (or lower batch_size, which is per data-parallel rank)")
    if cfg.optimize_backward_concat and cfg.grad_reduce != "last_microbatch":
        raise ConfigError(f"optimize_backward_concat=true needs grad_reduce=last_microbatch (with "
                          f"grad_reduce={cfg.grad_reduce} every microbatch concatenates its gradient to reduce it)")
    low, high = COMM_TIMEOUT_RANGE_S
    if not low <= cfg.comm_timeout_s <= high:
        raise ConfigError(f"comm_timeout_s={cfg.comm_timeout_s} must be in [{low:g}, {high:g}] seconds")
    if cfg.model.vocab_size > VOCAB_MAX:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} must be <= {VOCAB_MAX}")
    if not cfg.optim.eps >= FP32_TINY:
        raise ConfigError(f"optim.eps={cfg.optim.eps} must be >= {FP32_TINY:.4g} (> 0 in fp32): AdamW divides by "
                          "sqrt(v) + eps, and an entry whose gradients were all 0 so far (the embedding row of a "
                          "token not seen yet) would be updated by 0/0 = NaN")
    if not cfg.model.norm_eps >= FP32_TINY:
        raise ConfigError(f"model.norm_eps={cfg.model.norm_eps} must be >= {FP32_TINY:.4g} (> 0 in fp32): RMSNorm "
                          "divides by sqrt(mean(x^2) + eps), and an all-zero row would give 0/0 = NaN")
    for key in ("optim.lr", "optim.eps", "optim.weight_decay", "optim.clip_grad_norm", "model.norm_eps",
                "model.rope_theta"):
        if get_key(cfg, key) > FP32_MAX:
            raise ConfigError(f"{key}={get_key(cfg, key)} must be <= {FP32_MAX:.4g} (it is used in fp32)")
    if cfg.optim.lr * cfg.optim.weight_decay >= 1:
        raise ConfigError(f"optim.lr x optim.weight_decay = {cfg.optim.lr * cfg.optim.weight_decay:g} must be < 1: each "
                          "step multiplies the weights by 1 - lr x weight_decay (decoupled decay) before the update")
    if cfg.model.fp8_margin > FP8_MARGIN_MAX:
        raise ConfigError(f"model.fp8_margin={cfg.model.fp8_margin} must be <= {FP8_MARGIN_MAX}: the scale keeps the "
                          "largest value 2^margin below fp8's maximum, so a larger margin flushes almost every value "
                          "to zero")
    if cfg.model.fp8_amax_history_len > FP8_HISTORY_MAX:
        raise ConfigError(f"model.fp8_amax_history_len={cfg.model.fp8_amax_history_len} must be <= {FP8_HISTORY_MAX} "
                          "(each fp8 GEMM keeps that many amaxes of each of its 3 operands)")
    if cfg.seed > SEED_MAX:
        raise ConfigError(f"seed={cfg.seed} must be <= {SEED_MAX} (2^32 - 1, what numpy's generator takes)")
    if cfg.profile_freq > cfg.steps:
        raise ConfigError(f"profile_freq={cfg.profile_freq} must be <= steps={cfg.steps} (it profiles every "
                          f"{cfg.profile_freq}th step: none of this run's)")
    if cfg.mem_snapshot_stop_step is not None and cfg.mem_snapshot_stop_step > cfg.steps:
        raise ConfigError(f"mem_snapshot_stop_step={cfg.mem_snapshot_stop_step} must be <= steps={cfg.steps} "
                          "(the snapshot is written at that step)")
    decay, warmup = cfg.optim.decay_steps, cfg.optim.warmup_steps
    if decay is not None and decay < warmup and cfg.steps > decay:  # a run that ends earlier never sees it
        raise ConfigError(f"optim.decay_steps={decay} must be >= optim.warmup_steps={warmup} when steps={cfg.steps} "
                          "runs past it: the LR would warm up past the end of its decay, then drop to the minimum")
    _check_decay_start(cfg)


def _check_decay_start(cfg: TrainConfig) -> None:
    start, warmup, end = cfg.optim.decay_start, cfg.optim.warmup_steps, cfg.optim.decay_end(cfg.steps)
    if start is None:
        return
    if start < warmup:
        raise ConfigError(f"optim.decay_start={start} must be >= optim.warmup_steps={warmup} (the decay starts from "
                          "the peak LR)")
    if start >= end:
        raise ConfigError(f"optim.decay_start={start} must be < where the decay ends, {end} (optim.decay_steps, or "
                          "steps when unset; set optim.decay_steps for a schedule longer than this run)")
