"""Our pipeline runtime against torch.distributed.pipelining over the same stage modules, plus the
measured bubble beside the simulated one. CPU gloo, world = pp ranks (dp = 1: neither side shards).

Ours: the trainer's own step path (build_trainer; the runtime's batched p2p, FSDP units with a shard
group of one). Torch: `Schedule1F1B` / `ScheduleInterleaved1F1B` over `PipelineStage`s holding the
same chunks (same layers, same weights, plain modules). Both run the pipelined forward + backward of
one step (M microbatches of 1 sequence, fp32, 1 thread per rank) with the same loss (token-loss sum
over the global token count; torch with scale_grads=False); the optimizer is left out of both.

Timing: all configurations of one pp live in the same pp processes and run interleaved by rounds
(each round: K steps of each), so machine noise hits them alike. A step's time is the slowest rank's
(a barrier before each step); the table gives medians and the median over rounds of the per-round
ours/torch ratio. Bubble: from our runtime's per-action wall-clock timestamps, the idle share of each
rank between the step's first start and last end, averaged over ranks (the simulator's definition),
beside the simulator's value for the same program with the measured mean forward and backward times.

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
from parallel.pipeline.simulate import simulate, uniform_costs  # noqa: E402
from parallel.tensor_parallel import TPContext  # noqa: E402
from scripts.bench.ranks import spawn  # noqa: E402
from trainer.config import TrainConfig, from_dict  # noqa: E402
from trainer.loop import token_loss_sum  # noqa: E402
from trainer.parallelize import build_chunks  # noqa: E402
from trainer.run import build_trainer  # noqa: E402
from trainer.validate import validate  # noqa: E402


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
                      "pipeline_schedule": schedule, "num_layers_per_virtual_pipeline_stage": per_stage})


class Ours:
    def __init__(self, cfg: TrainConfig, world: int):
        self.trainer = build_trainer(cfg, ParallelMesh(validate(cfg, world), "cpu"),
                                     RandomTokens(cfg.num_microbatches, cfg.seq_len, cfg.model.vocab_size),
                                     torch.device("cpu"))

    def step(self, step: int) -> float:
        loss = self.trainer._forward_backward(step)
        for root in self.trainer.roots:
            root.finish_gradient_sync()
        self.trainer.optimizer.zero_grad()
        return loss.item()


class Torch:
    def __init__(self, cfg: TrainConfig, world: int):
        rank, pp = dist.get_rank(), cfg.pipeline_parallel_size
        self.data = RandomTokens(cfg.num_microbatches, cfg.seq_len, cfg.model.vocab_size)
        self.chunks = build_chunks(cfg, TPContext(), rank)
        for chunk in self.chunks:
            chunk.to_empty(device="cpu")
            init_weights(chunk, cfg.model_args(), cfg.seed)
        global_tokens = cfg.num_microbatches * cfg.seq_len
        self.first, self.last = rank == 0, rank == pp - 1
        stages = [PipelineStage(chunk, c * pp + rank, pp * len(self.chunks), torch.device("cpu"))
                  for c, chunk in enumerate(self.chunks)]
        loss = lambda logits, targets: token_loss_sum(logits, targets) / global_tokens  # noqa: E731
        m = cfg.num_microbatches
        self.schedule = (Schedule1F1B(stages[0], m, loss_fn=loss, scale_grads=False) if len(stages) == 1
                         else ScheduleInterleaved1F1B(stages, m, loss_fn=loss, scale_grads=False))

    def step(self, step: int) -> float:
        tokens, losses = self.data.tokens(step), []
        args = (tokens[:, :-1],) if self.first else ()
        kwargs = {"target": tokens[:, 1:], "losses": losses} if self.last else {}
        self.schedule.step(*args, **kwargs)
        for chunk in self.chunks:
            chunk.zero_grad(set_to_none=True)
        return sum(loss.item() for loss in losses) * self.data.microbatches * self.data.seq if self.last else 0.0


def timed(runner, step: int) -> float:
    comm.barrier()
    start = time.perf_counter()
    runner.step(step)
    return time.perf_counter() - start


def measured_bubble(trace: list) -> tuple[float, float, float]:
    """(idle share averaged over ranks, mean forward time, mean backward time) from all ranks' traces."""
    per_rank = comm.all_gather_object(trace, None)
    start = min(s for t in per_rank for _, s, _ in t)
    makespan = max(e for t in per_rank for _, _, e in t) - start
    busy = [sum(e - s for a, s, e in t if a.is_compute) for t in per_rank]
    forward = statistics.mean(e - s for t in per_rank for a, s, e in t if a.op == "F")
    backward = statistics.mean(e - s for t in per_rank for a, s, e in t if a.op == "B")
    return sum(1 - b / makespan for b in busy) / len(busy), forward, backward


def run_pp(rank: int, world: int, model: str, seq: int, rounds: int, k: int) -> list[dict]:
    configs = [bench_config(model, seq, world, s, m) for s in ("1f1b", "interleaved_1f1b") for m in (2 * world, 4 * world)]
    runners = [(Ours(cfg, world), Torch(cfg, world)) for cfg in configs]
    losses = [(comm_sum(ours.step(0)), comm_sum(theirs.step(0))) for ours, theirs in runners]  # warmup
    times = [[[], []] for _ in configs]
    for r in range(rounds):
        for i in range(len(configs)):
            j = (i + r) % len(configs)
            for side in (0, 1):
                times[j][side].append([max(comm.all_gather_object(timed(runners[j][side], 1 + s), None))
                                       for s in range(k)])
    results = []
    for cfg, (ours, _), (t_ours, t_torch), (l_ours, l_torch) in zip(configs, runners, times, losses):
        ours.trainer.runtime.trace = []
        ours.step(99)
        bubble, forward, backward = measured_bubble(ours.trainer.runtime.trace)
        ours.trainer.runtime.trace = None
        vpp = cfg.virtual_pipeline_stages
        sim = simulate(pipeline_actions(cfg.pipeline_schedule, world, vpp, cfg.num_microbatches), world, vpp,
                       uniform_costs(forward, backward)).bubble_fraction
        results.append({
            "pp": world, "schedule": cfg.pipeline_schedule, "m": cfg.num_microbatches,
            "ours_ms": 1e3 * statistics.median(t for rnd in t_ours for t in rnd),
            "torch_ms": 1e3 * statistics.median(t for rnd in t_torch for t in rnd),
            "ratio": statistics.median(statistics.median(a) / statistics.median(b) for a, b in zip(t_ours, t_torch)),
            "bubble": bubble, "simulated": sim, "loss_rel_diff": abs(l_ours - l_torch) / abs(l_torch),
        })
    return results


def comm_sum(value: float) -> float:
    """The last stage's loss, on every rank (a sum where the other stages hold zero)."""
    t = torch.tensor([value], dtype=torch.float64)
    comm.all_reduce(t, None)
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
    print("| pp | schedule | M | ours ms | torch ms | ours/torch | bubble measured | bubble simulated | loss rel diff |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for pp in (2, 4):
        for r in spawn(pp, run_pp, opts.model, opts.seq, opts.rounds, opts.steps_per_round):
            print(f"| {r['pp']} | {r['schedule']} | {r['m']} | {r['ours_ms']:.0f} | {r['torch_ms']:.0f} | "
                  f"{r['ratio']:.3f} | {r['bubble']:.1%} | {r['simulated']:.1%} | {r['loss_rel_diff']:.1e} |", flush=True)


if __name__ == "__main__":
    main()
