"""What a run is, for a resume to compare: everything that fixes the model, its data and its numerics.

Every checkpoint stores the fingerprint of the run that wrote it (`fingerprint.json`). A resume
compares it with its own before loading anything and refuses any difference in one line naming each
key with both values. Where a change is meaningful (the LR schedule, precisions) the user may allow it
by name with `resume.allow_changed=[key,...]`. Layout keys (tp, pp, vpp, dp, cp, microbatching,
resharding, checkpointing) are not part of it: a checkpoint reloads under any layout.
"""

import dataclasses
import json
from pathlib import Path
from typing import Any

from parallel.errors import ConfigError
from trainer.config.schema import TrainConfig, get_key
from trainer.outputs import FINGERPRINT_FILE

ARCHITECTURE = tuple(
    f"model.{k}" for k in ("n_layers", "dim", "n_heads", "n_kv_heads", "vocab_size", "ffn_dim_multiplier",
                           "multiple_of", "intermediate_size", "norm_eps", "rope_theta", "rope_scaling",
                           "tie_embeddings", "attn_bias_type")
)
SCHEDULE = tuple(
    f"optim.{k}" for k in ("lr", "weight_decay", "beta1", "beta2", "eps", "warmup_steps", "decay_style",
                           "decay_start", "min_lr_ratio", "clip_grad_norm")
)
FP8 = tuple(f"model.{k}" for k in ("fp8_format", "fp8_margin", "fp8_amax_compute_algo", "fp8_all_gather"))
PRECISION = ("compute_dtype", "reduce_dtype", "model.use_fp8", "model.fp8_wgrad", *FP8)
# The same model computed by other kernels: the numerics change, the weights mean the same.
KERNELS = ("model.use_te_layers", "model.efficient_attn", "optim.fused")
# Read from the config as they are; compute_dtype (null = per device) and the decay end (null = steps)
# are resolved first. The amax history's length is its checkpointed shape: it cannot change.
_AS_CONFIGURED = (*ARCHITECTURE, *SCHEDULE, *PRECISION[1:], *KERNELS, "model.fp8_amax_history_len", "seq_len",
                  "seed", "data.held_out_fraction", "eval.steps")
# Keys newer than some checkpoints: absent from an older fingerprint means what was then in force (the
# defaults; no held-out split; one source).
_ABSENT_MEANS_DEFAULT = {key: get_key(TrainConfig(), key) for key in (
    *FP8, *KERNELS, "model.fp8_amax_history_len", "model.rope_scaling", "model.intermediate_size", "optim.decay_style",
    "optim.decay_start", "model.tie_embeddings")} | {
    "data.held_out_fraction": 0.0, "data.weights": [1.0]}
# Keys newer than some checkpoints whose old value cannot be known: not compared when absent.
_ABSENT_MEANS_UNKNOWN = ("data_sha256", "data_sample", "eval.steps")
# fp8's own settings: compared only while saved fp8 scaling state carries over (fp8 on before and now).
_FP8_DETAILS = (*FP8, "model.fp8_wgrad", "model.fp8_amax_history_len")
# Keys a resume may change when the user names them in resume.allow_changed.
ALLOWABLE = (*SCHEDULE, "optim.decay_steps", *PRECISION, *KERNELS, "eval.steps")
_FORMAT_HINT = ("the checkpoint's fp8 scales were computed for the old format's range and would quantize the "
                "first resumed step wrongly (an E5M2 gradient scale overflows E4M3)")
_HINTS = {
    "optim.decay_steps": "where the LR decay ends: optim.decay_steps, or steps when unset; pass "
                         "optim.decay_steps={old} to continue the same schedule",
    "tokenizer": "data.tokenizer changed (or, with data.tokenizer=null, the tokenizer.model of "
                 "checkpoint.init_from_hf, or the tokenizer trained for data.source)",
    "eval.steps": "eval_loss averages this many held-out batches: another count measures another subset",
    "data": "data.source (or its packed tokens) changed",
    "data.weights": "the blend's shares changed: data.weights, or with data.weights=null the sources' token counts",
    "data_sample": "data.source (or its packed tokens) changed",
    "data_sha256": "data.source (or its packed tokens) changed",
    "model.vocab_size": "the model's rows, which make_vocab_size_divisible_by rounds up to a multiple of it x "
                        "model_parallel_size: to resume a padded run on another layout, pass "
                        "make_vocab_size_divisible_by=null model.vocab_size={old}",
    "global_batch_size": "batch_size is per data-parallel rank: to resume on another layout, set batch_size so "
                         "that batch_size x dp_shard x dp_replicate stays {old}",
}


def config_fingerprint(cfg: TrainConfig, compute_dtype: str, global_batch: int) -> dict[str, Any]:
    """The part of the fingerprint known before the data is prepared."""
    # With min_lr_ratio=1 the LR stays constant after warmup: there is no decay end for a resume to keep
    # (and optim.decay_steps is refused then), so extending such a run changes nothing it could compare.
    decay_end = {"optim.decay_steps": cfg.optim.decay_end(cfg.steps)} if cfg.optim.decays else {}
    # make_vocab_size_divisible_by pads the tokenizer's size: the model's vocabulary is known only once the
    # data is (model.valid_vocab_size set), and compared then; the key itself is no part of the model.
    vocabulary_unknown = cfg.make_vocab_size_divisible_by is not None and cfg.model.valid_vocab_size is None
    keys = [key for key in _AS_CONFIGURED if not (vocabulary_unknown and key == "model.vocab_size")]
    return {key: _as_json(get_key(cfg, key)) for key in keys} | decay_end | {
        "compute_dtype": compute_dtype,
        "global_batch_size": global_batch,
    }


