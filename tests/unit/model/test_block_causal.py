"""model.attn_bias_type=block_causal: attention stays inside each packed document. The references are
computed another way: each document's attention (or whole model) run on that document alone."""

import numpy as np
import pytest
import torch

from model import attention
from model.args import ModelArgs
from model.attention import Documents, attention_bias, block_causal_mask, causal_attention
from model.init import init_weights
from model.transformer import Transformer
from trainer.data.loader import BatchLoader

BOS = 1
# A window that opens inside a document (its tail is document 0), a one-token document, a longer one.
DOCUMENT_LENGTHS = (3, 1, 5, 7)
ARGS = ModelArgs(n_layers=2, dim=32, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16, max_seq_len=16)


def _document_ids() -> torch.Tensor:
    return torch.cat([torch.full((n,), d) for d, n in enumerate(DOCUMENT_LENGTHS)])[None]


def _bounds() -> list[tuple[int, int]]:
    ends = np.cumsum(DOCUMENT_LENGTHS).tolist()
    return list(zip([0, *ends[:-1]], ends))


@pytest.mark.parametrize("impl", ["sdpa", "math"])
def test_block_causal_attention_equals_each_document_attended_alone(impl):
    torch.manual_seed(0)
    seq = sum(DOCUMENT_LENGTHS)
    q = torch.randn(1, 4, seq, 8, requires_grad=True)
    k, v = (torch.randn(1, 2, seq, 8, requires_grad=True) for _ in range(2))
    out = causal_attention(q, k, v, impl, block_causal_mask(_document_ids()))
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    for start, end in _bounds():
        alone_q, alone_k, alone_v = (t.detach()[:, :, start:end].requires_grad_() for t in (q, k, v))
        alone = causal_attention(alone_q, alone_k, alone_v, "math")
        alone_grads = torch.autograd.grad(alone.square().sum(), (alone_q, alone_k, alone_v))
        torch.testing.assert_close(out[:, :, start:end], alone, rtol=1e-5, atol=1e-6)
        for grad, want in zip(grads, alone_grads):
            torch.testing.assert_close(grad[:, :, start:end], want, rtol=1e-5, atol=1e-5)


def test_a_packed_document_gets_the_logits_it_gets_alone_and_plain_causal_does_not():
    """Rotary scores depend on relative positions only, so with the mask a document's logits do not
    depend on where in the sequence it sits, nor on what precedes it."""
    model = Transformer(ARGS)
    init_weights(model, ARGS, seed=3)
    tokens = torch.randint(2, ARGS.vocab_size, (1, sum(DOCUMENT_LENGTHS)))
    with torch.no_grad():
        packed = model(tokens, document_ids=_document_ids())
        plain = model(tokens)
        for start, end in _bounds():
            alone = model(tokens[:, start:end])
            torch.testing.assert_close(packed[:, start:end], alone, rtol=1e-4, atol=1e-5)
    last_start = _bounds()[-1][0]
    assert (plain[:, last_start:] - packed[:, last_start:]).abs().max() > 1e-2  # the mask is not a no-op


EOS = 2


@pytest.mark.parametrize("window, eos, expected", [
    # the packer's `bos doc eos` runs; a window opening inside a document, a bos inside one (Megatron data
    # split into sentences by a tokenizer adding a bos to each), a one-token document
    ([7, EOS, BOS, 9, EOS, BOS, 5, BOS, 6, EOS, BOS, 3, EOS], EOS, [0, 0, 1, 1, 1, 2, 2, 2, 2, 2, 3, 3]),
    # bos and eos one token: the eos closing a document is not one of its own
    ([7, BOS, BOS, 9, 8, BOS, BOS, 5, BOS, BOS, 6], BOS, [0, 0, 1, 1, 1, 1, 2, 2, 2, 3]),
    ([BOS, 5, EOS, BOS, 6, EOS], EOS, [1, 1, 1, 2, 2]),  # a window opening at a document's bos
])
def test_document_ids_start_at_each_bos_after_an_eos(window: list[int], eos: int, expected: list[int]):
    class Windows:
        def sequence(self, index: int, seq_len: int) -> np.ndarray:
            return np.array(window)[: seq_len + 1]

    class OneWindow:
        global_batch_size = 1

        def rank_indices(self, step: int, rank: int, size: int) -> list[int]:
            return [0]

    seq_len = len(window) - 1
    loader = BatchLoader(Windows(), OneWindow(), seq_len, 0, 1, 1, document_start_id=BOS, document_end_id=eos)
    inputs, _ = loader.batch(0)[0]
    assert loader.document_ids(inputs).tolist() == [expected]
    with pytest.raises(ValueError, match="without the document tokens"):
        BatchLoader(Windows(), OneWindow(), seq_len, 0, 1, 1, document_start_id=BOS).document_ids(inputs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_shared_bias_gives_sdpa_bitwise_what_the_bool_mask_does(dtype):
    """The model hands SDPA one additive bias for every layer, made as SDPA makes it of the bool mask, which
    it did in each layer (a copy each that the memory-efficient and cuDNN kernels keep for the backward)."""
    torch.manual_seed(0)
    seq = sum(DOCUMENT_LENGTHS)
    mask = block_causal_mask(_document_ids())
    q = torch.randn(1, 4, seq, 8, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(1, 2, seq, 8, dtype=dtype, requires_grad=True) for _ in range(2))
    results = []
    for given in (mask, attention_bias(mask, dtype)):
        out = causal_attention(q, k, v, "sdpa", given)
        results.append([out, *torch.autograd.grad(out.square().sum(), (q, k, v))])
    for got, want in zip(*results):
        assert torch.equal(got, want)
    documents = Documents(_document_ids(), mask, attention_bias(mask, dtype))
    assert documents.mask_for(dtype, "sdpa") is documents.bias and documents.mask_for(dtype, "math") is mask
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    assert documents.mask_for(other, "sdpa") is mask  # another dtype: SDPA converts the bool mask itself


def test_the_model_builds_the_bias_once_in_its_blocks_dtype(monkeypatch):
    seen = []
    real = attention.causal_attention

    def spy(q, k, v, impl, mask=None):
        seen.append(mask)
        return real(q, k, v, impl, mask)

    monkeypatch.setattr(attention, "causal_attention", spy)
    model = Transformer(ARGS)
    init_weights(model, ARGS, seed=3)
    model(torch.randint(0, ARGS.vocab_size, (1, sum(DOCUMENT_LENGTHS))), document_ids=_document_ids())
    assert len(seen) == ARGS.n_layers and all(m is seen[0] for m in seen) and seen[0].dtype == torch.float32
