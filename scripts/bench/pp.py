"""Our pipeline runtime against torch.distributed.pipelining, runtime against runtime on the same plain
modules, plus what fused gradient accumulation gains, what our FSDP units cost with nothing to shard,
the measured bubble beside the simulated one, and the p2p bytes a rank holds. CPU gloo, pp = 2 ranks
of one thread each (one core per rank).

Five sides per configuration (schedule 1f1b, interleaved_1f1b, zb_h1 or zbv; M), built from the same weights:
- "ours": our PipelineRuntime driving plain chunks (the trainer's chunk modules, no FSDP units),
  with the trainer's loss (token-loss sum over the global token count); under zb_h1 and zbv every linear
  weight gets a gradient sink that adds into its `.grad`, so B leaves the weight-gradient GEMMs to W
  as FSDP units' sinks do (the bench checks that W ran one per linear weight and microbatch);
- "fused": the same with fusing sinks on every linear weight, on every schedule: each weight-gradient
  GEMM runs into `.grad` (gradient_accumulation_fusion's plain-module form, parallel/weight_grads.py);
- "torch": `Schedule1F1B` / `ScheduleInterleaved1F1B` / `ScheduleInterleavedZeroBubble` (ZB1P, here
  with one stage per rank: the layout of our zb_h1) / `ScheduleZBVZeroBubble` (two stages per rank in
  a V, our zbv's layout) over `PipelineStage`s holding plain chunks with the same weights, the same
  loss (scale_grads=False);
- "units": the trainer's own step path (StepRunner: FSDP units in a shard group of one rank,
  the default reshard_after_forward=true, under which each microbatch's forward and backward unshard
  every unit, and optimize_backward_concat=true), its gradient sync included;
- "units_fused": the same with gradient_accumulation_fusion=true.

Each runs one step's pipelined forward + backward (M microbatches of 1 sequence, fp32); the optimizer
is left out. Step 0's losses and every parameter's gradient are compared across the sides.

Timing: each configuration runs in fresh processes, its sides interleaved by rounds (each round:
K steps of each side, sides in rotating order), so machine noise hits them alike (all sixteen
configurations' modules in one process made every step about 15% slower, and unevenly). A step's time is the
slowest rank's (a barrier before each step); the table gives medians, and ratios are medians over
rounds of per-round ratios. Bubble: from our runtime's per-action timestamps, the idle share of each
rank between the step's first start and last end, averaged over ranks (the simulator's definition),
beside the simulator's for the same program in the runtime's mode on gloo (receives posted a batch
ahead, sends waited at the next batch), with each chunk's measured mean forward, backward and (zb_h1,
zbv) weight-gradient times and free p2p,
and beside torch's, from its stages' forward, backward and weight-gradient calls (its loss, about a
millisecond per microbatch, runs outside them). Peak p2p: the most bytes of outgoing tensors our runtime
held at once on any rank.

    python scripts/bench/pp.py [--model small] [--seq 128] [--rounds 5] [--steps-per-round 2] [--quick]
"""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from torch.distributed.pipelining import (  # noqa: E402
    PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble,
)

from model.init import init_weights  # noqa: E402
from parallel import comm, weight_grads  # noqa: E402
from parallel.fsdp.flat_param import unflatten  # noqa: E402
from parallel.mesh import ParallelMesh  # noqa: E402
from parallel.pipeline.channels import channel_count  # noqa: E402
from parallel.pipeline.runtime import PipelineRuntime, PlainChunkRoot  # noqa: E402
from parallel.pipeline.layers import rank_stages  # noqa: E402
from parallel.pipeline.schedule import Action, pipeline_actions, splits_backward  # noqa: E402
from parallel.pipeline.simulate import CostFn, simulate  # noqa: E402
from parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, TPContext  # noqa: E402
from scripts.bench.agreement import require_agreement, worst  # noqa: E402
from scripts.bench.ranks import spawn  # noqa: E402
from trainer.config.rules import validate  # noqa: E402
from trainer.config.schema import TrainConfig, from_dict  # noqa: E402
from trainer.parallelize import build_chunks  # noqa: E402
from trainer.step import StepRunner, token_loss_sum  # noqa: E402

