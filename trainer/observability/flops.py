"""Model FLOPs per token (the PaLM/Megatron convention) and the detected device's peak, for TFLOP/s and MFU."""

import torch

from model.args import ModelArgs

# Dense bf16 tensor-core peaks (FLOP/s) by device-name fragment, most specific first.
_PEAK_BF16 = (
    ("H200 NVL", 835.5e12),
    ("H200", 989.5e12),
    ("H100 NVL", 835.5e12),
    ("H100 PCIe", 756.0e12),
    ("H100", 989.5e12),
    ("A100", 312.0e12),
    ("L40S", 362.0e12),
    ("A10G", 70.0e12),
)


def matmul_params(args: ModelArgs) -> int:
    """Parameters that take part in a matmul per token: all but the embedding table and norms."""
    attn = args.dim * args.head_dim * (2 * args.n_heads + 2 * args.n_kv_heads)
    ffn = 3 * args.dim * args.ffn_hidden_dim
    return args.n_layers * (attn + ffn) + args.dim * args.vocab_size


def training_flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """6N (forward + backward matmuls) plus 12 * layers * (heads * head_dim) * seq for attention scores
    and values.

    The attention term counts the full seq x seq product, as PaLM and Megatron do, although causal
    masking makes half of it unnecessary.
    """
    return 6.0 * matmul_params(args) + 12.0 * args.n_layers * args.n_heads * args.head_dim * seq_len


def device_peak_flops(device: torch.device) -> float | None:
    """Peak bf16 FLOP/s of a known CUDA device, None elsewhere (no MFU on CPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for fragment, peak in _PEAK_BF16:
        if fragment in name:
            return peak
    return None
