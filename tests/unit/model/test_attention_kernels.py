"""model.efficient_attn by name on CPU: each kernel CPU has (sdpa, flash, math) against the plain formula
(causal with grouped K/V, and a block_causal mask), forward and gradients; the kernels CPU lacks (cutlass,
cudnn) are one line naming the device at build time, before any step."""

import pytest
import torch

from model.attention import block_causal_mask, causal_attention
from model.attention_kernels import KERNELS, PINNED, check_attention_kernel
from parallel.errors import ConfigError
from tests.distributed.pipeline_cases import config, make_trainer

CPU = torch.device("cpu")
CPU_HAS = ("sdpa", "flash", "math")
CPU_LACKS = ("cutlass", "cudnn")


def _qkv() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shapes = [(2, 4, 12, 8), (2, 2, 12, 8), (2, 2, 12, 8)]  # 4 query heads share 2 KV heads
    return [torch.randn(s, generator=gen, dtype=torch.float64).float().requires_grad_() for s in shapes]


def _attention_and_grads(impl: str, mask: torch.Tensor | None) -> list[torch.Tensor]:
    q, k, v = _qkv()
    out = causal_attention(q, k, v, impl, mask)
    out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
    return [out.detach(), q.grad, k.grad, v.grad]


def test_every_name_is_a_kernel_cpu_has_or_lacks():
    assert set(CPU_HAS + CPU_LACKS) == set(KERNELS) and set(PINNED) == {"flash", "cutlass", "cudnn"}


@pytest.mark.parametrize("impl", CPU_HAS)
@pytest.mark.parametrize("masked", [False, True])
def test_kernels_cpu_has_match_the_plain_formula(impl, masked):
    ids = torch.tensor([[0] * 5 + [1] * 7, [0] * 12])
    mask = block_causal_mask(ids) if masked else None
    check_attention_kernel(impl, CPU, torch.float32, 4, 2, 8, masked)  # CPU has it: no error
    reference = _attention_and_grads("math", mask)
    for got, want in zip(_attention_and_grads(impl, mask), reference, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", CPU_LACKS)
def test_kernels_cpu_lacks_are_one_line_naming_the_device(impl):
    with pytest.raises(ConfigError) as err:
        check_attention_kernel(impl, CPU, torch.float32, 4, 2, 8, False)
    message = str(err.value)
    assert message.startswith(f"model.efficient_attn={impl}: this device (cpu) has no {impl} attention kernel")
    assert "\n" not in message


def test_the_trainer_refuses_a_missing_kernel_before_building(world):
    with pytest.raises(ConfigError, match=r"^model.efficient_attn=cutlass: this device \(cpu\)"):
        make_trainer(config(model={"efficient_attn": "cutlass"}), 1)
    trainer = make_trainer(config(model={"efficient_attn": "flash", "n_layers": 2}), 1)
    assert trainer.train_step(1).loss > 0
