"""The planner on paper: dry_run's plan of Llama 3 405B on 1024 ranks from one process (meta device only),
the traced activations against a real forward, the layouts it ranks first, and its bad-input lines."""

import json
import time

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from model.transformer import Transformer
from parallel.cross_entropy import vocab_parallel_cross_entropy
from parallel.errors import ConfigError
from parallel.tensor_parallel import TPContext
from planner.activations import ActivationKey, sequence_activations
from planner.config import compose_config
from planner.devices import load_device
from planner.dry_run import plan
from planner.search import NothingFits, given_layout, peak_bytes, plan_layouts
from planner.step_time import predict
from scripts import plan as plan_script
from trainer.config.rules import validate

GIB = 2**30
# Megatron's published Llama 3 405B layout: TP8 PP8 CP2 DP8 at seq 8192, the 126 layers split 15/16x6/15;
# global batch 2048 sequences (batch_size is per data-parallel rank).
MEGATRON_405B = ["model=llama3_405b", "seq_len=8192", "batch_size=256", "compute_dtype=bf16", "model_parallel_size=8",
                 "pipeline_parallel_size=8", "context_parallel_size=2", "pipeline_first_stage_layers=15",
                 "pipeline_last_stage_layers=15", "model.sequence_parallel=true"]


class _RealAllocations(TorchDispatchMode):
    """Every tensor an op makes off the meta device, beyond a few scalars."""

    def __init__(self):
        super().__init__()
        self.made = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.made += [(str(func), t.shape) for t in tree_leaves(out)
                      if isinstance(t, torch.Tensor) and t.device.type != "meta" and t.numel() > 64]
        return out


