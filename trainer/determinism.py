"""Deterministic-training switches: seeds, deterministic kernels, and the CUDA/NCCL settings.

The environment variables are set here, before the process group and any CUDA handle exist, because
cuBLAS and NCCL read them at initialization.
"""

import os
import random

import numpy as np
import torch

# NCCL algorithms whose reductions run in a fixed order (Megatron's deterministic mode allows the same);
# NVLS and NVLSTree reduce in the NVLink switch, and PAT is not among them: a user's choice of those is replaced.
_DETERMINISTIC_NCCL_ALGOS = {"ring", "tree", "collnetdirect", "collnetchain"}


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def enable_deterministic(device_type: str) -> None:
    if device_type == "cuda":
        # A user's own choice stays where it is deterministic: one fixed-order NCCL algorithm (a list,
        # "Tree,Ring", or an exclusion, "^Tree", lets NCCL pick per size), and torch itself refuses a
        # cuBLAS workspace setting that is not ":4096:8" or ":16:8".
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        # TransformerEngine (model.use_te_layers) otherwise may pick non-deterministic kernels.
        os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
        if os.environ.get("NCCL_ALGO", "").lower() not in _DETERMINISTIC_NCCL_ALGOS:
            os.environ["NCCL_ALGO"] = "Ring"
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True)
