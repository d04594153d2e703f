"""What TransformerEngine blocks (model.use_te_layers=true, model/te.py) need and cannot be combined with,
checked before anything is built."""

import importlib.util

import torch

from parallel.errors import ConfigError
from trainer.config.schema import TrainConfig

TE_MIN_MAJOR = 2  # as the te extra in pyproject.toml requires


def check_te_combinations(cfg: TrainConfig) -> None:
    """What TransformerEngine blocks cannot be combined with (model/te.py)."""
    m = cfg.model
    if cfg.grad_reduce != "last_microbatch":
        raise ConfigError("model.use_te_layers=true needs grad_reduce=last_microbatch: TE accumulates weight gradients "
                          "into FSDP's per-step fp32 accumulator (fuse_wgrad_accumulation)")
    if m.fp8_all_gather:
        raise ConfigError("model.fp8_all_gather=true gathers the in-tree fp8 GEMMs' weights; with "
                          "model.use_te_layers=true TransformerEngine casts its own (set it to false)")
    if m.use_fp8 and cfg.nan_policy == "skip":
        raise ConfigError("nan_policy=skip with model.use_te_layers=true model.use_fp8=true is not supported: a "
                          "skipped step's amaxes would stay in TransformerEngine's history (use nan_policy=halt)")
    if m.use_fp8 and not m.fp8_wgrad:
        raise ConfigError("model.fp8_wgrad=false with model.use_te_layers=true is not supported: TransformerEngine 2.x "
                          "computes every weight gradient of its fp8 GEMMs in fp8 (the in-tree fp8 offers it)")
    if m.use_fp8 and m.layer_ckpt == "full":
        raise ConfigError("model.layer_ckpt=full with model.use_te_layers=true model.use_fp8=true is not supported: "
                          "the recompute would run TE's fp8 modules outside TE's autocast (use layer_ckpt=selective)")


def check_transformer_engine(cfg: TrainConfig) -> None:
    install = "install it on a CUDA machine with: pip install -e '.[te]'"
    if not torch.cuda.is_available():
        raise ConfigError(f"model.use_te_layers=true needs CUDA and TransformerEngine; this machine has no CUDA "
                          f"device (use the in-tree fp8 with model.use_te_layers=false, or {install})")
    if importlib.util.find_spec("transformer_engine") is None:
        raise ConfigError(f"model.use_te_layers=true needs TransformerEngine, which is not installed: {install}")
    import transformer_engine

    version = getattr(transformer_engine, "__version__", "0")
    if int(version.split(".")[0]) < TE_MIN_MAJOR:
        raise ConfigError(f"model.use_te_layers=true needs TransformerEngine {TE_MIN_MAJOR}.0 or later (its scaling "
                          f"state and recipe as model/te.py uses them); the installed one is {version}: {install}")
