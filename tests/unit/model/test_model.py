"""The Llama-style model: attention kernels agree, init is layout-independent, shapes and sizing."""

import torch

from model.args import ModelArgs
from model.attention import causal_attention
from model.init import full_init_value, init_weights
from model.transformer import Transformer

ARGS = ModelArgs(n_layers=2, dim=64, n_heads=4, n_kv_heads=2, vocab_size=97, max_seq_len=16)


def test_sdpa_matches_math_reference_with_gqa():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 16, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(2, 2, 16, 8, generator=gen, dtype=torch.float64)
    v = torch.randn(2, 2, 16, 8, generator=gen, dtype=torch.float64)
    # In fp64 the reference's softmax stays fp64 (an fp32 one was 1.5e-7 off: too coarse to check a kernel).
    torch.testing.assert_close(causal_attention(q, k, v, "sdpa"), causal_attention(q, k, v, "math"),
                               rtol=1e-12, atol=1e-12)


def test_attention_is_causal():
    model = Transformer(ARGS)
    init_weights(model, ARGS, seed=0)
    tokens = torch.randint(0, ARGS.vocab_size, (1, 16))
    changed = tokens.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % ARGS.vocab_size
    out_a, out_b = model(tokens), model(changed)
    torch.testing.assert_close(out_a[:, :10], out_b[:, :10])
    assert not torch.allclose(out_a[:, 10:], out_b[:, 10:])


def test_init_depends_only_on_seed_and_name():
    a, b = Transformer(ARGS), Transformer(ARGS)
    torch.manual_seed(123)  # the global RNG must not matter
    init_weights(a, ARGS, seed=7)
    init_weights(b, ARGS, seed=7)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    # A model holding only some blocks (a pipeline stage) gets the very same block weights.
    one_block = ModelArgs(**{**ARGS.__dict__, "n_layers": 2})
    c = Transformer(one_block)
    del c.layers["0"]
    init_weights(c, one_block, seed=7)
    assert torch.equal(c.layers["1"].attention.wqkv.weight, a.layers["1"].attention.wqkv.weight)
    other_seed = full_init_value("layers.1.attention.wqkv.weight", a.layers["1"].attention.wqkv.weight.shape, ARGS, 8)
    assert not torch.equal(other_seed, a.layers["1"].attention.wqkv.weight)


def test_init_stds():
    model = Transformer(ARGS)
    init_weights(model, ARGS, seed=0)
    assert torch.equal(model.head.norm.weight, torch.ones(ARGS.dim))
    assert abs(model.tok_embeddings.weight.std().item() - 0.986) < 0.05  # N(0,1) truncated at 3 sigma
    assert model.layers["0"].attention.wo.weight.std().item() < model.layers["0"].attention.wqkv.weight.std().item()


def test_logits_shape_and_ffn_sizing():
    model = Transformer(ARGS)
    assert model(torch.zeros(3, 5, dtype=torch.long)).shape == (3, 5, ARGS.vocab_size)
    assert model.layers["0"].feed_forward.w13.weight.shape == (2 * ARGS.ffn_hidden_dim, ARGS.dim)
    assert ARGS.ffn_hidden_dim % ARGS.multiple_of == 0
    llama3_8b = ModelArgs(dim=4096, ffn_dim_multiplier=1.3, multiple_of=1024)
    assert llama3_8b.ffn_hidden_dim == 14336


def test_rotary_uses_global_positions():
    """Context parallelism passes each rank's global positions: a uniform shift changes nothing
    (RoPE is relative), spreading the positions apart does."""
    model = Transformer(ARGS)
    init_weights(model, ARGS, seed=0)
    tokens = torch.randint(0, ARGS.vocab_size, (1, 8))
    base = model(tokens)
    shifted = (base - model(tokens, positions=torch.arange(8) + 5)).abs().max().item()
    spread = (base - model(tokens, positions=torch.arange(8) * 2)).abs().max().item()
    assert shifted < 1e-6 and spread > 100 * max(shifted, 1e-7), (shifted, spread)


def _saved_bytes(args: ModelArgs, layer_ckpt: str) -> int:
    """Bytes autograd keeps for backward after one forward (what activation checkpointing frees)."""
    from trainer.parallelize import apply_activation_checkpointing

    model = Transformer(args)
    init_weights(model, args, seed=0)
    if layer_ckpt != "none":
        apply_activation_checkpointing(model, layer_ckpt)
    params = {p.data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(torch.randint(0, args.vocab_size, (2, args.max_seq_len)))
    return sum(saved.values())


def test_selective_checkpointing_frees_the_attention_scores_and_full_frees_more():
    """selective recomputes the attention core: with efficient_attn=math it frees the [b, h, s, s]
    scores of every layer; with sdpa the core keeps only its log-sum-exp, so it frees almost nothing
    (what the docs say: use full there). full keeps only each block's input."""
    math_args = ModelArgs(**{**ARGS.__dict__, "efficient_attn": "math", "max_seq_len": 64})
    none, selective, full = (_saved_bytes(math_args, mode) for mode in ("none", "selective", "full"))
    scores = math_args.n_layers * 2 * math_args.n_heads * 64 * 64 * 4  # one fp32 [b, h, s, s] per layer
    assert none - selective >= 0.75 * scores and full < selective / 2, (none, selective, full)
    sdpa_args = ModelArgs(**{**ARGS.__dict__, "max_seq_len": 64})
    sdpa_none, sdpa_selective = _saved_bytes(sdpa_args, "none"), _saved_bytes(sdpa_args, "selective")
    assert sdpa_none - sdpa_selective < 0.01 * sdpa_none, (sdpa_none, sdpa_selective)
