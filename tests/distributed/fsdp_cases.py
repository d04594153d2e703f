"""A tiny model, deterministic global batches, a single-process reference, and an FSDP trainer for tests."""

import torch
import torch.distributed as dist

from model.args import ModelArgs
from model.init import init_weights
from model.transformer import Transformer
from parallel import comm
from parallel.cross_entropy import vocab_parallel_cross_entropy
from parallel.fsdp import FSDPConfig, FSDPRoot, TPGroups, fully_shard
from parallel.fsdp.flat_param import unflatten
from parallel.tensor_parallel import TPContext, tp_merge

ARGS = ModelArgs(n_layers=2, dim=32, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16, max_seq_len=8)
GLOBAL_BATCH, SEQ = 16, 8
UNITS = ["tok_embeddings", "layers.0", "layers.1", "head"]
# Adam turns fp32 summation-order noise in near-zero gradients into steps of +-lr, so the relative
# parameter error grows with lr (2.7e-5 at lr=1e-2, 2.7e-7 at 1e-4 here); a real bug is ~1e-3.
ADAMW = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False)


def make_model(tp: TPContext | None = None) -> Transformer:
    model = Transformer(ARGS, tp)
    init_weights(model, ARGS, seed=3, tp=tp)
    return model


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, ARGS.vocab_size, (GLOBAL_BATCH, SEQ + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def loss_sum(model, inputs, targets) -> torch.Tensor:
    return vocab_parallel_cross_entropy(model(inputs), targets, model.tp).sum()


def reference_params(steps: int) -> dict[str, torch.Tensor]:
    """Single process, no FSDP: the whole global batch at once."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    for step in range(steps):
        inputs, targets = global_batch(step)
        (loss_sum(model, inputs, targets) / (GLOBAL_BATCH * SEQ)).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def train_fsdp(cfg: FSDPConfig, shard_group, replicate_group, dp_rank: int, dp_size: int, microbatches: int,
               steps: int, on_step=None, prepare=None, tp: TPContext | None = None,
               on_root=None) -> tuple[FSDPRoot, list[float]]:
    """FSDP (over TP-local parameters when `tp` is given) with this rank's slice of each global
    batch, in `microbatches` pieces. `prepare(model)` runs before sharding (e.g. checkpointing),
    `on_root(root)` after it."""
    model = make_model(tp)
    if prepare is not None:
        prepare(model)
    tp_groups = TPGroups(tp.group, tp.sequence_parallel) if tp is not None else None
    root = fully_shard(model, UNITS, shard_group, replicate_group, cfg, tp_groups)
    if on_root is not None:
        on_root(root)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    per_rank = GLOBAL_BATCH // dp_size
    losses = []
    for step in range(steps):
        comm.LEDGER.reset()
        inputs, targets = (t[dp_rank * per_rank : (dp_rank + 1) * per_rank] for t in global_batch(step))
        total = torch.zeros((), dtype=torch.float64)
        for i, (x, y) in enumerate(zip(inputs.chunk(microbatches), targets.chunk(microbatches))):
            root.set_microbatch(is_first=i == 0, is_last=i == microbatches - 1)
            mb_loss = loss_sum(model, x, y)
            (mb_loss / (GLOBAL_BATCH * SEQ)).backward()
            total += mb_loss.detach().double()
        root.finish_gradient_sync()
        if on_step is not None:
            on_step(step, root)
        opt.step()
        opt.zero_grad()
        dist.all_reduce(total)  # tests may call torch.distributed directly; the trainer may not
        losses.append(total.item() / (GLOBAL_BATCH * SEQ) / _replicas_in_world(dp_size))
    return root, losses


def _replicas_in_world(dp_size: int) -> int:
    """How many times the world all-reduce counted each dp rank's loss (e.g. pp copies)."""
    return dist.get_world_size() // dp_size


def assert_params_close(got: dict, reference: dict, rel: float, label: str) -> None:
    """Per parameter: ||got - ref|| / ||ref|| <= rel."""
    for name, ref in reference.items():
        err = ((got[name] - ref).norm() / ref.norm()).item()
        assert err <= rel, f"{label}: {name} relative error {err:.3g} > {rel}"


def full_params(root: FSDPRoot) -> dict[str, torch.Tensor]:
    """All-gather every unit's shard, unflatten, and merge TP slices: {full parameter name: tensor}."""
    tp = root.units[0].tp
    with torch.device("meta"):
        params = dict(Transformer(ARGS, TPContext(size=tp.size)).named_parameters())
    out = {}
    for unit in root.units:
        flat = torch.empty(unit.spec.padded)
        comm.all_gather_into_tensor(flat, unit.flat_param.detach(), unit.shard_group)
        for name, local in unflatten(flat, unit.spec).items():
            full_name = f"{unit.name}.{name}"
            out[full_name] = local if tp.size == 1 else _merge_tp(local, tp, params[full_name])
    return out


def _merge_tp(local: torch.Tensor, tp: TPGroups, param: torch.Tensor) -> torch.Tensor:
    slices = [torch.empty_like(local) for _ in range(tp.size)]
    dist.all_gather(slices, local.contiguous(), group=tp.group)
    return tp_merge(slices, param)