PP = 2
SIDES = ("ours", "fused", "torch", "units", "units_fused")
SCHEDULES = ("1f1b", "interleaved_1f1b", "zb_h1", "zbv")
Grads = dict[str, torch.Tensor]


class RandomTokens:
    """The trainer's loader interface over random tokens (dp = 1: the whole global batch)."""

    def __init__(self, microbatches: int, seq: int, vocab: int):
        self.microbatches, self.seq, self.vocab = microbatches, seq, vocab

    def tokens(self, step: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(step)
        return torch.randint(0, self.vocab, (self.microbatches, self.seq + 1), generator=gen)

    def batch(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        tokens = self.tokens(step)
        return [(tokens[i : i + 1, :-1], tokens[i : i + 1, 1:]) for i in range(self.microbatches)]


def bench_config(model: str, seq: int, pp: int, schedule: str, m: int) -> TrainConfig:
    raw = OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "model" / f"{model}.yaml"))
    per_stage = raw["n_layers"] // (2 * pp) if schedule in ("interleaved_1f1b", "zbv") else None
    return from_dict({"model": raw, "seq_len": seq, "batch_size": m, "pipeline_parallel_size": pp,
                      "pipeline_schedule": schedule, "num_layers_per_virtual_pipeline_stage": per_stage,
                      "reshard_after_forward": True, "optimize_backward_concat": True})


def plain_chunks(cfg: TrainConfig, rank: int) -> list[torch.nn.Module]:
    chunks = build_chunks(cfg, TPContext(), rank)
    for chunk in chunks:
        chunk.to_empty(device="cpu")
        init_weights(chunk, cfg.model, cfg.seed)
    return chunks


def take_plain_grads(chunks: list[torch.nn.Module], grads: Grads | None) -> None:
    """Hand the step's gradients over into `grads` (when asked for) and clear them for the next step."""
    for c, chunk in enumerate(chunks):
        for n, p in chunk.named_parameters():
            if grads is not None:
                grads[f"{c}.{n}"] = p.grad
            p.grad = None


