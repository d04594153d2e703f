"""The attention kernel by name (`model.efficient_attn`): `sdpa` lets torch pick among its fused kernels,
`flash`, `cutlass` (the memory-efficient kernel, xformers' cutlass kernel in torch) and `cudnn` pin that
SDPA backend, and `math` is the plain formula (model/attention.py), the reference the others must match.

Which kernels exist depends on the device, the dtype and the head size (CPU has a flash kernel but neither
cutlass nor cuDNN; CUDA's flash needs fp16/bf16 and sm80+). `check_attention_kernel` runs the pinned
kernel once, forward and backward, on a few tokens of the run's device, dtype and head shapes at build
time, so a kernel this machine lacks is one line before step 1, not a failure inside it.
"""

import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from parallel.errors import ConfigError

PINNED = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "cutlass": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
}
KERNELS = ("sdpa", *PINNED, "math")
_PROBE_TOKENS = 16


def pinned_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, name: str,
                     mask: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA on [batch, heads, seq, head_dim] with only the kernel `name` allowed; k/v may have fewer
    (grouped) heads. Flash takes grouped K/V itself; the others get them expanded, and a mask, as they
    take one (flash takes none: block_causal with flash is refused by the build-time check)."""
    with sdpa_kernel(PINNED[name]):
        if name == "flash" and mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def check_deterministic_kernel(name: str, deterministic: bool) -> None:
    """cuDNN attention's backward is not deterministic: torch rules it out under deterministic algorithms
    (so the pinned kernel would read as missing), and context parallelism, which calls the kernel itself,
    would run it anyway. One line instead."""
    if deterministic and name == "cudnn":
        raise ConfigError("model.efficient_attn=cudnn with enable_deterministic_training=true: cuDNN attention's "
                          "backward is not deterministic (torch rules it out in deterministic mode); pin flash, "
                          "cutlass or math, or let sdpa pick")


def check_attention_kernel(name: str, device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int,
                           head_dim: int, masked: bool) -> None:
    """Raise one ConfigError line if the pinned kernel `name` cannot run attention of these shapes (per
    TP rank) with (`masked`: block_causal) or without a mask, forward and backward, on this device."""
    if name not in PINNED:
        return
    shape = (1, heads, _PROBE_TOKENS, head_dim)
    q = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(1, kv_heads, _PROBE_TOKENS, head_dim, device=device, dtype=dtype, requires_grad=True)
            for _ in range(2))
    mask = torch.ones(1, 1, _PROBE_TOKENS, _PROBE_TOKENS, dtype=torch.bool, device=device).tril() if masked else None
    try:
        with warnings.catch_warnings():  # torch warns once per kernel it rules out: the line below says it
            warnings.simplefilter("ignore")
            pinned_attention(q, k, v, name, mask).sum().backward()
    except RuntimeError:
        where = device.type if device.type == "cpu" else f"{torch.cuda.get_device_name(device)}, {device}"
        mask = " and a block_causal mask" if masked else ""
        raise ConfigError(
            f"model.efficient_attn={name}: this device ({where}) has no {name} attention kernel for "
            f"{str(dtype).removeprefix('torch.')} with head_dim {head_dim}{mask}; use sdpa (torch picks a kernel) "
            f"or math") from None
