"""In-tree FSDP against PyTorch's own FSDP2 (`torch.distributed.fsdp.fully_shard`) on gloo/CPU.

Same tiny model, same units, same per-rank microbatches, AdamW, fp32: parameters and per-step losses
must agree to fp32 summation-order noise. FSDP2 averages gradients over the group where ours sums, so
FSDP2's loss is scaled by dp_size (a power of two: the scaling is exact).
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
from torch.distributed.tensor import DTensor

from parallel.fsdp import FSDPConfig
from parallel.mesh import ParallelDims, ParallelMesh
from tests.distributed.fsdp_cases import (
    ADAMW, GLOBAL_BATCH, SEQ, UNITS, assert_params_close, full_params, global_batch, loss_sum, make_model, train_fsdp,
)
from tests.distributed.spawn import run_ranks

STEPS, MICROBATCHES = 3, 4


def _train_fsdp2(mesh: DeviceMesh, reshard: bool, dp_rank: int, dp_size: int) -> tuple[FSDPModule, list[float]]:
    """FSDP2 per unit then the root; gradients sync only on the last microbatch."""
    model = make_model()
    for name in UNITS:
        fsdp2_fully_shard(model.get_submodule(name), mesh=mesh, reshard_after_forward=reshard)
    fsdp2_fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    per_rank = GLOBAL_BATCH // dp_size
    losses = []
    for step in range(STEPS):
        inputs, targets = (t[dp_rank * per_rank : (dp_rank + 1) * per_rank] for t in global_batch(step))
        total = torch.zeros((), dtype=torch.float64)
        for i, (x, y) in enumerate(zip(inputs.chunk(MICROBATCHES), targets.chunk(MICROBATCHES))):
            is_last = i == MICROBATCHES - 1
            model.set_requires_gradient_sync(is_last)
            model.set_is_last_backward(is_last)
            mb_loss = loss_sum(model, x, y)
            (mb_loss / (per_rank * SEQ)).backward()  # FSDP2 divides by dp_size: net 1 / global tokens
            total += mb_loss.detach().double()
        opt.step()
        opt.zero_grad()
        dist.all_reduce(total)
        losses.append(total.item() / (GLOBAL_BATCH * SEQ))
    return model, losses


def _full_fsdp2_params(model: FSDPModule) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor() if isinstance(p, DTensor) else p.detach() for n, p in model.named_parameters()}


def _check_parity(rank: int, world: int) -> None:
    ours_mesh = ParallelMesh(ParallelDims.from_sizes(world), "cpu")
    fsdp2_mesh = init_device_mesh("cpu", (world,))
    initial = {n: p.detach() for n, p in make_model().named_parameters()}
    for reshard in (False, True):
        label = f"reshard_after_forward={reshard}"
        cfg = FSDPConfig(reshard_after_forward=reshard, optimize_backward_concat=True)
        root, ours_losses = train_fsdp(cfg, ours_mesh.group("dp_shard_cp"), ours_mesh.group("dp_replicate"),
                                       ours_mesh.dp_rank, ours_mesh.dims.dp, MICROBATCHES, STEPS)
        ours = full_params(root)
        model, fsdp2_losses = _train_fsdp2(fsdp2_mesh, reshard, fsdp2_mesh.get_local_rank(), world)
        fsdp2 = _full_fsdp2_params(model)
        assert ours.keys() == fsdp2.keys(), (label, sorted(ours.keys() ^ fsdp2.keys()))
        moved = min(((fsdp2[n] - p).norm() / p.norm()).item() for n, p in initial.items())
        assert moved > 1e-5, f"{label}: parameters barely moved ({moved:.2g}): the comparison would prove nothing"
        assert_params_close(ours, fsdp2, 1e-6, f"ours vs FSDP2, {label}")
        for step, (a, b) in enumerate(zip(ours_losses, fsdp2_losses)):
            assert abs(a - b) <= 1e-6 * abs(b), f"{label} step {step}: loss ours {a!r} vs FSDP2 {b!r}"


def test_fsdp_matches_torch_fsdp2():
    run_ranks(4, _check_parity)