class GradSinks:
    """Weight-gradient sinks for plain chunks (parallel/weight_grads.py's DotGradSink, into `.grad`). In a
    zero-bubble B a linear defers its weight-gradient GEMM only when its weight has a sink (FSDP units
    give theirs one); fusing sinks take the GEMM into `.grad` in every backward, as fused units do."""

    def __init__(self, chunks: list[torch.nn.Module], fuses: bool = False):
        self.weights = [m.weight for chunk in chunks for m in chunk.modules()
                        if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
        self.sinks = [weight_grads.DotGradSink(weight, fuses) for weight in self.weights]
        for weight, sink in zip(self.weights, self.sinks):
            weight_grads.set_sink(weight, sink)

    @property
    def calls(self) -> int:
        return sum(sink.calls for sink in self.sinks)


class Units:
    """The trainer's step path: FSDP units in a shard group of one rank."""

    def __init__(self, cfg: TrainConfig, world: int, fused: bool = False):
        cfg = dataclasses.replace(cfg, gradient_accumulation_fusion=fused)
        self.trainer = StepRunner.build(cfg, ParallelMesh(validate(cfg, world), "cpu"),
                                        RandomTokens(cfg.num_microbatches, cfg.seq_len, cfg.model.vocab_size),
                                        torch.device("cpu"))

    def step(self, step: int, grads: Grads | None = None) -> float:
        loss = self.trainer._forward_backward(step + 1)  # the trainer's steps are 1-based
        for root in self.trainer.roots:
            root.finish_gradient_sync()
        if grads is not None:
            for c, root in enumerate(self.trainer.roots):
                for unit in root.units:
                    for name, grad in unflatten(unit.flat_param.grad, unit.spec).items():
                        grads[f"{c}.{unit.name}.{name}"] = grad
        self.trainer.optimizer.zero_grad()
        return loss.item()


class Ours:
    """Our runtime over plain chunks, on the units side's pipeline communicators."""

    def __init__(self, cfg: TrainConfig, mesh: ParallelMesh, fused: bool = False):
        rank, pp, vpp = dist.get_rank(), cfg.pipeline_parallel_size, cfg.virtual_pipeline_stages
        self.chunks, self.m = plain_chunks(cfg, rank), cfg.num_microbatches
        self.sinks = GradSinks(self.chunks, fused) if fused or splits_backward(cfg.pipeline_schedule) else None
        self.data = RandomTokens(self.m, cfg.seq_len, cfg.model.vocab_size)
        program = list(pipeline_actions(cfg.pipeline_schedule, pp, vpp, self.m)[rank])
        self.runtime = PipelineRuntime(program, pp, self.chunks, [PlainChunkRoot()] * vpp, mesh.group("pp"),
                                       (1, cfg.seq_len, cfg.model.dim), torch.float32, torch.device("cpu"),
                                       mesh.pipeline_channels(channel_count(pp, vpp)), cfg.pipeline_v_shape)

    def step(self, step: int, grads: Grads | None = None) -> float:
        tokens, total = self.data.tokens(step), [0.0]

        def loss(logits: torch.Tensor, mb: int) -> torch.Tensor:
            mb_loss = token_loss_sum(logits, tokens[mb : mb + 1, 1:])
            total[0] += mb_loss.item()
            return mb_loss / (self.m * self.data.seq)

        calls = self.sinks.calls if self.sinks else 0
        self.runtime.run_step(lambda mb: tokens[mb : mb + 1, :-1], loss)
        if self.sinks and self.sinks.calls - calls != len(self.sinks.weights) * self.m:
            raise RuntimeError(f"the sinks took {self.sinks.calls - calls} weight-gradient GEMMs, not one per linear "
                               f"weight and microbatch ({len(self.sinks.weights)} x {self.m})")
        take_plain_grads(self.chunks, grads)
        return total[0]


class Torch:
    """torch.distributed.pipelining over plain chunks with the same weights."""

    def __init__(self, cfg: TrainConfig):
        rank, pp = dist.get_rank(), cfg.pipeline_parallel_size
        self.chunks = plain_chunks(cfg, rank)
        self.data = RandomTokens(cfg.num_microbatches, cfg.seq_len, cfg.model.vocab_size)
        indices = rank_stages(pp, len(self.chunks), rank, cfg.pipeline_v_shape)
        self.first, self.last = 0 in indices, pp * len(self.chunks) - 1 in indices
        stages = [self._stage(cfg, chunk, index, pp * len(self.chunks)) for chunk, index in zip(self.chunks, indices)]
        # Set to a list to record (action, start, end) of every compute, as our runtime's trace does.
        self.trace: list[tuple[Action, float, float]] | None = None
        for c, stage in enumerate(stages):
            self._traced(stage, c)
        global_tokens, m = cfg.num_microbatches * cfg.seq_len, cfg.num_microbatches
        loss = lambda logits, targets: token_loss_sum(logits, targets) / global_tokens  # noqa: E731
        if cfg.pipeline_schedule == "zb_h1":  # ZB1P; with one stage per rank, ZB-H1's layout
            self.schedule = ScheduleInterleavedZeroBubble(stages, m, loss_fn=loss, scale_grads=False)
        elif cfg.pipeline_schedule == "zbv":
            self.schedule = ScheduleZBVZeroBubble(stages, m, loss_fn=loss, scale_grads=False)
        elif len(stages) == 1:
            self.schedule = Schedule1F1B(stages[0], m, loss_fn=loss, scale_grads=False)
        else:
            self.schedule = ScheduleInterleaved1F1B(stages, m, loss_fn=loss, scale_grads=False)

    def _traced(self, stage: PipelineStage, chunk: int) -> None:
        """Wrap the stage's forward, backward and weight-gradient calls to record them when tracing."""
        for op, name in (("F", "forward_one_chunk"), ("B", "backward_one_chunk"), ("W", "backward_weight_one_chunk")):
            call = getattr(stage, name)

            def traced(mb: int, *args, call=call, op=op, **kwargs):
                start = time.time()
                out = call(mb, *args, **kwargs)
                if self.trace is not None:
                    self.trace.append((Action(dist.get_rank(), op, chunk, mb), start, time.time()))
                return out

            setattr(stage, name, traced)

    @staticmethod
    def _stage(cfg: TrainConfig, chunk: torch.nn.Module, index: int, num_stages: int) -> PipelineStage:
        """Shapes given up front: torch's shape inference would run an extra forward."""
        hidden = torch.empty(1, cfg.seq_len, cfg.model.dim, requires_grad=True)
        tokens = torch.zeros(1, cfg.seq_len, dtype=torch.int64)
        logits = torch.empty(1, cfg.seq_len, cfg.model.vocab_size, requires_grad=True)
        return PipelineStage(chunk, index, num_stages, torch.device("cpu"),
                             input_args=(tokens if index == 0 else hidden,),
                             output_args=logits if index == num_stages - 1 else hidden)

    def step(self, step: int, grads: Grads | None = None) -> float:
        tokens, losses = self.data.tokens(step), []
        args = (tokens[:, :-1],) if self.first else ()
        kwargs = {"target": tokens[:, 1:], "losses": losses} if self.last else {}
        self.schedule.step(*args, **kwargs)
        take_plain_grads(self.chunks, grads)
        return sum(loss.item() for loss in losses) * self.data.microbatches * self.data.seq if self.last else 0.0


def timed(runner, step: int) -> float:
    comm.barrier(comm.world())
    start = time.perf_counter()
    runner.step(step)
    return max(comm.all_gather_object(time.perf_counter() - start, comm.world()))


def measured_bubble(trace: list) -> tuple[float, CostFn]:
    """From every rank's trace: the idle share of each rank between the step's first start and last end,
    averaged over ranks, and each chunk's mean forward, backward (B) and weight-gradient (W) times as
    simulator costs (stages differ: the first holds the embedding, the last the head and the loss)."""
    per_rank = comm.all_gather_object(trace, comm.world())
    start = min(s for t in per_rank for _, s, _ in t)
    makespan = max(e for t in per_rank for _, _, e in t) - start
    busy = [sum(e - s for a, s, e in t if a.is_compute) for t in per_rank]
    spans: dict[tuple[int, int, str], list[float]] = {}
    for t in per_rank:
        for a, s, e in t:
            if a.is_compute:
                spans.setdefault((a.rank, a.chunk, a.op), []).append(e - s)
    means = {key: statistics.mean(times) for key, times in spans.items()}
    return sum(1 - b / makespan for b in busy) / len(busy), lambda a: means.get((a.rank, a.chunk, a.op), 0.0)


def grad_rel_diff(a: Grads, b: Grads) -> float:
    """Largest gradient difference relative to the gradient's largest entry, over this rank's parameters,
    worst over ranks."""
    if a.keys() != b.keys():
        raise RuntimeError(f"the sides hold different parameters: {sorted(a.keys() ^ b.keys())[:3]}")
    local = max(((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-30)).item() for k in a)
    return max(comm.all_gather_object(local, comm.world()))


def run_pp(rank: int, world: int, model: str, seq: int, rounds: int, k: int, schedule: str, m: int) -> dict:
    """One configuration's sides, in processes of their own."""
    torch.set_num_threads(1)
    cfg = bench_config(model, seq, world, schedule, m)
    units = Units(cfg, world)
    mesh = units.trainer.mesh
    sides = (Ours(cfg, mesh), Ours(cfg, mesh, fused=True), Torch(cfg), units, Units(cfg, world, fused=True))
    check = _step_zero(sides)  # also the warmup
    times = [[] for _ in SIDES]
    for r in range(rounds):
        for side in range(r % len(SIDES), r % len(SIDES) + len(SIDES)):
            side %= len(SIDES)
            times[side].append([timed(sides[side], 1 + s) for s in range(k)])
    return _result(cfg, world, sides, times, check)


def _step_zero(sides) -> dict:
    grads = dict(zip(SIDES, ({} for _ in sides)))
    losses = [comm_sum(side.step(0, grads[name])) for side, name in zip(sides, SIDES)]
    return {"loss": worst(abs(x - losses[0]) / losses[0] for x in losses),
            "grad_torch": grad_rel_diff(grads["ours"], grads["torch"]),
            "grad_fused": grad_rel_diff(grads["fused"], grads["ours"]),
            "grad_units": worst(grad_rel_diff(grads[u], grads["ours"]) for u in ("units", "units_fused"))}


def _ratio(a: list[list[float]], b: list[list[float]]) -> float:
    """Median over rounds of the per-round ratio of medians."""
    return statistics.median(statistics.median(x) / statistics.median(y) for x, y in zip(a, b))


def _result(cfg: TrainConfig, world: int, sides: tuple, times: list, check: dict) -> dict:
    ours, torch_side = sides[SIDES.index("ours")], sides[SIDES.index("torch")]
    ours.runtime.trace = torch_side.trace = []
    ours.step(99)
    bubble, costs = measured_bubble(ours.runtime.trace)
    torch_side.step(99)
    torch_bubble, _ = measured_bubble(torch_side.trace)
    ours.runtime.trace = torch_side.trace = None
    vpp = cfg.virtual_pipeline_stages
    program = pipeline_actions(cfg.pipeline_schedule, world, vpp, cfg.num_microbatches)
    simulated = simulate(program, world, vpp, costs, sends_block=False, receives_ahead=True,
                         v_shape=cfg.pipeline_v_shape).bubble_fraction
    ms = {side: 1e3 * statistics.median(t for rnd in rounds for t in rnd) for side, rounds in zip(SIDES, times)}
    p2p = max(comm.all_gather_object(ours.runtime.peak_p2p_bytes, comm.world()))
    t = dict(zip(SIDES, times))
    return {"schedule": cfg.pipeline_schedule, "m": cfg.num_microbatches, "ms": ms,
            "vs_torch": _ratio(t["ours"], t["torch"]), "fused_vs_torch": _ratio(t["fused"], t["torch"]),
            "units": _ratio(t["units"], t["ours"]), "units_fused_vs_torch": _ratio(t["units_fused"], t["torch"]),
            "fused_vs_ours": _ratio(t["fused"], t["ours"]), "units_fused_vs_units": _ratio(t["units_fused"], t["units"]),
            "bubble": bubble, "torch_bubble": torch_bubble, "simulated": simulated, "p2p_mib": p2p / 2**20, **check}


def comm_sum(value: float) -> float:
    """The last stage's loss, on every rank (a sum where the other stages hold zero)."""
    t = torch.tensor([value], dtype=torch.float64)
    comm.all_reduce(t, comm.world())
    return t.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps-per-round", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="2 rounds of 1 step")
    opts = parser.parse_args()
    if opts.quick:
        opts.rounds, opts.steps_per_round = 2, 1
    print(f"torch {torch.__version__}, model={opts.model}, seq {opts.seq}, microbatch 1, fp32, CPU gloo, "
          f"pp={PP}, 1 thread/rank")
    print("| schedule | M | ours ms | ours fused ms | torch ms | units ms | units fused ms | ours / torch | "
          "ours fused / torch | units fused / torch | fused / unfused (ours, units) | units / ours | bubble measured | "
          "bubble simulated | torch bubble measured | peak p2p MiB | loss rel diff | grad rel diff (torch, fused, units) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---|")
    diffs = []
    for schedule, m in ((s, m) for s in SCHEDULES for m in (PP, 2 * PP, 4 * PP, 2 * PP - 1)):
        r = spawn(PP, run_pp, opts.model, opts.seq, opts.rounds, opts.steps_per_round, schedule, m)
        diffs += [r["loss"], r["grad_torch"], r["grad_fused"], r["grad_units"]]
        print(f"| {r['schedule']} | {r['m']} | " + " | ".join(f"{r['ms'][side]:.0f}" for side in SIDES) +
              f" | {r['vs_torch']:.3f} | {r['fused_vs_torch']:.3f} | {r['units_fused_vs_torch']:.3f} | "
              f"{r['fused_vs_ours']:.3f}, {r['units_fused_vs_units']:.3f} | {r['units']:.3f} | {r['bubble']:.1%} | {r['simulated']:.1%} | {r['torch_bubble']:.1%} | "
              f"{r['p2p_mib']:.2f} | {r['loss']:.1e} | {r['grad_torch']:.1e}, {r['grad_fused']:.1e}, "
              f"{r['grad_units']:.1e} |", flush=True)
    print("\n" + require_agreement("step-0 losses and gradients of every side", worst(diffs), rtol=1e-5))


if __name__ == "__main__":
    main()
