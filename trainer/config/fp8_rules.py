"""fp8 rules beyond the GEMM shapes (rules.py): what TransformerEngine checks of a sequence-parallel
input only at its first forward, and the device's fp8 support, known only once the device is chosen.
Each fails before step 1 with one line instead of inside TE's autocast or torch._scaled_mm."""

import torch

from parallel.errors import ConfigError
from trainer.config.schema import TrainConfig

FP8_MIN_CAPABILITY = (8, 9)  # fp8 tensor cores: Ada (sm89), Hopper (sm90) and later
TE_FP8_ROWS, TE_FP8_COLUMNS = 8, 16  # TE's divisibility of a 2-D fp8 GEMM input (assert_dim_for_fp8_exec)


def check_te_sequence_parallel(cfg: TrainConfig) -> None:
    """Under SP, TE's LayerNormLinear checks its LOCAL input, before the sequence gather: [tokens of one
    microbatch / cp / tp, model.dim] must divide by (8, 16) for fp8 (tp=4 seq_len=48: 12 rows)."""
    m, tp = cfg.model, cfg.model_parallel_size
    if not (m.use_te_layers and m.use_fp8 and m.sequence_parallel and tp > 1):
        return
    rows = cfg.microbatch_size * cfg.seq_len // cfg.context_parallel_size // tp
    for what, size, multiple in (("microbatch_size x seq_len / context_parallel_size / model_parallel_size", rows,
                                  TE_FP8_ROWS), ("model.dim", m.dim, TE_FP8_COLUMNS)):
        if size % multiple:
            raise ConfigError(
                f"model.use_te_layers=true model.use_fp8=true model.sequence_parallel=true needs the local input of "
                f"TransformerEngine's sequence-parallel LayerNormLinear (before its gather) divisible as TE requires: "
                f"{what} = {size} is not a multiple of {multiple}")


def check_fp8_device(cfg: TrainConfig, device: torch.device) -> None:
    """fp8 GEMMs on CUDA need sm89 or newer (on CPU the in-tree fp8 emulates them)."""
    if not cfg.model.use_fp8 or device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_MIN_CAPABILITY:
        major, minor = capability
        raise ConfigError(
            f"model.use_fp8=true needs a GPU of compute capability {FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]} or "
            f"newer (fp8 tensor cores: Ada, Hopper and later); {torch.cuda.get_device_name(device)} ({device}) is "
            f"sm{major}{minor}: set model.use_fp8=false")
