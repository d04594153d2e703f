"""Pipeline parallelism through the trainer's step on gloo ranks: every schedule, pp 2 and 4, one and two
chunks per rank, microbatch counts pp, 2pp and one that is not a multiple of pp, against the
single-process losses and gradient norms; uneven first and last stages, and their checkpoint on an even
split; exact per-step collective counts; one flat-grad concat per unit per step; p2p memory independent
of the microbatch count; ZB-H1 and ZB-V against 1F1B, their weight gradients and reductions in W, a ZB-V
checkpoint resumed on 1F1B; and the 8-rank
tp x pp x dp composition (bf16 bitwise with optimize_backward_concat on and off, fp32 against
tp=1/pp=1/dp=1)."""

import itertools
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from parallel import comm
from parallel.random import RNGStreams
from parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from tests.distributed.pipeline_cases import (
    MODEL, SEQ, FixedSampler, assert_matches, checkpoint_state_of, config, counting_concats, expected_p2p,
    make_trainer, read_references, reference_of, train, write_references,
)
from tests.distributed.spawn import run_ranks
from trainer.checkpoint.files import save_checkpoint
from trainer.checkpoint.state import load_into

# (pp, layers per virtual stage) -> chunks per rank with n_layers=8: pp2 x 2 layers = 2, pp4 x 1 layer = 2.
SCHEDULES = {"gpipe": {}, "1f1b": {}, "interleaved_1f1b": {2: 2, 4: 1}, "zbv": {2: 2, 4: 1}}
MICROBATCHES = {2: (2, 4, 3), 4: (4, 8, 5)}
GLOBAL_BATCHES = [4, 5, 6, 8]
UNEVEN_STEPS = 4


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, list[float]]:
    path = str(tmp_path_factory.mktemp("reference") / "losses.json")
    run_ranks(1, write_references, GLOBAL_BATCHES, path)
    return read_references(path)


@pytest.fixture(scope="module")
def reference_6_layers(tmp_path_factory) -> dict[int, list[float]]:
    """n_layers=6, global batch 4, 4 steps: the uneven stages' reference."""
    path = str(tmp_path_factory.mktemp("reference") / "losses_6_layers.json")
    run_ranks(1, write_references, [4], path, UNEVEN_STEPS, {"n_layers": 6})
    return read_references(path)


def _layouts(world: int):
    for pp, counts in MICROBATCHES.items():
        dp = world // pp
        for schedule, per_stage in SCHEDULES.items():
            for i, m in enumerate(counts):
                overrides = dict(pipeline_parallel_size=pp, pipeline_schedule=schedule, batch_size=m,
                                 reshard_after_forward=i % 2 == 0, optimize_backward_concat=i == 1,
                                 gradient_accumulation_fusion=i == 2)
                if pp in per_stage:
                    overrides["num_layers_per_virtual_pipeline_stage"] = per_stage[pp]
                yield f"pp{pp} dp{dp} {schedule} m{m}", config(**overrides), m * dp


def _check_layouts(rank: int, world: int, reference: dict) -> None:
    for label, cfg, global_batch in _layouts(world):
        trainer, metrics = train(cfg, world)
        assert_matches(metrics, reference[global_batch], label)
        assert {u.cfg.gradient_accumulation_fusion for r in trainer.roots for u in r.units} == \
            {cfg.gradient_accumulation_fusion}, label
        ledger = metrics[-1].comm
        units = sum(len(root.units) for root in trainer.roots)
        m, dp = cfg.num_microbatches, trainer.mesh.dims.dp
        p2p = expected_p2p(cfg, trainer.mesh.rank_in("pp"))
        assert ledger["send"]["count"] == ledger["recv"]["count"] == p2p, (label, ledger)
        assert ledger["send"]["bytes"] == p2p * SEQ * MODEL["dim"] * 4, (label, ledger)
        if dp > 1:  # ZeRO-3 gathers before every forward and backward, ZeRO-2 once per step
            gathers = units * (2 * m if cfg.reshard_after_forward else 1)
            assert ledger["all_gather"]["count"] == gathers, (label, ledger)
            assert ledger["reduce_scatter"]["count"] == units, (label, ledger)
        else:
            assert "all_gather" not in ledger and "reduce_scatter" not in ledger, (label, ledger)
        assert ledger["all_reduce"]["count"] == 2, (label, ledger)  # the grad norm and the loss, one each


