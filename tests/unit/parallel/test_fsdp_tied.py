"""A tied weight under FSDP: a unit whose gather spans the whole model serves a weight that two modules
read (ZeRO-2 and ZeRO-3 alike); units holding copies of one weight lay it out alike for every shard
group, so that their shards hold the same elements; and a copy goes into checkpoints under the
weight's name, written by the weight's own holder only."""

import pytest
import torch
from torch import nn

from model.args import ModelArgs
from model.init import init_weights
from model.transformer import Transformer
from parallel.fsdp import FSDPConfig, fully_shard
from parallel.fsdp.flat_param import FlatParamSpec
from parallel.fsdp.grad_sync import ParamGradSink
from parallel.fsdp.state_dict import TPSplit, boxed_parameters

TIED = ModelArgs(n_layers=2, dim=32, n_heads=4, n_kv_heads=2, vocab_size=48, max_seq_len=8, tie_embeddings=True)


@pytest.mark.parametrize("reshard_after_forward, fusion", [(True, False), (False, False), (True, True)])
def test_a_unit_spanning_the_model_serves_the_weight_both_modules_read(world, monkeypatch, reshard_after_forward,
                                                                       fusion):
    """With gradient_accumulation_fusion the head's GEMM (its weight reaches the head unit routed through
    its end-of-backward function, sink and all) writes the slice and the embedding's gradient is added to
    it: autograd's order for a leaf read twice, so the same bits."""
    reference, model = Transformer(TIED), Transformer(TIED)
    init_weights(reference, TIED, seed=1)
    init_weights(model, TIED, seed=1)
    cfg = FSDPConfig(reshard_after_forward=reshard_after_forward, gradient_accumulation_fusion=fusion)
    root = fully_shard(model, ["tok_embeddings", "layers.0", "layers.1", "head"], world, None, cfg,
                       spans={"tok_embeddings": ""})
    tokens = torch.randint(0, TIED.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    products, add_product = [], ParamGradSink.add_product
    monkeypatch.setattr(ParamGradSink, "add_product", lambda sink, *rows: (products.append(sink.unit_ref().name),
                                                                          add_product(sink, *rows)))
    for m in (reference, model):
        m(tokens).logsumexp(-1).sum().backward()
    root.finish_gradient_sync()
    assert products.count("tok_embeddings") == fusion and len(products) == (4 * TIED.n_layers + 1) * fusion
    weight = reference.tok_embeddings.weight
    assert torch.equal(root.units[0].flat_param.grad[: weight.numel()].view_as(weight), weight.grad)


class Embedding(nn.Module):
    def __init__(self, vocab: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(vocab, dim))


class Head(nn.Module):
    def __init__(self, vocab: int, dim: int):
        super().__init__()
        self.norm, self.output = nn.LayerNorm(dim, bias=False), Embedding(vocab, dim)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7])
def test_units_holding_copies_of_a_weight_shard_it_alike(world_size):
    head = Head(48, 32)
    head_numel = sum(p.numel() for p in head.parameters())
    copy = FlatParamSpec.of_module(head, world_size, first="output.weight")
    original = FlatParamSpec.of_module(Embedding(48, 32), world_size, first="weight", min_numel=head_numel)
    assert copy.names == ("output.weight", "norm.weight") and copy.offsets()[0] == original.offsets()[0] == 0
    assert copy.shard_size == original.shard_size and original.total == 48 * 32


def test_a_copy_is_stored_under_the_weights_name_and_written_by_its_holder_only():
    spec = FlatParamSpec.of_module(Head(48, 32), 1, first="output.weight")
    splits = (TPSplit(0), TPSplit())
    boxed = boxed_parameters("head", spec, splits, 0, 0, 1, torch.zeros(spec.shard_size),
                             aliases={"output.weight": "tok_embeddings.weight"})
    assert set(boxed) == {"tok_embeddings.weight", "head.norm.weight"}
    assert boxed["tok_embeddings.weight"].__create_write_items__("model.tok_embeddings.weight", None) == []
    assert boxed["head.norm.weight"].__create_write_items__("model.head.norm.weight", None)
