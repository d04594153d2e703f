"""Gradients that do not come through the flat parameter's autograd edge: parameters unused in some
microbatches, and a weight that accumulates its gradient into `main_grad` itself (TransformerEngine's
fused weight-gradient accumulation). The unit still ends its backward, reduces and reshards, with
optimize_backward_concat on and off (bitwise equal), matching one process."""

import torch
import torch.distributed as dist
from torch import nn

from parallel.fsdp import FSDPConfig, fully_shard
from parallel.fsdp.flat_param import unflatten
from parallel.fsdp.unit import UnitState
from tests.distributed.spawn import run_ranks
from tests.fake_te.transformer_engine.pytorch import MAIN_GRAD_WRITES
from tests.fake_te.transformer_engine.pytorch import FusedWgradLinear as FusedWgradFunction

DIM, PER_RANK, STEPS = 8, 3, 2  # each rank: 3 microbatches of one row


class FusedWgradLinear(nn.Module):
    """A linear with TransformerEngine's fused weight-gradient contract (the CPU stand-in's): under FSDP
    its weight has a main_grad and the gradient goes there; alone it is an ordinary linear."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(DIM, DIM) / DIM**0.5)
        self.weight.wgrad_into_main_grad = True
        self.is_first_microbatch = None

    def set_microbatch(self, is_first: bool, is_last: bool) -> None:
        self.is_first_microbatch = is_first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # As TE 2.0: main_grad is read at forward, and it must be bound by then.
        return FusedWgradFunction.apply(x, self.weight, self.is_first_microbatch, getattr(self.weight, "main_grad", None))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Linear(DIM, DIM)
        self.sometimes = nn.Linear(DIM, DIM, bias=False)  # unused on microbatch 0
        self.never = nn.Linear(DIM, DIM, bias=False)  # unused on every microbatch
        self.fused = FusedWgradLinear()

    def forward(self, x: torch.Tensor, microbatch: int) -> torch.Tensor:
        y = torch.tanh(self.w(x)) + self.fused(x)
        return y + self.sometimes(x) if microbatch > 0 else y


class Toy(nn.Module):
    """Unit `a` takes data (no gradient w.r.t. its input); unit `b` takes a's output (one)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = Block(), Block()

    def forward(self, x: torch.Tensor, microbatch: int) -> torch.Tensor:
        return self.b(self.a(x, microbatch), microbatch)


def batch(step: int, world: int) -> torch.Tensor:
    return torch.randn(world * PER_RANK, DIM, generator=torch.Generator().manual_seed(step))


def reference(world: int) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """One process: every rank's microbatches, each row with its microbatch index."""
    model, losses, grads = Toy(), [], []
    for step in range(STEPS):
        rows = batch(step, world)
        loss = sum(model(rows[i : i + 1], i % PER_RANK).pow(2).sum() for i in range(len(rows))) / len(rows)
        loss.backward()
        grads.append({n: (p.grad if p.grad is not None else torch.zeros_like(p)).clone()
                      for n, p in model.named_parameters()})
        losses.append(loss.item())
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= 0.1 * p.grad
        model.zero_grad()
    return losses, grads


def train(rank: int, world: int, cfg: FSDPConfig) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    model = Toy()
    root = fully_shard(model, ["a", "b"], dist.group.WORLD, None, cfg)
    losses, grads = [], []
    MAIN_GRAD_WRITES.clear()
    for step in range(STEPS):
        rows = batch(step, world)[rank * PER_RANK : (rank + 1) * PER_RANK]
        total = torch.zeros(())
        for i in range(PER_RANK):
            root.set_microbatch(is_first=i == 0, is_last=i == PER_RANK - 1)
            loss = model(rows[i : i + 1], i).pow(2).sum() / (world * PER_RANK)
            loss.backward()
            total += loss.detach()
            if cfg.reshard_after_forward:  # ZeRO-3: every unit freed as soon as its backward ended
                assert [u.state for u in root.units] == [UnitState.SHARDED] * 2, (step, i)
        root.finish_gradient_sync()
        # The accumulator went to the reduction: no view still points into it (it would live on).
        assert not any(hasattr(b.fused.weight, "main_grad") for b in (model.a, model.b))
        dist.all_reduce(total)
        losses.append(total.item())
        grads.append(full_grads(root))
        with torch.no_grad():
            for unit in root.units:
                unit.flat_param -= 0.1 * unit.flat_param.grad
                unit.flat_param.grad = None
    assert len(MAIN_GRAD_WRITES) == STEPS * PER_RANK * 2  # every backward of both units' fused linear
    return losses, grads


def full_grads(root) -> dict[str, torch.Tensor]:
    out = {}
    for unit in root.units:
        flat = torch.empty(unit.spec.padded)
        dist.all_gather_into_tensor(flat, unit.flat_param.grad, group=unit.shard_group)
        out |= {f"{unit.name}.{n}": g for n, g in unflatten(flat, unit.spec).items()}
    return out


