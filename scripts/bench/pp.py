"""Our pipeline runtime against torch.distributed.pipelining over the same stage modules, plus the
measured bubble beside the simulated one. CPU gloo, world = pp ranks (dp = 1: neither side shards).

Ours: the trainer's own step path (StepRunner.build; the runtime's batched p2p, FSDP units with a shard
group of one, reshard_after_forward=false: with nothing sharded, re-gathering is only copying;
optimize_backward_concat=true, as the runtime marks microbatches; torch marks none, so over the same
chunks each microbatch's backward concatenates and adds its flat gradient). Torch: `Schedule1F1B` / `ScheduleInterleaved1F1B` over `PipelineStage`s holding the
same chunks (same layers, same weights, plain modules). Both run the pipelined forward + backward of
one step (M microbatches of 1 sequence, fp32, 1 thread per rank) with the same loss (token-loss sum
over the global token count; torch with scale_grads=False); the optimizer is left out of both.

Timing: all configurations of one pp live in the same pp processes and run interleaved by rounds
(each round: K steps of each), so machine noise hits them alike. A step's time is the slowest rank's
(a barrier before each step); the table gives medians and the median over rounds of the per-round
ours/torch ratio. Bubble: from our runtime's per-action wall-clock timestamps, the idle share of each
rank between the step's first start and last end, averaged over ranks (the simulator's definition),
beside the simulator's value for the same program with each rank's measured mean forward and
backward times (p2p free).

    python scripts/bench/pp.py [--model small] [--seq 128] [--rounds 5] [--steps-per-round 2] [--quick]
"""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B  # noqa: E402

from model.init import init_weights  # noqa: E402
from parallel import comm  # noqa: E402
from parallel.mesh import ParallelMesh  # noqa: E402
from parallel.pipeline.schedule import pipeline_actions  # noqa: E402
from parallel.pipeline.simulate import CostFn, simulate  # noqa: E402
from parallel.tensor_parallel import TPContext  # noqa: E402
from scripts.bench.agreement import require_agreement, worst  # noqa: E402
from scripts.bench.ranks import spawn  # noqa: E402
from trainer.config.rules import validate  # noqa: E402
from trainer.config.schema import TrainConfig, from_dict  # noqa: E402
from trainer.parallelize import build_chunks  # noqa: E402
from trainer.step import StepRunner  # noqa: E402
from trainer.step import token_loss_sum  # noqa: E402


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
    per_stage = raw["n_layers"] // (2 * pp) if schedule == "interleaved_1f1b" else None
    return from_dict({"model": raw, "seq_len": seq, "batch_size": m, "pipeline_parallel_size": pp,
                      "pipeline_schedule": schedule, "num_layers_per_virtual_pipeline_stage": per_stage,
                      "reshard_after_forward": False, "optimize_backward_concat": True})


class Ours:
    def __init__(self, cfg: TrainConfig, world: int):
        self.trainer = StepRunner.build(cfg, ParallelMesh(validate(cfg, world), "cpu"),
                                     RandomTokens(cfg.num_microbatches, cfg.seq_len, cfg.model.vocab_size),
                                     torch.device("cpu"))

    def step(self, step: int) -> float:
        loss = self.trainer._forward_backward(step + 1)  # the trainer's steps are 1-based
        for root in self.trainer.roots:
            root.finish_gradient_sync()
        self.trainer.optimizer.zero_grad()
        return loss.item()


class Torch:
    """torch.distributed.pipelining over this rank's chunks: ours with their FSDP units (`fsdp=True`: the
    same stage modules; torch marks no microbatch, so every backward adds its gradient into the
    one-rank shard, a local add) or plain modules with the same weights."""

    def __init__(self, cfg: TrainConfig, world: int, fsdp: bool):
        rank, pp = dist.get_rank(), cfg.pipeline_parallel_size
        self.data = RandomTokens(cfg.num_microbatches, cfg.seq_len, cfg.model.vocab_size)
        if fsdp:
            trainer = Ours(cfg, world).trainer
            self.chunks, self.roots = trainer.chunks, trainer.roots
        else:
            self.chunks, self.roots = build_chunks(cfg, TPContext(), rank), []
            for chunk in self.chunks:
                chunk.to_empty(device="cpu")
                init_weights(chunk, cfg.model, cfg.seed)
        global_tokens = cfg.num_microbatches * cfg.seq_len
        self.first, self.last = rank == 0, rank == pp - 1
        stages = [self._stage(cfg, chunk, c * pp + rank, pp * len(self.chunks)) for c, chunk in enumerate(self.chunks)]
        loss = lambda logits, targets: token_loss_sum(logits, targets) / global_tokens  # noqa: E731
        m = cfg.num_microbatches
        self.schedule = (Schedule1F1B(stages[0], m, loss_fn=loss, scale_grads=False) if len(stages) == 1
                         else ScheduleInterleaved1F1B(stages, m, loss_fn=loss, scale_grads=False))

    @staticmethod
    def _stage(cfg: TrainConfig, chunk: torch.nn.Module, index: int, num_stages: int) -> PipelineStage:
        """Shapes given up front: torch's shape inference would run an extra forward, which FSDP units
        rightly count as a forward whose backward never came."""
        hidden = torch.empty(1, cfg.seq_len, cfg.model.dim, requires_grad=True)
        tokens = torch.zeros(1, cfg.seq_len, dtype=torch.int64)
        logits = torch.empty(1, cfg.seq_len, cfg.model.vocab_size, requires_grad=True)
        return PipelineStage(chunk, index, num_stages, torch.device("cpu"),
                             input_args=(tokens if index == 0 else hidden,),
                             output_args=logits if index == num_stages - 1 else hidden)

    def step(self, step: int) -> float:
        tokens, losses = self.data.tokens(step), []
        args = (tokens[:, :-1],) if self.first else ()
        kwargs = {"target": tokens[:, 1:], "losses": losses} if self.last else {}
        self.schedule.step(*args, **kwargs)
        for root in self.roots:
            root.finish_gradient_sync()
        for chunk in self.chunks:
            chunk.zero_grad(set_to_none=True)
        return sum(loss.item() for loss in losses) * self.data.microbatches * self.data.seq if self.last else 0.0


