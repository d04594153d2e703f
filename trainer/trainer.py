"""The Trainer: one object that owns a training job's lifecycle on this rank.

    trainer = Trainer(cfg, launch, mesh, device, stop_request, lock)  # build: data, model, RNG, fingerprint
    start = trainer.resume()   # the newest checkpoint of the dump_dir, or a Hugging Face import, or step 0
    trainer.train(start)       # the step loop: steps, evaluations, logs, checkpoint saves, stop signals
    trainer.close()            # a save still in flight completes; outputs are closed

The step itself (pipeline, gradient sync, optimizer) is step.StepRunner's; run.py starts the process and
owns the dump_dir before a Trainer is built.
"""

import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

from parallel import comm
from parallel.fsdp import tied_copies_equal
from parallel.launch_env import LaunchEnv
from parallel.mesh import ParallelMesh
from parallel.pipeline.summary import schedule_summary
from parallel.random import RNGStreams
from parallel.regional_compile import STATS as COMPILE_STATS
from trainer.checkpoint.async_save import AsyncCheckpointer
from trainer.checkpoint.files import ExtraFiles, prune_checkpoints, save_checkpoint
from trainer.checkpoint.fingerprint import config_fingerprint, run_fingerprint, write_fingerprint
from trainer.checkpoint.hf_import import import_hf
from trainer.checkpoint.hf_origin import ORIGIN_FILE, origin_config_bytes
from trainer.checkpoint.resume import refuse_a_changed_run_early, resume, resumed_checkpoint
from trainer.checkpoint.state import checkpoint_state
from trainer.config.rules import fusion_note, inert_keys
from trainer.config.schema import TrainConfig
from trainer.config.vocab import with_tokenizer_vocabulary
from trainer.data.build import build_data
from trainer.observability.memory import MemorySnapshots
from trainer.observability.metrics import MetricsLog, StepMetrics, record_history_owner
from trainer.observability.profiling import StepProfiler
from trainer.observability.tensorboard import TensorBoardLog
from trainer.observability.wandb_run import WandbLog
from trainer.outputs import CHECKPOINTS_DIR, CONFIG_FILE, FINGERPRINT_FILE, LAYOUT_FILE
from trainer.parallelize import DTYPE_NAMES, compute_dtype
from trainer.resilience.dump_dir_lock import DumpDirLock
from trainer.resilience.nonfinite import weights_finite
from trainer.resilience.preemption import StopOnSignal, StopRequest
from trainer.step import StepRunner


def log0(rank: int, msg: str) -> None:
    if rank == 0:
        print(msg, file=sys.stderr, flush=True)