def _check(rank: int, world: int) -> None:
    ref_losses, ref_grads = reference(world)
    for reshard in (False, True):
        runs = {concat: train(rank, world, FSDPConfig(reshard_after_forward=reshard, optimize_backward_concat=concat))
                for concat in (False, True)}
        for concat, (losses, grads) in runs.items():
            label = f"reshard={reshard} concat={concat}"
            for got, want in zip(losses, ref_losses):
                assert abs(got - want) <= 1e-6 * abs(want), (label, losses, ref_losses)
            for step, (got, want) in enumerate(zip(grads, ref_grads)):
                assert got.keys() == want.keys()
                for name in want:
                    assert torch.allclose(got[name], want[name], rtol=1e-5, atol=2e-6), (label, step, name)  # |g| ~ 6
                assert not got["a.never.weight"].any() and not got["b.never.weight"].any()
                assert got["a.sometimes.weight"].abs().sum() > 0
        (off_losses, off_grads), (on_losses, on_grads) = runs[False], runs[True]
        assert off_losses == on_losses, reshard
        for off, on in zip(off_grads, on_grads):
            assert all(torch.equal(off[n], on[n]) for n in off), reshard


def _refuses_per_microbatch_reduction(rank: int, world: int) -> None:
    """A main_grad is bound to the unit's accumulator at forward; with a reduction per microbatch a later
    microbatch's forward (1F1B) could bind one that is already being reduced, so the pair is refused."""
    try:
        fully_shard(Toy(), ["a", "b"], dist.group.WORLD, None, FSDPConfig(grad_reduce="per_microbatch"))
    except ValueError as e:
        assert "a.fused.weight" in str(e) and "grad_reduce=per_microbatch" in str(e), e
    else:
        raise AssertionError("grad_reduce=per_microbatch with a main_grad weight was accepted")


def _refuses_a_unit_left_out_of_the_last_microbatch(rank: int, world: int) -> None:
    """A unit's gradient is reduced at the end of its last microbatch's backward: one that ran only on
    earlier microbatches would keep it (accumulator, or per-microbatch shard sum) into the next step."""
    for grad_reduce in ("last_microbatch", "per_microbatch"):
        model = nn.Sequential(nn.Linear(DIM, DIM), nn.Linear(DIM, DIM))
        root = fully_shard(model, ["0", "1"], dist.group.WORLD, None, FSDPConfig(grad_reduce=grad_reduce))
        for i in range(2):
            root.set_microbatch(is_first=i == 0, is_last=i == 1)
            (model if i == 0 else model[0])(torch.ones(1, DIM)).sum().backward()
        try:
            root.finish_gradient_sync()
        except RuntimeError as e:
            assert "FSDP unit 1 got gradients on earlier microbatches" in str(e), e
        else:
            raise AssertionError(f"a unit left out of the last microbatch went unnoticed ({grad_reduce})")


def _refuses_a_gradient_after_its_backward_ended(rank: int, world: int) -> None:
    """A gradient arriving after the unit's backward ended, when the microbatch reduces, would miss the
    reduction (or land in an accumulator already being reduced): a second backward through one forward,
    judged by that forward's ticket even after a pipeline ran a later forward, and a unit run twice in
    one forward, whose inner call's gradients come after the outer call's backward ended."""
    cases = (("second backward", "last_microbatch", 1), ("second backward, pipelined", "per_microbatch", 2),
             ("unit run twice", "last_microbatch", 1))
    for case, grad_reduce, forwards in cases:
        model = nn.Sequential(nn.Linear(DIM, DIM), nn.Linear(DIM, DIM))
        root = fully_shard(model, ["0", "1"], dist.group.WORLD, None, FSDPConfig(grad_reduce=grad_reduce))
        root.set_microbatch(is_first=True, is_last=forwards == 1)
        x = torch.ones(1, DIM, requires_grad=True)
        run = (lambda: model[1](model[0](model[0](x))).sum()) if case == "unit run twice" else (lambda: model(x).sum())
        losses = [run() for _ in range(forwards)]  # 1F1B warm-up: F0 (F1)
        try:
            losses[0].backward(retain_graph=True)
            if case != "unit run twice":
                losses[0].backward()
        except RuntimeError as e:
            assert "a gradient arrived after the unit's backward ended" in str(e), (case, e)
        else:
            raise AssertionError(f"{case} went unnoticed ({grad_reduce})")
        root.reductions.drain()


def _check_all(rank: int, world: int) -> None:
    _check(rank, world)
    _refuses_per_microbatch_reduction(rank, world)
    _refuses_a_unit_left_out_of_the_last_microbatch(rank, world)
    _refuses_a_gradient_after_its_backward_ended(rank, world)


def test_gradients_outside_autograd_reduce_reshard_and_stay_bitwise_with_and_without_concat():
    """Also refused, never silently wrong: a unit left out of the step's last microbatch, a main_grad
    weight with per-microbatch reduction, and a gradient that arrives after its unit's backward ended."""
    run_ranks(2, _check_all)
