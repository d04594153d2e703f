"""gradient_accumulation_fusion under FSDP units (a one-rank shard group): each linear weight's gradient
is one GEMM per microbatch into its slice of the fp32 accumulator, never a gradient tensor of its own;
the other parameters' gradients go the autograd way. The step's gradient is the unfused one's: bitwise
with one microbatch and with a reduction per microbatch; with bf16 compute nothing is fused;
within rounding over several microbatches (the later GEMMs add into the accumulator); bitwise the
same with optimize_backward_concat on and off, and with reshard_after_forward on and off."""

import pytest
import torch

from model.args import ModelArgs
from model.init import init_weights
from model.transformer import Transformer
from parallel.fsdp import FSDPConfig, fully_shard
from parallel.fsdp.grad_sync import ParamGradSink
from parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear

ARGS = ModelArgs(n_layers=2, dim=32, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16, max_seq_len=8)
UNITS = ["tok_embeddings", "layers.0", "layers.1", "head"]


def _linear_weights(model: Transformer) -> set[str]:
    return {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))}


def _step(world, monkeypatch, microbatches: int, sequences: int = 1, dtype=torch.float32, **cfg):
    """The flat gradients of one step, the parameters whose sinks took a GEMM (once per call), the
    linear weights. Each microbatch holds `sequences` sequences of 8 tokens."""
    model = Transformer(ARGS)
    init_weights(model, ARGS, seed=3)
    linears = _linear_weights(model)
    root = fully_shard(model, UNITS, world, None, FSDPConfig(compute_dtype=dtype, **cfg))
    products, add_product = [], ParamGradSink.add_product

    def spy(sink, grad_rows, input_rows):
        unit = sink.unit_ref()
        products.append(f"{unit.name}.{unit.spec.names[sink.index]}")
        add_product(sink, grad_rows, input_rows)

    monkeypatch.setattr(ParamGradSink, "add_product", spy)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, ARGS.vocab_size, (microbatches, sequences, 8), generator=gen)
    for mb, x in enumerate(tokens):
        root.set_microbatch(is_first=mb == 0, is_last=mb == microbatches - 1)
        model(x).float().logsumexp(-1).mean().backward()
    root.finish_gradient_sync()
    return [unit.flat_param.grad for unit in root.units], products, linears


def _bitwise(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("microbatches, sequences", [(1, 1), (3, 1), (3, 128)])  # 128 x 8 rows: split sums
def test_fused_accumulation_takes_each_linear_gemm_once_per_microbatch_and_keeps_the_gradient(
        world, monkeypatch, microbatches, sequences):
    plain, none, _ = _step(world, monkeypatch, microbatches, sequences, optimize_backward_concat=True)
    assert none == []
    fused, products, linears = _step(world, monkeypatch, microbatches, sequences, optimize_backward_concat=True,
                                     gradient_accumulation_fusion=True)
    assert len(linears) == 4 * ARGS.n_layers + 1  # wqkv, wo, w13, w2 per block; the head
    assert sorted(products) == sorted(list(linears) * microbatches)
    if microbatches == 1:
        assert _bitwise(plain, fused)
    for a, b in zip(plain, fused):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
    for options in (dict(optimize_backward_concat=False), dict(optimize_backward_concat=True, reshard_after_forward=False)):
        other, _, _ = _step(world, monkeypatch, microbatches, sequences, gradient_accumulation_fusion=True, **options)
        assert _bitwise(fused, other), options


@pytest.mark.parametrize("options", [dict(grad_reduce="per_microbatch"), dict(dtype=torch.bfloat16)])
def test_fused_accumulation_is_bitwise_where_every_gemm_writes_and_a_no_op_in_bf16(world, monkeypatch, options):
    plain, _, _ = _step(world, monkeypatch, 3, **options)
    fused, products, linears = _step(world, monkeypatch, 3, gradient_accumulation_fusion=True, **options)
    assert len(products) == (0 if "dtype" in options else 3 * len(linears)) and _bitwise(plain, fused)


def test_a_fused_gemm_after_the_units_backward_ended_is_refused(world):
    """A unit run twice in one forward: the inner call's GEMMs come after the outer call's backward
    ended, when the microbatch reduces."""
    model = Transformer(ARGS)
    init_weights(model, ARGS, seed=3)
    root = fully_shard(model, UNITS, world, None, FSDPConfig(gradient_accumulation_fusion=True))
    root.set_microbatch(is_first=True, is_last=True)
    h = model.tok_embeddings(torch.zeros(1, 8, dtype=torch.int64))
    cos, sin = model.rope(torch.arange(8), h.dtype)
    block = model.layers["0"]
    with pytest.raises(RuntimeError, match="a gradient arrived after the unit's backward ended") as refused:
        block(block(h, cos, sin), cos, sin).sum().backward()
    assert any(entry.name == "add_product" for entry in refused.traceback)  # the GEMM's, before the concat's
    root.reductions.drain()