class Trainer:
    def __init__(self, cfg: TrainConfig, launch: LaunchEnv, mesh: ParallelMesh, device: torch.device,
                 stop_request: StopRequest, lock: DumpDirLock | None) -> None:
        """Build this rank's part of the job. `lock`: rank 0's hold on the dump_dir (None elsewhere)."""
        self.cfg, self.launch, self.mesh, self.device = cfg, launch, mesh, device
        self.stop_request, self.lock = stop_request, lock
        self.rank, self.dump_dir = launch.rank, Path(cfg.dump_dir)
        self.checkpoints = self.dump_dir / CHECKPOINTS_DIR
        dtype_name = DTYPE_NAMES[compute_dtype(cfg, device)]
        # Before the data is prepared (hours for a new corpus): a resume that would be refused says so now.
        refuse_a_changed_run_early(cfg, config_fingerprint(cfg, dtype_name, cfg.batch_size * mesh.dims.dp))
        resumed = resumed_checkpoint(cfg)
        self.data = build_data(cfg, mesh.dp_rank, mesh.dims.dp, self.rank, self.log, resumed)
        self.hf_origin = origin_config_bytes(cfg.checkpoint.init_from_hf, resumed)
        # The model's vocabulary is the tokenizer's (padded); from here on, every part of the run sees it.
        self.cfg = cfg = with_tokenizer_vocabulary(cfg, self.data.tokenizer.vocab_size, str(self.data.tokenizer.path))
        self.runner = StepRunner.build(cfg, mesh, self.data.loader, device, self.data.eval_loader)
        if self.rank == 0 and (note := fusion_note(cfg, dtype_name)):
            self.log(note)
        if self.rank == 0 and cfg.pipeline_parallel_size > 1:  # simulating the step takes a moment: once
            self.log(schedule_summary(cfg.pipeline_schedule, cfg.pipeline_parallel_size, cfg.virtual_pipeline_stages,
                                      cfg.num_microbatches))
        self.rng = RNGStreams(cfg.seed, self.runner.chunks[0].tp.rank, device)
        self.fingerprint = run_fingerprint(cfg, dtype_name, self.data.loader.sampler.global_batch_size,
                                           self.data.tokenizer.sha256, self.data.fingerprint)
        self.background = AsyncCheckpointer(self.checkpoints, comm.world(), mesh.checkpoint_group, self.rank,
                                            cfg.checkpoint.keep, self.extra_files(), self.log, device) \
            if cfg.checkpoint.async_save else None
        self.tensorboard: TensorBoardLog | None = None
        self.wandb: WandbLog | None = None

    def log(self, msg: str) -> None:
        log0(self.rank, msg)

    def state_dict(self, step: int) -> dict:
        """What a checkpoint after `step` holds: views of the live tensors (a load writes into them)."""
        return checkpoint_state(self.runner.roots, self.runner.optimizer, self.rng, self.data.loader.sampler,
                                step=step, rank=self.rank, layout=self.mesh.dims)

    def extra_files(self) -> ExtraFiles:
        """The files every checkpoint carries besides the state: the tokenizer in use, the config, the
        fingerprint (those two are written into the dump_dir as the job starts) and, for a run started from
        a Hugging Face folder, that folder's config.json."""
        origin = {} if self.hf_origin is None else {ORIGIN_FILE: self.hf_origin}
        return {**self.data.tokenizer.files, CONFIG_FILE: self.dump_dir / CONFIG_FILE,
                FINGERPRINT_FILE: self.dump_dir / FINGERPRINT_FILE, **origin}

    def resume(self) -> int:
        """Load the newest complete checkpoint of the dump_dir (or, starting afresh, the Hugging Face
        folder's weights); returns the step to continue after."""
        cfg, launch = self.cfg, self.launch
        start_step = resume(cfg, lambda: self.state_dict(step=0), self.rng, self.data.loader.sampler,
                            self.fingerprint, self.rank, launch.world_size, launch.run_id, self.log)
        if cfg.checkpoint.init_from_hf and start_step == 0:
            import_hf(Path(cfg.checkpoint.init_from_hf), self.runner.roots, cfg.model, self.log)
        elif cfg.checkpoint.init_from_hf:
            self.log(f"checkpoint.init_from_hf={cfg.checkpoint.init_from_hf}: not read, the weights come from the "
                     f"resumed step {start_step} checkpoint")
        return start_step

    def train(self, start_step: int) -> None:
        """Train steps start_step + 1 .. cfg.steps (or until a stop signal)."""
        cfg = self.cfg
        if start_step == cfg.steps:
            self.log(f"nothing to do: the newest checkpoint is step {start_step} = steps; raise steps to train on")
            return
        comm.barrier(comm.world())  # every rank has read metrics.jsonl (resume) before rank 0 repairs it
        if self.rank == 0:
            self._write_run_files()
        metrics = MetricsLog(self.dump_dir, is_writer=self.rank == 0, total_steps=cfg.steps, start_step=start_step)
        if cfg.metrics.tensorboard and self.rank == 0:
            self.tensorboard = TensorBoardLog(self.dump_dir, start_step)
        if cfg.metrics.wandb and self.rank == 0:
            self.wandb = WandbLog(cfg, self.dump_dir, start_step)
        profiler = StepProfiler(cfg, self.rank, self.device)
        memory = MemorySnapshots(cfg.mem_snapshot_stop_step, start_step, self.dump_dir, self.rank, self.device,
                                 self.runner.roots, self.runner.optimizer)
        stop = StopOnSignal(self.stop_request, comm.world(), self.device, self.dump_dir, self.launch.run_id,
                            self.launch.launch_name)
        try:
            for step in range(start_step + 1, cfg.steps + 1):
                with profiler.step(step), memory.recording(step):
                    m = self.train_step(step)
                if cfg.compile and step == start_step + 1:  # the blocks compiled during this process's first step
                    self.log(COMPILE_STATS.summary())
                if profiler.due(step):
                    m.profiled = True
                memory.after_step(step)
                if self.lock is not None:
                    self.lock.check_owned()  # before this step's outputs are written
                if self._after_step(step, m, metrics, stop):
                    break
        except FloatingPointError:
            # A non-finite halt is agreed by every rank, so they can still complete the save in flight
            # together: it holds the last good state, which the next job's folder clean-up would delete.
            if self.background is not None:
                self.background.wait()
            raise

    def train_step(self, step: int) -> StepMetrics:
        return self.runner.train_step(step)

    def evaluate(self) -> float:
        return self.runner.evaluate()

    def _after_step(self, step: int, m: StepMetrics, metrics: MetricsLog, stop: StopOnSignal) -> bool:
        """Evaluate, log, save and agree on a stop after `step`; returns whether the job stops here."""
        cfg = self.cfg
        evaluate = cfg.eval.freq > 0 and (step % cfg.eval.freq == 0 or step == cfg.steps)
        if evaluate:
            m.eval_loss = self.evaluate()
        if evaluate or cfg.log_all_steps or step % cfg.log_freq == 0 or step in (1, cfg.steps):
            metrics.log(m)
            if self.tensorboard is not None:
                self.tensorboard.log(m)
            if self.wandb is not None:
                self.wandb.log(m)
        stopping = stop.agreed() and step < cfg.steps
        if self.background is not None:
            self.background.poll()
        if stopping and self.rank == 0:
            # Before the save: a restart after a worker died in it must stop too (Slurm warns only once);
            # the requeued job resumes from the newest complete checkpoint, whichever that is.
            stop.record(step)
        # With checkpoints on, the last step is saved too: steps past the last multiple of freq are not lost.
        if (cfg.checkpoint.freq and (step % cfg.checkpoint.freq == 0 or step == cfg.steps)) or stopping:
            self.save_checkpoint(step, in_background=not stopping)
        if stopping:
            self.log(f"stopping after step {step} on SIG{cfg.stop_signal}: run the same command again to resume")
        return stopping

    def save_checkpoint(self, step: int, in_background: bool = True) -> None:
        """Save after `step`: in the background (checkpoint.async_save), or now (before stopping on a signal).
        Either way the save in flight, if any, completes first (its own line reports what that cost); the
        stall reported here starts with the weight check, in both modes."""
        comm.set_phase("checkpoint save")
        if self.background is not None:
            self.background.wait()
        start = time.perf_counter()
        if not weights_finite(self.runner.roots, comm.world()):
            raise FloatingPointError(f"step {step}: the weights are not finite; no checkpoint written")
        self._check_tied_copies(step)
        if self.background is not None and in_background:
            self.background.save(step, self.state_dict(step))
            self.log(f"saving checkpoint of step {step} in the background (the step loop stalled "
                     f"{time.perf_counter() - start:.3f} s)")
            return
        path = save_checkpoint(self.checkpoints, step, self.state_dict(step), comm.world(), self.rank,
                               self.extra_files())
        if self.rank == 0:
            prune_checkpoints(self.checkpoints, self.cfg.checkpoint.keep)
        self.log(f"saved checkpoint {path} (the step loop stalled {time.perf_counter() - start:.3f} s)")

    def _check_tied_copies(self, step: int) -> None:
        """The tied embedding's copies on the first and last pipeline stages are bitwise equal: a checkpoint
        stores one of them, as the weight of both."""
        if not (self.cfg.model.tie_embeddings and self.mesh.dims.pp > 1):
            return
        if not tied_copies_equal(self.runner.roots, self.runner.tied_group, comm.world()):
            raise RuntimeError(f"step {step}: the copies of the tied embedding (model.tie_embeddings) on the first "
                               f"and last pipeline stages differ; no checkpoint written")

    def _write_run_files(self) -> None:
        """Rank 0, as training starts: the resolved config, the layout, the fingerprint and the job that
        writes the metrics."""
        (self.dump_dir / CONFIG_FILE).write_text(json.dumps(dataclasses.asdict(self.cfg), indent=1))
        layout = dataclasses.asdict(self.mesh.dims) | {"inert_keys": inert_keys(self.cfg, self.mesh.dims)}
        (self.dump_dir / LAYOUT_FILE).write_text(json.dumps(layout, indent=1))
        write_fingerprint(self.dump_dir, self.fingerprint)
        record_history_owner(self.dump_dir, self.launch.run_id)

    def close(self) -> None:
        """The save in flight completes (every rank together); the event files and the W&B run are closed."""
        if self.background is not None:
            self.background.wait()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.close()
