"""The typed training config, built from hydra's resolved DictConfig: every key, its type and default.

Building checks names and types (an unknown key, with the nearest known one; a value of the wrong type),
each as one ConfigError line naming the key; the rules between values are rules.py's. Imports no
torch: the launchers' override check reads it.
"""

import dataclasses
import difflib
import math
import os
import sys
from dataclasses import dataclass, field, fields
from types import UnionType
from typing import Any, Union, get_args, get_origin, get_type_hints

from model.args import ModelArgs
from parallel.errors import ConfigError
from parallel.pipeline.layers import virtual_stages
from parallel.pipeline.schedule import SCHEDULES, v_shaped


@dataclass(frozen=True)
class ModelConfig(ModelArgs):
    """`model.*`: the model's own hyperparameters, written once in ModelArgs (model/args.py), and the keys of
    how the trainer builds and runs it. `max_seq_len` is no key of its own: the run's seq_len sets it."""

    name: str = "tiny"
    sequence_parallel: bool = False
    layer_ckpt: str = "none"
    attn_bias_type: str = "causal"
    use_te_layers: bool = False
    fp8_all_gather: bool = False


# Fields set from other keys (max_seq_len from seq_len) or from the run's tokenizer (valid_vocab_size, as
# the data is prepared), never given: a config written by an earlier run holds them, and they are derived
# again as it is read. Given on the command line, one is refused (trainer/config/cli.py). Each: what sets it.
DERIVED = {"model.max_seq_len": "seq_len", "model.valid_vocab_size": "the tokenizer's vocabulary (set model.vocab_size)"}


@dataclass
class DataConfig:
    source: str | list[str] | None = "stdlib"  # a list is a blend of sources, mixed by `weights`
    tokenizer: str | None = None
    cache_dir: str = ".cache/data"
    prepare_timeout_s: float = 3600.0
    held_out_fraction: float = 0.01
    text_key: str = "text"
    bad_records: str = "error"
    max_bad_fraction: float = 0.001
    weights: list[float] | None = None  # one per source; null: proportional to each source's tokens
    prepare_workers: int | None = None  # processes that tokenize; None: every usable core

    @property
    def sources(self) -> list[str | None]:
        """`source` as a list: one source, or the sources of a blend."""
        return list(self.source) if isinstance(self.source, list) else [self.source]


@dataclass
class OptimConfig:
    lr: float = 3e-3
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    warmup_steps: int = 10
    decay_style: str = "cosine"
    decay_start: int | None = None
    decay_steps: int | None = None
    min_lr_ratio: float = 0.1
    clip_grad_norm: float = 1.0
    use_fp32_copy_optim: bool = True
    fused: bool = False

    @property
    def decays(self) -> bool:
        """Whether the LR decays after warmup at all (min_lr_ratio=1 holds it at lr)."""
        return self.min_lr_ratio < 1

    def decay_end(self, total_steps: int) -> int:
        """The step the LR decay ends at: decay_steps, or the run's last step when unset."""
        return self.decay_steps if self.decay_steps is not None else total_steps


@dataclass
class CheckpointConfig:
    freq: int = 0
    keep: int = 0
    verify_checksums: bool = True
    async_save: bool = False
    init_from_hf: str | None = None


@dataclass
class MetricsConfig:
    tensorboard: bool = False  # also write the logged steps' scalars as TensorBoard events in {dump_dir}/tb/
    unit_norms: bool = False  # per FSDP unit gradient and parameter norms in metrics.jsonl (one more all-reduce)
    wandb: bool = False  # also log the logged steps' scalars to a Weights & Biases run (the wandb extra)
    wandb_project: str | None = None  # null: wandb's own default (WANDB_PROJECT, else "uncategorized")
    wandb_entity: str | None = None  # null: the API key's default entity
    wandb_run_name: str | None = None  # null: a name W&B makes up
    wandb_tags: list[str] = field(default_factory=list)


@dataclass
class EvalConfig:
    freq: int = 0  # evaluate every N steps (and after the last); 0 = never
    steps: int = 4  # held-out global batches per evaluation


@dataclass
class ResumeConfig:
    # Keys a resume may change although the checkpoint was written with other values (see
    # trainer/checkpoint/fingerprint.py for which ones may be listed).
    allow_changed: list[str] = field(default_factory=list)


