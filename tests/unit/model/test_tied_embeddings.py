"""model.tie_embeddings: with the embedding and the head in one chunk the model has one parameter for both,
named once, which both uses train; a chunk with the head alone holds a copy, which every layout
initializes with the embedding's values."""

import dataclasses

import torch

from model.args import ModelArgs
from model.init import ModelInitializer, init_weights
from model.transformer import Transformer

TIED = ModelArgs(n_layers=2, dim=64, n_heads=4, n_kv_heads=2, vocab_size=97, max_seq_len=16, tie_embeddings=True)


def test_one_chunk_has_one_parameter_named_once_that_both_uses_train():
    model = Transformer(TIED)
    names = [name for name, _ in model.named_parameters()]
    assert "tok_embeddings.weight" in names and "head.output.weight" not in model.state_dict()
    assert len(list(Transformer(dataclasses.replace(TIED, tie_embeddings=False)).parameters())) == len(names) + 1
    init_weights(model, TIED, seed=0)
    hidden = []
    model.head.register_forward_pre_hook(lambda module, args: hidden.append(args[0]))
    tokens = torch.tensor([[1, 2, 3, 4]])
    logits = model(tokens)
    torch.testing.assert_close(logits, model.head.norm(hidden[0]) @ model.tok_embeddings.weight.T)
    logits[0, -1, 50].backward()
    assert model.tok_embeddings.weight.grad[50].abs().sum() > 0  # the head's use: a token absent from the input
    assert model.tok_embeddings.weight.grad[1:5].abs().sum() > 0  # the embedding's use


def test_the_head_copy_of_a_later_stage_starts_as_the_embedding_in_every_layout():
    whole, last = Transformer(TIED), Transformer(TIED, layers=range(1, 2), embedding=False)
    init_weights(whole, TIED, seed=3)
    init_weights(last, TIED, seed=3)
    assert torch.equal(last.head.output.weight, whole.tok_embeddings.weight)
    # As FSDP builds a shard: a box of the copy is the same box of the embedding.
    init = ModelInitializer(TIED, seed=3, device=torch.device("cpu"))
    box = init.parameter_box("head.output.weight", (97, 64), (10, 5), (20, 30))
    assert torch.equal(box, whole.tok_embeddings.weight[10:30, 5:35])
    # Tied, the weight has the head's std (logits start as an untied head's), not the embedding's 1.
    assert abs(whole.tok_embeddings.weight.std().item() * 64**0.5 - 0.986) < 0.05