def _as_json(value: Any) -> Any:
    """A group (model.rope_scaling) as the JSON object fingerprint.json stores, so it compares equal read back."""
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value


def run_fingerprint(cfg: TrainConfig, compute_dtype: str, global_batch: int, tokenizer_sha256: str,
                    data: dict[str, str]) -> dict[str, Any]:
    return config_fingerprint(cfg, compute_dtype, global_batch) | {"tokenizer": tokenizer_sha256[:16], **data}


def write_fingerprint(folder: Path, fingerprint: dict[str, Any]) -> Path:
    path = folder / FINGERPRINT_FILE
    path.write_text(json.dumps(fingerprint, indent=1, sort_keys=True))
    return path


def check_resumable(checkpoint: Path, current: dict[str, Any], allowed: list[str]) -> list[str]:
    """Refuse, in one line, a resume that would silently change the run; returns the changes
    `allowed` lets through ("optim.lr 0.003 -> 0.001"), for the log."""
    try:
        saved = json.loads((checkpoint / FINGERPRINT_FILE).read_text())
        if not isinstance(saved, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        raise ConfigError(f"checkpoint {checkpoint} has no readable {FINGERPRINT_FILE} ({e.__class__.__name__}: "
                          f"{str(e).splitlines()[0][:80]}); it was not written by this trainer, or is damaged")
    current = {key: value for key, value in current.items() if key in saved or key not in _ABSENT_MEANS_UNKNOWN}
    saved = _ABSENT_MEANS_DEFAULT | saved
    fp8_state_carries_over = bool(saved.get("model.use_fp8") and current.get("model.use_fp8"))
    if not fp8_state_carries_over:
        # fp8 off before or now: no scaling state is loaded, so how fp8 was or is set up changes nothing
        # a resume carries over (and with fp8 off those keys must keep their defaults).
        current = {key: value for key, value in current.items() if key not in _FP8_DETAILS}
    # The fp8 format may change only where no saved scales carry over.
    refused = {"model.fp8_format"} if fp8_state_carries_over else set()
    differs = [key for key in current if saved.get(key) != current[key]]
    same_lrs = _decay_end_changes_no_lr_used(checkpoint, saved, current)
    changed = [key for key in differs if (key not in allowed or key in refused)
               and not (key == "optim.decay_steps" and same_lrs)]
    if not changed:
        return [f"{key} {saved.get(key)!r} -> {current[key]!r}"
                + (f" ({same_lrs})" if key == "optim.decay_steps" and same_lrs else "") for key in differs]
    parts = []
    for key in changed:
        hint = _FORMAT_HINT if key in refused else _hint(key, saved, current)
        parts.append(f"{key} {saved.get(key)!r} -> {current[key]!r}" + (f" ({hint})" if hint else ""))
    allowable = all(key in ALLOWABLE and key not in refused for key in changed)
    remedy = f"; to change it anyway pass resume.allow_changed=[{','.join(changed)}]" if allowable else ""
    raise ConfigError(
        f"resuming from {checkpoint} would change the run: {'; '.join(parts)}. Use a new dump_dir for a "
        f"different run{remedy}"
    )


def _decay_end_changes_no_lr_used(checkpoint: Path, saved: dict[str, Any], current: dict[str, Any]) -> str:
    """Why a moved decay end changes no LR the checkpoint's steps used ("" if it does, or is not known):
    every step up to where the decay starts (the end of warmup, or optim.decay_start) has the same LR
    whatever the end (trainer/optimizer.py lr_at), so a run that stopped there may be extended."""
    taken = _step_of(checkpoint)
    old, new = saved.get("optim.decay_steps"), current.get("optim.decay_steps")
    if taken is None or not isinstance(old, int) or not isinstance(new, int):
        return ""  # a constant-LR run gaining a decay is optim.min_lr_ratio's change
    starts = [fp.get("optim.decay_start") if fp.get("optim.decay_start") is not None else fp.get("optim.warmup_steps")
              for fp in (saved, current)]
    if not all(isinstance(start, int) for start in starts) or taken > min(starts):
        return ""
    return (f"accepted: the checkpoint's {taken} steps all came before the LR decay, which starts after step "
            f"{min(starts)}, so every LR they used stays the same")


def _step_of(checkpoint: Path) -> int | None:
    """The step of a step_N checkpoint folder; None for any other name."""
    prefix, _, number = checkpoint.name.partition("_")
    return int(number) if prefix == "step" and number.isdigit() else None


def _hint(key: str, saved: dict[str, Any], current: dict[str, Any]) -> str:
    old = saved.get(key)
    if key == "optim.decay_steps" and old is None:
        return "the saved run held its LR constant (optim.min_lr_ratio=1): it has no decay end to continue"
    if key == "optim.decay_steps" and old < current.get("optim.warmup_steps", 0):
        # Such a schedule ended inside its warmup: there is no decay to continue (validate refuses it).
        return (f"where the LR decay ends: the saved run ended at step {old}, inside the warmup of "
                f"{current['optim.warmup_steps']} steps configured now, so there is no decay to continue")
    return _HINTS.get(key, "").format(old=old)
