"""`dry_run=true`: the plan of a run, from one process, without building more than the meta-device model.

    python train.py dry_run=true world_size=N [overrides]    plans for N ranks (torchrun: its world)

Prints the parameter counts, every pipeline stage's predicted peak memory by category (every rank of a
stage holds the same shapes; the worst stage first), the model FLOPs per token and per step and the
pipeline program's simulated bubble, writes the same as {dump_dir}/plan.json (rank 0), and exits 0.
"""

import json
import sys
from pathlib import Path

from parallel.errors import ConfigError
from parallel.launch_env import LaunchEnv
from parallel.mesh import ParallelDims
from planner.rank_plan import compute_dtype, pipeline_timeline, schedule_name, stage_plan
from planner.units import parameter_counts
from trainer.config.schema import TrainConfig
from trainer.config.vocab import planned_vocabulary
from trainer.observability.flops import training_flops_per_token
from trainer.outputs import PLAN_FILE

GIB = 2**30


def planned_world(cfg: TrainConfig, launch: LaunchEnv) -> int:
    """The world the config is checked (and a dry run plans) for: torchrun's, or world_size in a dry run."""
    if cfg.world_size is None:
        return launch.world_size
    if not cfg.dry_run:
        raise ConfigError(f"world_size={cfg.world_size} is read by dry_run=true only (a run's world is torchrun's): "
                          "add dry_run=true, or drop world_size")
    if launch.torchrun and cfg.world_size != launch.world_size:
        raise ConfigError(f"world_size={cfg.world_size} differs from torchrun's world of {launch.world_size}: a dry "
                          "run under torchrun plans for its world (drop world_size, or run one plain process)")
    return cfg.world_size


def plan(cfg: TrainConfig, dims: ParallelDims) -> dict:
    """Everything the dry run reports, as plan.json holds it."""
    cfg = planned_vocabulary(cfg)
    stages = [stage_plan(cfg, dims, r) for r in range(dims.pp)]
    worst = max(stages, key=lambda s: s.memory["peak_bytes"])
    timeline = pipeline_timeline(cfg)
    per_token = training_flops_per_token(cfg.model, cfg.seq_len)
    tokens = cfg.batch_size * dims.dp * cfg.seq_len
    layout = {**{k: getattr(dims, k) for k in ("tp", "pp", "cp", "dp_shard", "dp_replicate")},
              "vpp": cfg.virtual_pipeline_stages, "microbatch_size": cfg.microbatch_size,
              "microbatches": cfg.num_microbatches, "schedule": schedule_name(cfg),
              "layer_ckpt": cfg.model.layer_ckpt, "reshard_after_forward": cfg.reshard_after_forward,
              "grad_reduce": cfg.grad_reduce, "compute_dtype": str(compute_dtype(cfg)).removeprefix("torch.")}
    # Every rank of a stage holds the same shapes: a stage's peak is each of its ranks' (pp is outermost).
    per_rank = [s.memory["peak_bytes"] for s in stages for _ in range(s.ranks[0], s.ranks[1] + 1)]
    return {
        "world_size": dims.world_size,
        "layout": layout,
        "parameters": {**parameter_counts(cfg.model),
                       "per_stage": [{"pp_rank": s.pp_rank, "ranks": list(s.ranks), "parameters": s.parameters}
                                     for s in stages]},
        "memory": {"peak_bytes": worst.memory["peak_bytes"], "worst_pp_rank": worst.pp_rank,
                   "peak_bytes_per_rank": per_rank,
                   "per_stage": [{"pp_rank": s.pp_rank, "ranks": list(s.ranks), "peak_bytes": s.memory["peak_bytes"],
                                  "snapshot": s.snapshot,
                                  "categories": {k: v for k, v in s.memory.items() if k != "peak_bytes"}}
                                 for s in stages]},
        "flops": {"per_token": per_token, "per_step": per_token * tokens, "tokens_per_step": tokens},
        "pipeline": {"bubble_fraction": timeline.bubble_fraction,
                     "most_microbatches_held": timeline.peak_microbatches},
    }


def _size(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB / 10 else f"{nbytes / 2**20:.2f} MiB"


def summary(report: dict) -> list[str]:
    params, memory, layout = report["parameters"], report["memory"], report["layout"]
    worst = memory["per_stage"][memory["worst_pp_rank"]]
    shown = ", ".join(f"{k}={v}" for k, v in layout.items())
    lines = [f"dry run: {report['world_size']} ranks: {shown}",
             f"parameters: {params['total']:,} total, {params['embedding']:,} embedding, "
             f"{max(r['parameters'] for r in params['per_stage']):,} on the largest rank (TP-local)",
             f"peak memory: {_size(memory['peak_bytes'])} on pipeline stage {worst['pp_rank']} (ranks "
             f"{worst['ranks'][0]}..{worst['ranks'][1]}), by category:"]
    lines += [f"  {k:<22} {_size(v):>12}" for k, v in worst["categories"].items()]
    others = [f"stage {r['pp_rank']} {_size(r['peak_bytes'])}" for r in memory["per_stage"]]
    if len(others) > 1:
        lines.append("peak per pipeline stage: " + ", ".join(others))
    flops = report["flops"]
    lines += [f"model FLOPs: {flops['per_token']:.4g} per token, {flops['per_step']:.4g} per step "
              f"({flops['tokens_per_step']} tokens)",
              f"pipeline bubble (simulated, backward = 2 forwards): {report['pipeline']['bubble_fraction']:.1%}"]
    return lines


def dry_run(cfg: TrainConfig, launch: LaunchEnv, dims: ParallelDims) -> None:
    report = plan(cfg, dims)
    if launch.rank != 0:
        return
    print("\n".join(summary(report)), flush=True)
    folder = Path(cfg.dump_dir)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / PLAN_FILE).write_text(json.dumps(report, indent=1))
    print(f"plan written to {folder / PLAN_FILE}", file=sys.stderr, flush=True)


