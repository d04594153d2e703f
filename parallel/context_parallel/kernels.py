"""The fused kernels a chunk pair of context parallelism runs: torch's SDPA ops that return the rows'
log-sum-exp, forward and backward, as torch.distributed.tensor.experimental's context parallelism calls
them. The block merge and its backward (lse.py) need exactly that: each pair's output with its
log-sum-exp, and each pair's gradients from the FINAL output and log-sum-exp of the queries.

`model.efficient_attn` picks the kernel (`pair_kernel`): on CUDA `flash`, `cutlass` (the memory-efficient
kernel) or `cudnn`, and `sdpa` takes flash for bf16/fp16 and the memory-efficient kernel for fp32 (flash
has no fp32). Flash takes no mask: a pair with a block_causal document mask runs the memory-efficient
kernel. On CPU every name but `math` runs torch's CPU flash kernel (the only fused one CPU has), and
`math` is the plain fp32 formula (lse.py) on any device.

Dropout is always 0, so the random-state tensors the backward ops take are never read: empty ones stand
in for the forward's. A variable-length batch's cumulative lengths are undefined for dense inputs (None).
"""

import torch

aten = torch.ops.aten
_LSE_ALIGNMENT = 32  # the memory-efficient kernel's log-sum-exp rows are padded to this many queries
_BIAS_ALIGNMENT = 16  # its bias rows must start 16 elements apart


def pair_kernel(name: str, device: torch.device, dtype: torch.dtype, masked: bool) -> str:
    """The kernel a chunk pair runs: math | cpu_flash | flash | cutlass | cudnn."""
    if name == "math":
        return "math"
    if device.type == "cpu":
        return "cpu_flash"
    if name == "sdpa":
        name = "flash" if dtype in (torch.float16, torch.bfloat16) else "cutlass"
    return "cutlass" if name == "flash" and masked else name


def fused_forward(kernel: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(output in q's dtype, log-sum-exp [b, heads, s_q] fp32) of one pair; `bias` [b, 1, s_q, s_k] additive."""
    if kernel == "cpu_flash":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=bias)
    elif kernel == "flash":
        out, lse = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)[:2]
    elif kernel == "cutlass":
        out, lse = aten._scaled_dot_product_efficient_attention(q, k, v, _aligned(bias, q), True, 0.0, causal)[:2]
    elif kernel == "cudnn":
        out, lse = aten._scaled_dot_product_cudnn_attention(q, k, v, _aligned(bias, q), True, 0.0, causal)[:2]
    else:
        raise ValueError(f"no fused attention kernel {kernel!r}")
    b, heads, rows, _ = q.shape
    return out, lse.reshape(b, heads, -1)[..., :rows].float()  # cuDNN's has a trailing 1, cutlass's is padded


def fused_backward(kernel: str, grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, causal: bool,
                   bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of one pair given the queries' final output (q's dtype) and log-sum-exp (fp32)."""
    if kernel == "cpu_flash":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, 0.0, causal, attn_mask=bias)
    unused = torch.empty((), dtype=torch.int64, device=q.device)  # the random state: dropout is 0
    rows, cols = q.shape[2], k.shape[2]
    if kernel == "flash":
        return aten._scaled_dot_product_flash_attention_backward(
            grad_out, q, k, v, out, lse.contiguous(), None, None, rows, cols, 0.0, causal, unused, unused)
    if kernel == "cutlass":
        padded = -(-rows // _LSE_ALIGNMENT) * _LSE_ALIGNMENT
        lse = torch.nn.functional.pad(lse, (0, padded - rows)).contiguous()
        return aten._scaled_dot_product_efficient_attention_backward(
            grad_out, q, k, v, _aligned(bias, q), out, lse, unused, unused, 0.0, [True, True, True, False],
            causal)[:3]
    if kernel == "cudnn":
        return aten._scaled_dot_product_cudnn_attention_backward(
            grad_out, q, k, v, out, lse.unsqueeze(-1).contiguous(), unused, unused, _aligned(bias, q), None, None,
            rows, cols, 0.0, causal)
    raise ValueError(f"no fused attention kernel {kernel!r}")


def _aligned(bias: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor | None:
    """The bias broadcast over heads, its rows 16 elements apart (a view into a padded buffer), as the
    public SDPA hands it to the CUDA kernels."""
    if bias is None:
        return None
    b, _, rows, cols = bias.shape
    padded = -(-cols // _BIAS_ALIGNMENT) * _BIAS_ALIGNMENT
    buffer = torch.zeros(b, 1, rows, padded, dtype=bias.dtype, device=bias.device)
    buffer[..., :cols] = bias
    return buffer[..., :cols].expand(b, q.shape[1], rows, cols)