def _check_one_concat_per_unit(rank: int, world: int) -> None:
    for optimize in (True, False):
        cfg = config(pipeline_parallel_size=2, pipeline_schedule="interleaved_1f1b", batch_size=3, steps=1,
                     num_layers_per_virtual_pipeline_stage=2, optimize_backward_concat=optimize)
        with counting_concats() as concats:
            trainer, _ = train(cfg, world)
        units = sum(len(root.units) for root in trainer.roots)
        assert concats[0] == units * (1 if optimize else cfg.num_microbatches), (optimize, concats, units)


def _check_composition_on_4_ranks(rank: int, world: int, reference: dict) -> None:
    """HSDP (2 replicas of pp=2, the replica all-reduce asynchronous per unit) and activation checkpointing,
    interleaved, ZB-H1 and ZB-V (whose Ws keep the recomputed operands of their GEMMs), some with fused
    gradient accumulation (a recomputed linear's GEMM runs into the accumulator)."""
    interleaved = dict(pipeline_schedule="interleaved_1f1b", num_layers_per_virtual_pipeline_stage=2)
    zero_bubble = dict(pipeline_schedule="zb_h1", num_layers_per_virtual_pipeline_stage=None)
    full, selective = {"model": {"layer_ckpt": "full"}}, {"model": {"layer_ckpt": "selective"}}
    fused = {"gradient_accumulation_fusion": True}
    for overrides in ({"dp_replicate": 2}, full | fused, selective, full | zero_bubble, selective | zero_bubble | fused,
                      selective | {"pipeline_schedule": "zbv"}, full | {"pipeline_schedule": "zbv", "dp_replicate": 2}):
        cfg = config(pipeline_parallel_size=2, batch_size=3, reshard_after_forward=True, **(interleaved | overrides))
        trainer, metrics = train(cfg, world)
        assert_matches(metrics, reference[6], str(overrides))
        units = sum(len(root.units) for root in trainer.roots)
        ledger, m = metrics[-1].comm, cfg.num_microbatches
        if "dp_replicate" in overrides:  # shards of one rank: nothing to gather, one all-reduce per unit
            assert "all_gather" not in ledger and ledger["all_reduce"]["count"] == units + 2, ledger
        else:  # recompute never gathers again
            assert ledger["all_gather"]["count"] == units * 2 * m, (overrides, ledger)


def _check_each_chunk_reduces_in_its_own_last_backward(rank: int, world: int) -> None:
    """Under interleaving, chunk 1 finishes its backwards before chunk 0: its reduce-scatters must run
    right then, inside its last backward, not at the end of the schedule."""
    cfg = config(pipeline_parallel_size=2, pipeline_schedule="interleaved_1f1b", batch_size=4, steps=1,
                 num_layers_per_virtual_pipeline_stage=2)
    trainer = make_trainer(cfg, world)
    runtime, reductions = trainer.runtime, []
    original = runtime._backward

    def backward(a):
        before = comm.LEDGER.count("reduce_scatter")
        original(a)
        reductions.append((a.chunk, a.microbatch, comm.LEDGER.count("reduce_scatter") - before))

    runtime._backward = backward
    trainer.train_step(1)
    for chunk, root in enumerate(trainer.roots):
        last = runtime.last_backward[chunk]
        assert [(mb, n) for c, mb, n in reductions if c == chunk and n] == [(last, len(root.units))], reductions
    assert reductions[-1][0] == 0 and any(n for c, _, n in reductions[:-1] if c == 1)


