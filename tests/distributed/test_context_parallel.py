"""Context parallelism on gloo ranks. The attention against full single-rank attention: C in {2, 4},
both exchange modes, causal GQA, and block_causal documents; odd C = 3 with MQA (one KV head) (boundaries inside chunks and on chunk edges,
chunk pairs where queries see no key); outputs and dQ/dK/dV within 1e-5 (fp32); the ring's exact rotation
counts and one-block buffers from the ledger; equal causal work on every CP rank. Then the trainer's
step (fp32, 5 steps) with C = 2 and 4 in both modes, tp2 x cp2 with SP, pp2 x cp2 and HSDP x cp2
against the one-process losses and gradient norms within 1e-5."""

import torch
import torch.distributed as dist

from model.attention import block_causal_mask, causal_attention
from parallel import comm
from parallel.context_parallel import CPContext, context_parallel_attention
from tests.distributed.pipeline_cases import (
    assert_matches, config, read_references, train, write_references,
)
from tests.distributed.spawn import run_ranks

BATCH, HEADS, KV_HEADS, SEQ, HEAD_DIM = 2, 4, 2, 32, 8
# Per sequence: document starts (the first holds a document's tail). With C=4 a chunk is 4 tokens:
# starts at 8 and 24 fall on chunk edges, the others inside chunks; the second sequence is one document.
DOCUMENT_STARTS = ([3, 8, 9, 13, 20, 24, 31], [])


def _document_ids(seq: int = SEQ) -> torch.Tensor:
    ids = torch.zeros(BATCH, seq, dtype=torch.long)
    for row, starts in enumerate(DOCUMENT_STARTS):
        for start in starts:
            ids[row, start:] += 1
    return ids


def _reference(seed: int, document_ids: torch.Tensor | None = None, seq: int = SEQ, kv_heads: int = KV_HEADS
               ) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(BATCH, HEADS, seq, HEAD_DIM, generator=gen).requires_grad_()
    k = torch.randn(BATCH, kv_heads, seq, HEAD_DIM, generator=gen).requires_grad_()
    v = torch.randn(BATCH, kv_heads, seq, HEAD_DIM, generator=gen).requires_grad_()
    grad_out = torch.randn(BATCH, HEADS, seq, HEAD_DIM, generator=gen)
    out = causal_attention(q, k, v, "math", None if document_ids is None else block_causal_mask(document_ids))
    out.backward(grad_out)
    return [q, k, v], out.detach(), grad_out, [q.grad, k.grad, v.grad]


def _check_cp(cp: CPContext, label: str, document_ids: torch.Tensor | None = None, seq: int = SEQ,
              kv_heads: int = KV_HEADS) -> None:
    inputs, ref_out, grad_out, ref_grads = _reference(7, document_ids, seq, kv_heads)
    local = [cp.shard(t.detach(), dim=2).requires_grad_() for t in inputs]
    comm.LEDGER.reset()
    out = context_parallel_attention(*local, cp, document_ids)
    forward = comm.LEDGER.by_op()
    out.backward(cp.shard(grad_out, dim=2))
    torch.testing.assert_close(out, cp.shard(ref_out, dim=2), rtol=1e-5, atol=1e-5, msg=label)
    for name, got, want in zip("qkv", local, ref_grads):
        torch.testing.assert_close(got.grad, cp.shard(want, dim=2), rtol=1e-5, atol=1e-5, msg=f"{label} d{name}")
    if cp.comm_mode == "ring":
        backward = {op: {k: v - forward.get(op, {}).get(k, 0) for k, v in e.items()} for op, e in comm.LEDGER.by_op().items()}
        block_bytes = 2 * BATCH * kv_heads * (seq // cp.size) * HEAD_DIM * 4  # K and V of one rank's share, fp32
        assert forward["recv"] == {"count": cp.size - 1, "bytes": (cp.size - 1) * block_bytes}, (label, forward)
        assert backward["recv"]["count"] == (cp.size - 1) + cp.size, (label, backward)  # K/V again, then dK/dV
        assert backward["recv"]["bytes"] == (2 * cp.size - 1) * block_bytes, (label, backward)
        assert "all_gather" not in forward and "all_gather" not in backward
    else:
        assert forward["all_gather"]["count"] == 2 and "recv" not in forward  # K and V at n_kv_heads


def _check_all(rank: int, world: int) -> None:
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    three = dist.new_group([0, 1, 2])
    for size, group in ((2, pairs[rank // 2]), (4, dist.group.WORLD)):
        work = {}
        for mode in ("all_gather", "ring"):
            cp = CPContext(group, mode)
            _check_cp(cp, f"C={size} {mode}")
            work[mode] = cp.unmasked_pairs
        # Head-tail sharding: every rank computes the same number of unmasked (query, key) pairs per head.
        counts = comm.all_gather_object(work["ring"], group)
        assert len(set(counts)) == 1, counts
        assert sum(counts) == SEQ * (SEQ + 1) // 2  # together exactly the causal triangle, nothing masked twice
        assert work["all_gather"] == work["ring"]
        for mode in ("all_gather", "ring"):
            _check_cp(CPContext(group, mode), f"C={size} {mode} block_causal", _document_ids())
    if rank < 3:  # odd C: 2C = 6 chunks of 4 tokens, one KV head shared by every query head
        for mode in ("all_gather", "ring"):
            for documents in (None, _document_ids(24)):
                _check_cp(CPContext(three, mode), f"C=3 {mode} MQA documents={documents is not None}", documents,
                          seq=24, kv_heads=1)


def test_context_parallel_attention_matches_full_attention():
    run_ranks(4, _check_all)


# --- the trainer's step under context parallelism ---------------------------------------------------
STEPS = 3  # as the pipeline layouts: step 3 already trains on weights two updates moved
LAYOUTS = {  # name: overrides on 4 ranks; every layout trains the same 4-sequence global batch
    "cp2 dp2 all_gather": dict(context_parallel_size=2, batch_size=2),
    "cp2 dp2 ring": dict(context_parallel_size=2, batch_size=2, context_parallel_comm="ring"),
    "cp4 all_gather": dict(context_parallel_size=4, batch_size=4),
    "cp4 ring": dict(context_parallel_size=4, batch_size=4, context_parallel_comm="ring"),
    "tp2 cp2 sp ring": dict(context_parallel_size=2, model_parallel_size=2, batch_size=4,
                            context_parallel_comm="ring", model={"sequence_parallel": True}),
    "pp2 cp2": dict(context_parallel_size=2, pipeline_parallel_size=2, batch_size=4),
    "hsdp2 cp2 ring": dict(context_parallel_size=2, dp_replicate=2, batch_size=2, context_parallel_comm="ring",
                           optimize_backward_concat=True),
}


def _check_layouts(rank: int, world: int, reference: dict) -> None:
    for name, overrides in LAYOUTS.items():
        _, metrics = train(config(steps=STEPS, **overrides), world)
        assert_matches(metrics, reference, name)


def test_trainer_step_under_context_parallelism_matches_one_process(tmp_path):
    path = str(tmp_path / "reference.json")
    run_ranks(1, write_references, [4], path, STEPS)
    run_ranks(4, _check_layouts, read_references(path)[4])