def test_dry_run_of_405b_on_1024_ranks_in_one_process_allocates_nothing():
    cfg = compose_config([*MEGATRON_405B, "dry_run=true", "world_size=1024"])
    start, allocations = time.perf_counter(), _RealAllocations()
    with allocations:
        report = plan(cfg, validate(cfg, 1024))
    assert time.perf_counter() - start < 60
    assert not allocations.made, allocations.made[:5]
    assert report["parameters"]["total"] == pytest.approx(405.85e9, rel=1e-3)
    assert report["parameters"]["embedding"] == 128256 * 16384
    stages = report["memory"]["per_stage"]
    assert [s["ranks"] for s in stages] == [[128 * r, 128 * r + 127] for r in range(8)]
    # One predicted peak per global rank: rank r is on stage r // 128.
    by_rank = report["memory"]["peak_bytes_per_rank"]
    assert len(by_rank) == 1024 and by_rank == [stages[r // 128]["peak_bytes"] for r in range(1024)]
    # TP-local parameters: the 15-layer ends hold the embedding or the head, the 16-layer stages none.
    per_rank = [s["parameters"] for s in report["parameters"]["per_stage"]]
    assert sum(per_rank) * 8 == pytest.approx(report["parameters"]["total"], rel=1e-4)
    assert report["memory"]["peak_bytes"] == max(s["peak_bytes"] for s in stages)
    assert 0 < report["pipeline"]["bubble_fraction"] < 0.05  # 256 microbatches over 8 stages
    assert report["flops"]["tokens_per_step"] == 2048 * 8192
    assert not torch.distributed.is_initialized()  # the fake world is gone: the process may make its own


def test_meta_trace_counts_what_a_real_forward_saves():
    """The traced bytes per part against the same forward run for real on CPU, counted by storage address."""
    cfg = compose_config(["model=tiny", "seq_len=32", "compute_dtype=fp32"])
    traced = sequence_activations(ActivationKey(cfg.model, 1, 1, False, "all_gather", 32, torch.float32))
    model = Transformer(cfg.model, TPContext(), range(2))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen, total = set(), [0]

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen and ptr not in params:
            seen.add(ptr)
            total[0] += t.untyped_storage().nbytes()
        return t

    tokens = torch.randint(0, cfg.model.vocab_size, (1, 32))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        vocab_parallel_cross_entropy(model(tokens), tokens, TPContext()).sum()
    parts = traced.chunk + 2 * traced.block + traced.embedding + traced.head + traced.loss
    assert parts == total[0]


def test_llama3_8b_on_8_h100_plans_a_fitting_layout_at_least_as_fast_as_fsdp_with_checkpointing():
    """FSDP over 8 with full checkpointing fits (without, the loss's scratch overflows the budget): the
    search ranks first a layout that fits and is no slower."""
    h100 = load_device("h100")
    best = plan_layouts(compose_config(["model=llama3_8b", "seq_len=8192"]), 8, 8, h100, h100.budget_bytes, 3)
    fsdp = given_layout(compose_config(["model=llama3_8b", "seq_len=8192", "batch_size=1", "model.layer_ckpt=full"]),
                        8, h100)
    assert fsdp.peak_bytes <= h100.budget_bytes
    assert all(c.peak_bytes <= h100.budget_bytes for c in best)
    assert best[0].time.step_s <= fsdp.time.step_s


def test_405b_megatron_layout_fits_and_the_planner_finds_one_at_least_as_fast():
    h100 = load_device("h100")
    megatron = compose_config([*MEGATRON_405B, "model.layer_ckpt=full", "reshard_after_forward=false"])
    dims = validate(megatron, 1024)
    assert peak_bytes(megatron, dims) <= h100.budget_bytes
    reference = predict(megatron, dims, h100, 2)
    start = time.perf_counter()
    best = plan_layouts(compose_config(["model=llama3_405b", "seq_len=8192"]), 1024, 2048, h100,
                        h100.budget_bytes, 3)
    assert time.perf_counter() - start < 30
    assert best[0].peak_bytes <= h100.budget_bytes
    assert best[0].time.step_s <= reference.step_s
    assert [c.time.step_s for c in best] == sorted(c.time.step_s for c in best)


def test_plan_rows_are_launchable_overrides(capsys):
    assert plan_script.main(["model=llama3_8b", "seq_len=8192", "--world", "8", "--global-batch", "8", "--top", "2",
                             "--json"]) == 0
    for row in json.loads(capsys.readouterr().out):
        assert row["overrides"][:2] == ["model=llama3_8b", "seq_len=8192"]
        validate(compose_config(row["overrides"]), 8)


@pytest.mark.parametrize("argv, message", [
    (["model=tiny", "--world", "7", "--global-batch", "8"], "divides a world of 7 devices"),
    (["model=llama3_8b", "seq_len=8192", "--world", "8", "--global-batch", "8", "--mem-gib", "4"],
     "no layout fits 4.0 GiB per device: the closest needs"),
    (["model=tiny", "--world", "2", "--device", "tpu9"], "device profile 'tpu9' is unknown: one of a100, cpu, h100"),
])
def test_bad_input_is_one_line(capsys, argv, message):
    assert plan_script.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err


def test_as_given_refuses_a_global_batch_it_would_ignore(capsys):
    """--as-given predicts the given layout at its own batch_size: a --global-batch it ignored was printed in
    the header as the batch predicted."""
    assert plan_script.main(["model=tiny", "--world", "2", "--as-given", "--global-batch", "64"]) == 2
    assert capsys.readouterr().err == ("error: --global-batch does not combine with --as-given (set batch_size in "
                                       "the overrides)\n")


def test_nothing_fits_names_the_closest_layout_and_its_overflow():
    h100 = load_device("h100")
    with pytest.raises(NothingFits, match=r"GiB over\): model_parallel_size=\d+ .*grad_reduce="):
        plan_layouts(compose_config(["model=llama3_70b", "seq_len=8192"]), 8, 8, h100, 8 * GIB, 3)


def test_a_run_refuses_world_size_without_dry_run():
    from parallel.launch_env import LaunchEnv
    from planner.dry_run import planned_world

    cfg = compose_config(["world_size=4"])
    with pytest.raises(ConfigError, match="world_size=4 is read by dry_run=true only"):
        planned_world(cfg, LaunchEnv.from_torchrun())


def test_a_padded_vocabulary_is_planned_as_the_trainer_builds_it():
    """make_vocab_size_divisible_by pads the tokenizer's ids to a multiple of it x tp when the data is
    prepared; a plan has no tokenizer, and built the unpadded vocabulary (50257 rows over tp=4: a crash;
    where tp divided it, the plan counted fewer rows than training builds)."""
    common = ["model=small", "dry_run=true", "world_size=4", "model_parallel_size=4"]
    given = compose_config([*common, "model.vocab_size=50257", "make_vocab_size_divisible_by=128"])
    report = plan(given, validate(given, 4))
    padded = compose_config([*common, "model.vocab_size=50688"])  # 50257 rounded up to a multiple of 128 x 4
    assert report["parameters"] == plan(padded, validate(padded, 4))["parameters"]
    assert report["parameters"]["embedding"] == 50688 * padded.model.dim
    h100 = load_device("h100")
    assert given_layout(given, 4, h100).peak_bytes == given_layout(padded, 4, h100).peak_bytes