def _zero_bubble_step_record(trainer) -> list[tuple]:
    """(op, chunk, microbatch, deferred works it ran, FSDP reductions it started) of every B and W."""
    runtime, record, started = trainer.runtime, [], [0]
    for root in trainer.roots:
        push = root.reductions.push
        root.reductions.push = lambda *args, push=push: (started.__setitem__(0, started[0] + 1), push(*args))

    def recording(run, a):
        before, works = started[0], len(runtime._weight_work.get((a.chunk, a.microbatch), []))
        run(a)
        record.append((a.op, a.chunk, a.microbatch, works if a.op == "W" else 0, started[0] - before))

    backward, weight = runtime._backward, runtime._weight
    runtime._backward = lambda a: recording(backward, a)
    runtime._weight = lambda a: recording(weight, a)
    return record


def _zero_bubble_schedules(pp: int, m: int) -> list[tuple[str, dict]]:
    """ZB-H1 on every (pp, M); ZB-V (two chunks of 8 / 2pp layers in a V) on all but pp 2, M 8 (its
    order for M < 2pp - 1 drops microbatches from a longer one: pp 4, M 4 runs it)."""
    schedules = [("zb_h1", {})]
    if (pp, m) != (2, 8):
        schedules.append(("zbv", {"num_layers_per_virtual_pipeline_stage": MODEL["n_layers"] // (2 * pp)}))
    return schedules


def _check_zero_bubble(rank: int, world: int, root: str) -> None:
    """ZB-H1 and ZB-V on pp 2 (dp 2) and pp 4, M 4 and 8 (see _zero_bubble_schedules), ZeRO-3 and
    ZeRO-2: losses and gradient norms within 1e-6 of 1F1B's, bitwise with optimize_backward_concat on
    and off. Each W runs one deferred GEMM per linear of its chunk; B starts no reduction; each unit
    reduces once per step, in its chunk's last W (one reduce-scatter at dp 2), and concatenates as often
    as under 1F1B. A ZB-V checkpoint resumes on 1F1B's loop placement."""
    for pp, m in itertools.product((2, 4), (4, 8)):
        layout = dict(pipeline_parallel_size=pp, batch_size=m, steps=2, reshard_after_forward=m == 4)
        _, plain = train(config(**layout), world)
        for schedule, chunks in _zero_bubble_schedules(pp, m):
            runs = []
            for optimize in (False, True):
                label = f"{schedule} pp{pp} m{m} optimize_backward_concat={optimize}"
                cfg = config(pipeline_schedule=schedule, optimize_backward_concat=optimize, **layout, **chunks)
                trainer = make_trainer(cfg, world)
                record = _zero_bubble_step_record(trainer)
                resumes = schedule == "zbv" and optimize and m == 8
                with counting_concats() as concats:
                    metrics = [trainer.train_step(1)]
                    if resumes:
                        saved = save_checkpoint(Path(root) / f"zbv_pp{pp}_m{m}", 1,
                                                checkpoint_state_of(trainer, rank, 1), dist.group.WORLD, rank, {})
                    metrics.append(trainer.train_step(2))
                if resumes:
                    _resume_on_1f1b(saved, layout, plain, rank, world)
                runs.append(reference_of(metrics))
                assert_matches(metrics, reference_of(plain), label, rel=1e-6)
                _check_zero_bubble_work(trainer, record, concats[0], metrics[-1].comm, optimize, label, world)
            assert runs[0] == runs[1], (schedule, pp, m, runs)


def _check_zero_bubble_work(trainer, record: list, concats: int, ledger: dict, optimize: bool, label: str,
                            world: int) -> None:
    m, pp = trainer.cfg.num_microbatches, trainer.mesh.dims.pp
    units = [len(root.units) for root in trainer.roots]
    assert concats == 2 * sum(units) * (1 if optimize else m), (label, concats)
    linears = [sum(isinstance(x, (ColumnParallelLinear, RowParallelLinear)) for x in chunk.modules())
               for chunk in trainer.chunks]
    assert all(linears) and len(record) == 2 * 2 * m * len(trainer.chunks), (label, record)
    for op, chunk, mb, works, reductions in record:
        last = op == "W" and mb == m - 1
        assert reductions == (units[chunk] if last else 0), (label, record)
        assert works == (linears[chunk] + units[chunk] if last else linears[chunk] if op == "W" else 0), (label, record)
    assert ledger.get("reduce_scatter", {"count": 0})["count"] == (sum(units) if world > pp else 0), (label, ledger)


def _resume_on_1f1b(saved, layout: dict, plain: list, rank: int, world: int) -> None:
    """Step 1's checkpoint of a ZB-V trainer, loaded into a 1F1B one: its step 2 is 1F1B's."""
    loop = make_trainer(config(**layout), world)
    rng = RNGStreams(0, 0, torch.device("cpu"))
    assert load_into(saved, checkpoint_state_of(loop, rank, 0), rng, FixedSampler(), dist.group.WORLD) == 1
    assert_matches([loop.train_step(2)], {key: values[1:] for key, values in reference_of(plain).items()},
                   "a ZB-V checkpoint resumed under 1f1b", rel=1e-6)


def _check_a_loader_of_other_shapes_is_refused(rank: int, world: int) -> None:
    """The loss divides by the config's token count: sequences shorter than seq_len would scale the loss
    and every gradient wrongly, so the step refuses them before computing anything."""
    trainer = make_trainer(config(batch_size=2, steps=1), world)
    batch = trainer.loader.batch
    trainer.loader.batch = lambda step: [(tokens[:, :-1], targets[:, :-1]) for tokens, targets in batch(step)]
    with pytest.raises(RuntimeError, match=rf"microbatches of shapes \[\(1, {SEQ - 1}\)\]; the config needs 2 of \(1, {SEQ}\)"):
        trainer.train_step(1)


def _p2p_held(cfg, world: int) -> tuple[int, int, int]:
    """One step: the runtime's peak of outgoing tensors and bytes, and the most sent tensors alive at
    once by weak references; every stage output handed to a send must have lost its data."""
    trainer = make_trainer(cfg, world)
    runtime, sent, alive = trainer.runtime, [], [0]
    post, forward = comm.batch_isend_irecv, runtime._forward

    def posting(ops, group, label=""):
        sent.extend(weakref.ref(tensor) for is_send, tensor, _ in ops if is_send)
        alive[0] = max(alive[0], sum(ref() is not None for ref in sent))
        return post(ops, group, label)

    def forwarding(a, *args):
        forward(a, *args)
        consumer = runtime.stages[a.chunk] + 1  # a local consumer (the V's turn) keeps the data
        if consumer < runtime.num_stages and consumer not in runtime.stages:
            assert runtime._saved[(a.chunk, a.microbatch)][1].untyped_storage().nbytes() == 0, a

    comm.batch_isend_irecv, runtime._forward = posting, forwarding
    try:
        trainer.train_step(1)
    finally:
        comm.batch_isend_irecv = post
    assert sent and all(ref() is None for ref in sent)
    return runtime.peak_p2p_tensors, runtime.peak_p2p_bytes, alive[0]


def _check_p2p_memory_is_independent_of_the_microbatch_count(rank: int, world: int) -> None:
    """1F1B and interleaved at pp 2 and 4, and ZB-V at pp 2, hold the same outgoing tensors at M=4 and
    M=16, two at most."""
    layouts = ((2, None, "1f1b"), (4, None, "1f1b"), (2, 2, "1f1b"), (4, 1, "1f1b"), (2, 2, "zbv"))
    for pp, per_stage, schedule in layouts:
        layers = {} if per_stage is None else {"num_layers_per_virtual_pipeline_stage": per_stage}
        held = [_p2p_held(config(pipeline_parallel_size=pp, pipeline_schedule=schedule, batch_size=m, steps=1,
                                 **layers), world) for m in (4, 16)]
        assert held[0] == held[1] and held[0][0] <= 2, (pp, per_stage, schedule, held)
        assert held[0][1] == held[0][0] * SEQ * MODEL["dim"] * 4, (pp, per_stage, schedule, held)


def _check_uneven_stages(rank: int, world: int, reference: list[float], root: str) -> None:
    """n_layers=6 as 1, 2, 2, 1 layers on pp=4, and as 1, 2 | 2, 1 over two chunks on pp=2, match one
    process; a checkpoint of the 1, 2, 2, 1 split after step 2 resumes on the even pp=2 split (3, 3) as it
    continues: step 3 checks the weights, step 4 Adam's moments and step counts (step 3 updated with them)."""
    uneven = dict(model={"n_layers": 6}, steps=UNEVEN_STEPS, pipeline_first_stage_layers=1, pipeline_last_stage_layers=1)
    layouts = {"pp4 1-2-2-1": config(pipeline_parallel_size=4, batch_size=4, **uneven),
               "pp2 vpp2 1-2-2-1": config(pipeline_parallel_size=2, num_layers_per_virtual_pipeline_stage=2,
                                          batch_size=2, **uneven)}
    for label, cfg in layouts.items():
        trainer = make_trainer(cfg, world)
        per_rank = [[1], [2], [2], [1]] if cfg.pipeline_parallel_size == 4 else [[1, 2], [2, 1]]
        assert [len(chunk.layers) for chunk in trainer.chunks] == per_rank[trainer.mesh.rank_in("pp")], label
        metrics = []
        for step in range(1, UNEVEN_STEPS + 1):
            metrics.append(trainer.train_step(step))
            if cfg.pipeline_parallel_size == 4 and step == 2:
                saved = save_checkpoint(Path(root) / "uneven", step, checkpoint_state_of(trainer, rank, step),
                                        dist.group.WORLD, rank, {})
        assert_matches(metrics, reference, label)
    even = make_trainer(config(model={"n_layers": 6}, steps=UNEVEN_STEPS, pipeline_parallel_size=2, batch_size=2), world)
    rng = RNGStreams(0, 0, torch.device("cpu"))
    assert load_into(saved, checkpoint_state_of(even, rank, 0), rng, FixedSampler(), dist.group.WORLD) == 2
    last = {key: values[2:] for key, values in reference.items()}
    assert_matches([even.train_step(step) for step in (3, 4)], last, "the 1-2-2-1 checkpoint on the even pp2 split")


def _pipeline_ranks(rank: int, world: int, reference: dict, reference_6_layers: dict, root: str) -> None:
    _check_uneven_stages(rank, world, reference_6_layers[4], root)
    _check_p2p_memory_is_independent_of_the_microbatch_count(rank, world)
    _check_layouts(rank, world, reference)
    _check_one_concat_per_unit(rank, world)
    _check_composition_on_4_ranks(rank, world, reference)
    _check_each_chunk_reduces_in_its_own_last_backward(rank, world)
    _check_zero_bubble(rank, world, root)
    _check_a_loader_of_other_shapes_is_refused(rank, world)


def test_pipeline_layouts_match_one_process(reference, reference_6_layers, tmp_path):
    run_ranks(4, _pipeline_ranks, reference, reference_6_layers, str(tmp_path))


def _composition(rank: int, world: int, reference: dict) -> None:
    """tp=2 (SP) x pp=2 x dp=2, n_layers=8: 4 layers per virtual stage for gpipe/1f1b/zb_h1, 2 for interleaved
    and zbv; fp32 with fused gradient accumulation under 1f1b, zb_h1 and zbv."""
    for schedule, per_stage in (("gpipe", 4), ("1f1b", 4), ("interleaved_1f1b", 2), ("zb_h1", 4), ("zbv", 2)):
        layout = dict(model_parallel_size=2, pipeline_parallel_size=2, batch_size=4, pipeline_schedule=schedule,
                      num_layers_per_virtual_pipeline_stage=per_stage, model={"sequence_parallel": True})
        # Two steps: the second step's loss already carries every gradient of the first.
        bf16 = [reference_of(train(config(**layout, compute_dtype="bf16", optimize_backward_concat=opt, steps=2),
                                   world)[1]) for opt in (False, True)]
        assert bf16[0] == bf16[1], (schedule, bf16)
        fused = schedule in ("1f1b", "zb_h1", "zbv")
        _, fp32 = train(config(**layout, optimize_backward_concat=True, gradient_accumulation_fusion=fused), world)
        assert_matches(fp32, reference[8], f"tp2 pp2 dp2 {schedule}")


def test_tp_pp_dp_composition(reference):
    run_ranks(8, _composition, reference)
