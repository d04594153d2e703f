"""Tensor + sequence parallelism against TP=1: loss and every gathered gradient, exact per-block
collective counts, sequence-split activation memory, a padded vocabulary's loss, and TP x FSDP against
the single-process run."""

import torch
import torch.distributed as dist

from model.args import ModelArgs
from model.init import init_weights
from model.transformer import RMSNorm, Transformer
from parallel import comm
from parallel.cross_entropy import vocab_parallel_cross_entropy
from parallel.fsdp import FSDPConfig, grad_norm
from parallel.mesh import ParallelDims, ParallelMesh
from parallel.tensor_parallel import TPContext, tp_merge
from tests.distributed import fsdp_cases
from tests.distributed.spawn import run_ranks

# GQA with 8 query heads over 4 KV heads: at tp=4 each rank owns 2 query heads and their 1 KV head.
ARGS = ModelArgs(n_layers=2, dim=64, n_heads=8, n_kv_heads=4, vocab_size=64, multiple_of=16, max_seq_len=8)
BATCH, SEQ = 2, 8


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, ARGS.vocab_size, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(5))
    return tokens[:, :-1], tokens[:, 1:]


def _model(tp: TPContext) -> Transformer:
    model = Transformer(ARGS, tp)
    init_weights(model, ARGS, seed=11, tp=tp)
    return model


def _loss_and_grads(tp: TPContext) -> tuple[float, dict[str, torch.Tensor]]:
    """One forward/backward; gradients gathered to full shapes (SP-partial norm grads summed)."""
    model = _model(tp)
    inputs, targets = _batch()
    loss = vocab_parallel_cross_entropy(model(inputs), targets, tp).mean()
    loss.backward()
    return loss.item(), {n: _full_grad(p, tp) for n, p in model.named_parameters()}


def _full_grad(param: torch.nn.Parameter, tp: TPContext) -> torch.Tensor:
    grad = param.grad.detach().clone()
    if tp.size == 1:
        return grad
    if getattr(param, "tp_dim", None) is None:
        if tp.sequence_parallel:
            dist.all_reduce(grad, group=tp.group)  # each TP rank saw 1/tp of the tokens
        return grad
    slices = [torch.empty_like(grad) for _ in range(tp.size)]
    dist.all_gather(slices, grad, group=tp.group)
    return tp_merge(slices, param)


def _check_against_tp1(rank: int, world: int) -> None:
    ref_loss, ref_grads = _loss_and_grads(TPContext())
    for tp_size in (2, 4):
        mesh = ParallelMesh(ParallelDims.from_sizes(world, model_parallel_size=tp_size), "cpu")
        for sp in (False, True):
            loss, grads = _loss_and_grads(TPContext(mesh.group("tp"), sequence_parallel=sp))
            assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (tp_size, sp, loss, ref_loss)
            for name, ref in ref_grads.items():
                err = ((grads[name] - ref).norm() / ref.norm()).item()
                assert err <= 1e-5, f"tp={tp_size} sp={sp} {name}: relative grad error {err:.3g}"


def _check_ignored_and_unowned_targets(rank: int, world: int) -> None:
    """tp=2 treats targets as tp=1 does: IGNORE_INDEX adds zero loss and zero gradient; a target outside
    the vocab, which F.cross_entropy refuses, gives NaN (which halts training) instead of a finite loss."""
    mesh = ParallelMesh(ParallelDims.from_sizes(world, model_parallel_size=2), "cpu")
    tp = TPContext(mesh.group("tp"))
    logits = torch.randn(3, ARGS.vocab_size, generator=torch.Generator().manual_seed(2), requires_grad=True)
    local = logits.detach()[:, tp.rank * 32 : (tp.rank + 1) * 32].clone().requires_grad_()
    targets = torch.tensor([3, -100, 40])
    ref = torch.nn.functional.cross_entropy(logits, targets, reduction="none")
    ref.sum().backward()
    loss = vocab_parallel_cross_entropy(local, targets, tp)
    loss.sum().backward()
    assert torch.allclose(loss, ref, rtol=1e-6) and loss[1] == 0, (loss, ref)
    assert torch.allclose(local.grad, logits.grad[:, tp.rank * 32 : (tp.rank + 1) * 32], atol=1e-7)
    assert local.grad[1].abs().sum() == 0
    unowned = vocab_parallel_cross_entropy(local.detach(), torch.tensor([3, ARGS.vocab_size, 40]), tp)
    assert unowned[1].isnan() and unowned[[0, 2]].isfinite().all(), unowned