@dataclass
class TrainConfig:
    dump_dir: str = "dump/default"
    steps: int = 100
    seed: int = 0
    batch_size: int = 4
    microbatch_size: int = 1
    seq_len: int = 128
    make_vocab_size_divisible_by: int | None = None
    model_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    context_parallel_size: int = 1
    num_layers_per_virtual_pipeline_stage: int | None = None
    pipeline_first_stage_layers: int | None = None
    pipeline_last_stage_layers: int | None = None
    pipeline_schedule: str = "1f1b"
    context_parallel_comm: str = "all_gather"
    compute_dtype: str | None = None
    reduce_dtype: str = "fp32"
    dp_replicate: int = 1
    reshard_after_forward: bool = True
    optimize_backward_concat: bool = False
    gradient_accumulation_fusion: bool = False
    grad_reduce: str = "last_microbatch"
    enable_deterministic_training: bool = False
    log_freq: int = 10
    log_all_steps: bool = False
    profile_freq: int = 0
    dump_profile_traces: bool = False
    profile_with_stack: bool = False
    mem_snapshot_stop_step: int | None = None
    stop_signal: str | None = None
    nan_policy: str = "halt"
    compile: bool = False  # regional torch.compile of each transformer block (parallel/regional_compile.py)
    comm_timeout_s: float = 600.0
    dry_run: bool = False
    world_size: int | None = None
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    resume: ResumeConfig = field(default_factory=ResumeConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    def __post_init__(self) -> None:
        # `~` as the shell expands it: a quoted or composed path (dump_dir, data.source, data.tokenizer,
        # data.cache_dir, checkpoint.init_from_hf) would otherwise name a folder "~".
        self.dump_dir = os.path.expanduser(self.dump_dir)
        self.data = dataclasses.replace(self.data, **{
            key: os.path.expanduser(getattr(self.data, key)) for key in ("source", "tokenizer", "cache_dir")
            if isinstance(getattr(self.data, key), str)})
        if isinstance(self.data.source, list):
            self.data = dataclasses.replace(self.data, source=[os.path.expanduser(s) for s in self.data.source])
        if isinstance(self.checkpoint.init_from_hf, str):
            self.checkpoint = dataclasses.replace(self.checkpoint,
                                                  init_from_hf=os.path.expanduser(self.checkpoint.init_from_hf))
        self.model = dataclasses.replace(self.model, max_seq_len=self.seq_len)

    @property
    def virtual_pipeline_stages(self) -> int:
        """Model chunks per pipeline rank: the stages of num_layers_per_virtual_pipeline_stage layers, plus
        the first and last stage where their counts are set, over pp; 1 when unset."""
        return virtual_stages(self.model.n_layers, self.pipeline_parallel_size, self.num_layers_per_virtual_pipeline_stage,
                              self.pipeline_first_stage_layers, self.pipeline_last_stage_layers)

    @property
    def pipeline_v_shape(self) -> bool:
        """Whether the schedule places the stages in a V (zbv: rank r runs stages r and 2pp - 1 - r)."""
        return v_shaped(self.pipeline_schedule)

    @property
    def num_microbatches(self) -> int:
        return self.batch_size // self.microbatch_size


ENUMS = {
    "pipeline_schedule": SCHEDULES,
    "context_parallel_comm": ("all_gather", "ring"),
    "compute_dtype": (None, "bf16", "fp32"),
    "reduce_dtype": ("bf16", "fp32"),
    "model.layer_ckpt": ("none", "full", "selective"),
    "model.efficient_attn": ("sdpa", "flash", "cutlass", "cudnn", "math"),
    "model.attn_bias_type": ("causal", "block_causal"),
    "nan_policy": ("halt", "skip"),
    "optim.decay_style": ("cosine", "linear"),
    "grad_reduce": ("last_microbatch", "per_microbatch"),
    "model.fp8_format": ("hybrid", "e4m3"),
    "model.fp8_amax_compute_algo": ("max", "most_recent"),
    "data.bad_records": ("error", "skip"),
}

# Capabilities not built yet: (key, the value that is supported today).
NOT_SUPPORTED_YET = (
    # FSDP's fp32 flat shards are the master weights; pure low-precision parameters are not built.
    ("optim.use_fp32_copy_optim", True),
)


def from_dict(raw: dict[str, Any]) -> TrainConfig:
    """Build a TrainConfig from a plain dict (hydra's resolved config), checking keys and types."""
    return _build(TrainConfig, raw, prefix="")


def unknown_key(key: str) -> str:
    """The error for a key TrainConfig does not have, with the nearest known one (a typo, mostly). A known key
    of a group that may be null is one hydra could not set (the group is null, or was given without it)."""
    if key in DERIVED:
        return f"{key} is not set directly: it follows from {DERIVED[key]}"
    group = key.rpartition(".")[0]
    if key in _known_keys(TrainConfig, "", group_fields=True) and group in _known_keys(TrainConfig, ""):
        return (f"{key} cannot be set where {group} is null or lacks it: give the whole group, "
                f"{group}={{key:value,...}}, or add the key with +{key}=value")
    close = difflib.get_close_matches(key, _known_keys(TrainConfig, "", group_fields=True), n=1)
    return f"{key} is not a known config key" + (f" (did you mean {close[0]}?)" if close else "")


def _known_keys(cls: type, prefix: str, group_fields: bool = False) -> list[str]:
    """Every key, dotted. A group that may be null is one key (its value null or the group), followed by
    its own keys with `group_fields`."""
    hints = get_type_hints(cls)
    keys = []
    for f in fields(cls):
        key, group = f"{prefix}{f.name}", _optional_group(hints[f.name])
        if key in DERIVED:
            continue
        if dataclasses.is_dataclass(hints[f.name]):
            keys += _known_keys(hints[f.name], f"{key}.", group_fields)
        else:
            keys += [key, *(_known_keys(group, f"{key}.") if group and group_fields else ())]
    return keys


def _optional_group(hint: Any) -> type | None:
    """X where the hint is `X | None` for a dataclass X (a group that may be null), else None."""
    if get_origin(hint) not in (Union, UnionType):
        return None
    members = [arg for arg in get_args(hint) if arg is not type(None)]
    nullable_one = len(members) == 1 and len(get_args(hint)) == 2
    return members[0] if nullable_one and dataclasses.is_dataclass(members[0]) else None


def _build(cls: type, raw: dict[str, Any], prefix: str) -> Any:
    hints = get_type_hints(cls)
    known = {f.name for f in fields(cls) if f"{prefix}{f.name}" not in DERIVED}
    raw = {key: value for key, value in raw.items() if f"{prefix}{key}" not in DERIVED}
    for key in raw:
        if key not in known:
            raise ConfigError(unknown_key(f"{prefix}{key}"))
    values = {}
    for name in known & raw.keys():
        hint, value, group = hints[name], raw[name], _optional_group(hints[name])
        if group is not None and value is None:
            values[name] = None
        elif dataclasses.is_dataclass(hint) or group is not None:
            if not isinstance(value, dict):
                null = " or null" if group else ""
                raise ConfigError(f"{prefix}{name} must be a group of keys{null}, got {value!r}")
            values[name] = _build(group or hint, value, f"{prefix}{name}.")
        else:
            values[name] = _coerce(f"{prefix}{name}", hint, value)
    return cls(**values)


def _coerce(key: str, hint: Any, value: Any) -> Any:
    if isinstance(value, list | tuple) and get_origin(hint) in (Union, UnionType):
        # `str | list[str]` (data.source): a list given takes the list member of the union.
        hint = next((arg for arg in get_args(hint) if get_origin(arg) is list), hint)
    if get_origin(hint) is list:
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{key}={value!r} must be a list, e.g. {key}=[a,b]")
        return [_coerce(f"{key}[{i}]", get_args(hint)[0], item) for i, item in enumerate(value)]
    allowed = get_args(hint) if get_origin(hint) in (Union, UnionType) else (hint,)
    if value is None:
        if type(None) in allowed:
            return None
        raise ConfigError(f"{key} must not be null")
    for typ in allowed:
        if typ is bool and isinstance(value, bool):
            return value
        if typ is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if typ is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            if isinstance(value, int) and abs(value) > sys.float_info.max:
                raise ConfigError(f"{key} must be a finite number (an integer of {len(str(abs(value)))} digits is "
                                  "beyond any float)")
            if not math.isfinite(value):  # nan passes every range check; inf overflows timeouts
                raise ConfigError(f"{key}={value} must be a finite number")
            return float(value)
        if typ is str and isinstance(value, str):
            if not value:  # e.g. an unset shell variable: never mean "unset" silently
                hint = "use null to leave it unset" if type(None) in allowed else "it needs a value"
                raise ConfigError(f"{key} is an empty string ({hint})")
            return value
    names = " or ".join("null" if t is type(None) else t.__name__ for t in allowed)
    raise ConfigError(f"{key}={value!r} must be {names}")


def get_key(cfg: TrainConfig, key: str) -> Any:
    obj: Any = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def flat_values(cfg: TrainConfig) -> dict[str, Any]:
    """Every key of the config (dotted, as on the command line) with its value."""
    return {key: get_key(cfg, key) for key in _known_keys(TrainConfig, "")}


def setting(cfg: TrainConfig, key: str) -> str:
    """`key=value` as it is written on the command line (true/false, null), for messages."""
    return f"{key}={as_written(get_key(cfg, key))}"


def as_written(value: Any) -> Any:
    """A config value as the command line writes it (true/false, null)."""
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else value