def timed(runner, step: int) -> float:
    comm.barrier(comm.world())
    start = time.perf_counter()
    runner.step(step)
    return time.perf_counter() - start


def measured_bubble(trace: list) -> tuple[float, CostFn]:
    """From every rank's trace: the idle share of each rank between the step's first start and last end,
    averaged over ranks, and each rank's mean forward and backward times as simulator costs (stages
    differ: the first holds the embedding, the last the head and the loss)."""
    per_rank = comm.all_gather_object(trace, comm.world())
    start = min(s for t in per_rank for _, s, _ in t)
    makespan = max(e for t in per_rank for _, _, e in t) - start
    busy = [sum(e - s for a, s, e in t if a.is_compute) for t in per_rank]
    means = {(rank, op): statistics.mean(e - s for a, s, e in t if a.op == op)
             for rank, t in enumerate(per_rank) for op in ("F", "B")}
    return sum(1 - b / makespan for b in busy) / len(busy), lambda a: means.get((a.rank, a.op), 0.0)


SIDES = ("ours", "torch_fsdp_chunks", "torch_plain")


def run_pp(rank: int, world: int, model: str, seq: int, rounds: int, k: int) -> list[dict]:
    configs = [bench_config(model, seq, world, s, m) for s in ("1f1b", "interleaved_1f1b") for m in (2 * world, 4 * world)]
    runners = [(Ours(cfg, world), Torch(cfg, world, fsdp=True), Torch(cfg, world, fsdp=False)) for cfg in configs]
    losses = [[comm_sum(side.step(0)) for side in sides] for sides in runners]  # also the warmup
    times = [[[] for _ in SIDES] for _ in configs]
    for r in range(rounds):
        for i in range(len(configs)):
            j = (i + r) % len(configs)
            for side in range((i + r) % len(SIDES), (i + r) % len(SIDES) + len(SIDES)):
                side %= len(SIDES)
                times[j][side].append([max(comm.all_gather_object(timed(runners[j][side], 1 + s), comm.world()))
                                       for s in range(k)])
    return [_result(cfg, world, sides[0], t, loss) for cfg, sides, t, loss in zip(configs, runners, times, losses)]


def _ratio(a: list[list[float]], b: list[list[float]]) -> float:
    """Median over rounds of the per-round ratio of medians."""
    return statistics.median(statistics.median(x) / statistics.median(y) for x, y in zip(a, b))


def _result(cfg: TrainConfig, world: int, ours: Ours, times: list, losses: list[float]) -> dict:
    ours.trainer.runtime.trace = []
    ours.step(99)
    bubble, costs = measured_bubble(ours.trainer.runtime.trace)
    ours.trainer.runtime.trace = None
    vpp = cfg.virtual_pipeline_stages
    program = pipeline_actions(cfg.pipeline_schedule, world, vpp, cfg.num_microbatches)
    simulated = simulate(program, world, vpp, costs).bubble_fraction
    ms = {side: 1e3 * statistics.median(t for rnd in rounds for t in rnd) for side, rounds in zip(SIDES, times)}
    return {
        "pp": world, "schedule": cfg.pipeline_schedule, "m": cfg.num_microbatches, "ms": ms,
        "vs_same": _ratio(times[0], times[1]), "vs_plain": _ratio(times[0], times[2]),
        "bubble": bubble, "simulated": simulated, "loss_rel_diff": worst(abs(x - losses[0]) / losses[0] for x in losses),
    }


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
    print(f"torch {torch.__version__}, model={opts.model}, seq {opts.seq}, microbatch 1, fp32, CPU gloo, 1 thread/rank")
    print("| pp | schedule | M | ours ms | torch (same chunks) ms | torch (plain) ms | ours / torch same | "
          "ours / torch plain | bubble measured | bubble simulated | loss rel diff |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    diffs = []
    for pp in (2, 4):
        for r in spawn(pp, run_pp, opts.model, opts.seq, opts.rounds, opts.steps_per_round):
            diffs.append(r["loss_rel_diff"])
            ms = r["ms"]
            print(f"| {r['pp']} | {r['schedule']} | {r['m']} | {ms['ours']:.0f} | {ms['torch_fsdp_chunks']:.0f} | "
                  f"{ms['torch_plain']:.0f} | {r['vs_same']:.3f} | {r['vs_plain']:.3f} | {r['bubble']:.1%} | "
                  f"{r['simulated']:.1%} | {r['loss_rel_diff']:.1e} |", flush=True)
    print("\n" + require_agreement("step-0 losses of ours and torch (same chunks, plain)", worst(diffs), rtol=1e-6))


if __name__ == "__main__":
    main()