def _check_padded_vocab(rank: int, world: int) -> None:
    """A padded vocabulary of 20 ids in 64 columns on tp=2 and tp=4 (the last ranks hold padding only, one
    rank of tp=4 both): the unpadded loss and gradient, none into the padding, and a padding id no rank
    owns (NaN, as an id out of the vocabulary)."""
    real = 20
    logits = torch.randn(6, ARGS.vocab_size, generator=torch.Generator().manual_seed(3))
    logits[:, real:] += 30.0  # unmasked, the padding would take almost all the probability
    targets = torch.tensor([0, 5, 19, -100, 7, 13])
    unpadded = logits[:, :real].clone().requires_grad_()
    ref = torch.nn.functional.cross_entropy(unpadded, targets, reduction="none")
    ref.sum().backward()
    ref_grad = torch.cat([unpadded.grad, torch.zeros(6, ARGS.vocab_size - real)], 1)
    for tp_size in (2, 4):
        mesh = ParallelMesh(ParallelDims.from_sizes(world, model_parallel_size=tp_size), "cpu")
        tp = TPContext(mesh.group("tp"))
        columns = slice(tp.rank * ARGS.vocab_size // tp_size, (tp.rank + 1) * ARGS.vocab_size // tp_size)
        local = logits[:, columns].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(local, targets, tp, valid_vocab_size=real)
        loss.sum().backward()
        assert torch.allclose(loss, ref, rtol=1e-6), (tp_size, loss, ref)
        assert torch.allclose(local.grad, ref_grad[:, columns], atol=1e-7), tp_size
        assert not local.grad[:, max(real - columns.start, 0):].any(), tp_size  # the padding's: exactly zero
        padding_id = vocab_parallel_cross_entropy(local.detach(), torch.tensor([real, 0, 1, 2, 3, 4]), tp, real)
        assert padding_id[0].isnan() and padding_id[1:].isfinite().all(), (tp_size, padding_id)


def _block_counts(tp: TPContext) -> tuple[dict, dict]:
    """Collectives of one transformer block's forward, then of its backward, on the TP group."""
    model = _model(tp)
    block = model.layers["0"]
    seq = SEQ // tp.size if tp.sequence_parallel else SEQ
    x = torch.randn(BATCH, seq, ARGS.dim, requires_grad=True)
    cos, sin = model.rope(torch.arange(SEQ), x.dtype)
    comm.LEDGER.reset()
    out = block(x, cos, sin)
    forward = comm.LEDGER.by_group().get("tp", {})
    comm.LEDGER.reset()
    out.sum().backward()
    backward = comm.LEDGER.by_group().get("tp", {})
    return {op: v["count"] for op, v in forward.items()}, {op: v["count"] for op, v in backward.items()}


def _check_counts(rank: int, world: int) -> None:
    mesh = ParallelMesh(ParallelDims.from_sizes(world, model_parallel_size=2), "cpu")
    forward, backward = _block_counts(TPContext(mesh.group("tp"), sequence_parallel=True))
    assert forward == {"all_gather": 2, "reduce_scatter": 2} and backward == {"reduce_scatter": 2, "all_gather": 2}
    forward, backward = _block_counts(TPContext(mesh.group("tp"), sequence_parallel=False))
    assert forward == {"all_reduce": 2} and backward == {"all_reduce": 2}


def _saved_by_norms(tp: TPContext) -> int:
    """Elements of [batch, seq, ...] activations saved for backward inside the RMSNorms (the residual
    stream's activations; the norm weights themselves are not activations)."""
    model = _model(tp)
    saved = []
    contexts = {}

    def enter(module, args):
        contexts[module] = torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel() if t.dim() == 3 else 0) or t, lambda t: t)
        contexts[module].__enter__()

    def leave(module, args, out):
        contexts.pop(module).__exit__(None, None, None)

    for m in model.modules():
        if isinstance(m, RMSNorm):
            m.register_forward_pre_hook(enter)
            m.register_forward_hook(leave)
    inputs, targets = _batch()
    vocab_parallel_cross_entropy(model(inputs), targets, tp).sum()
    return sum(saved)


def _check_activation_memory(rank: int, world: int) -> None:
    full = _saved_by_norms(TPContext())
    for tp_size in (2, 4):
        mesh = ParallelMesh(ParallelDims.from_sizes(world, model_parallel_size=tp_size), "cpu")
        group = mesh.group("tp")
        assert _saved_by_norms(TPContext(group, sequence_parallel=True)) * tp_size == full
        assert _saved_by_norms(TPContext(group, sequence_parallel=False)) == full


def _check_tp_with_fsdp(rank: int, world: int) -> None:
    """tp=2 x dp_shard=2 (SP on and off) after 3 AdamW steps matches the single-process run, and the
    global grad norm over TP x FSDP shards matches the unsharded one."""
    reference = fsdp_cases.reference_params(3)
    mesh = ParallelMesh(ParallelDims.from_sizes(world, model_parallel_size=2), "cpu")
    for sp in (False, True):
        tp = TPContext(mesh.group("tp"), sequence_parallel=sp)
        norms = []
        root, _ = fsdp_cases.train_fsdp(FSDPConfig(), mesh.group("dp_shard_cp"), None, mesh.dp_rank, mesh.dims.dp, 2,
                                        3, lambda s, r: norms.append(grad_norm([r], [r.shard_group, tp.group])), tp=tp)
        fsdp_cases.assert_params_close(fsdp_cases.full_params(root), reference, 1e-6, f"tp=2 dp=2 sp={sp}")
        model = fsdp_cases.make_model()
        inputs, targets = fsdp_cases.global_batch(0)
        (fsdp_cases.loss_sum(model, inputs, targets) / inputs.numel()).backward()
        expected = torch.sqrt(sum(p.grad.pow(2).sum() for p in model.parameters())).item()
        assert abs(norms[0] - expected) <= 1e-5 * expected, (sp, norms[0], expected)


def _all_checks(rank: int, world: int) -> None:
    _check_tp_with_fsdp(rank, world)
    _check_against_tp1(rank, world)
    _check_counts(rank, world)
    _check_ignored_and_unowned_targets(rank, world)
    _check_padded_vocab(rank, world)
    _check_activation_memory(rank, world)


def test_tensor_parallel_matches_tp1():
    run_ranks(4, _all_checks)
