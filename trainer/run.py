"""Build everything from a validated config and run training: the body of train.py."""

import ctypes
import dataclasses
import json
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from parallel.errors import ConfigError
from parallel.launch_env import LaunchEnv
from parallel.mesh import ParallelDims, ParallelMesh, init_process_group, shutdown_process_groups
from parallel.pipeline.runtime import PipelineRuntime
from parallel.pipeline.schedule import schedule_actions
from parallel.random import RNGStreams
from parallel import comm
from trainer.async_save import AsyncCheckpointer
from trainer.checkpoint import ExtraFiles, prune_checkpoints, save_checkpoint
from trainer.config import CONFIG_FILE, LAYOUT_FILE, TrainConfig, flat_values
from trainer.data import BatchLoader, prepare_dataset
from trainer.determinism import enable_deterministic, seed_everything
from trainer.dump_dir import CHECKPOINTS_DIR, DumpDirLock, output_folders, own_dump_dir
from trainer.fingerprint import (
    FINGERPRINT_FILE, config_fingerprint, data_fingerprint, run_fingerprint, write_fingerprint,
)
from trainer.hf_import import import_hf, run_tokenizer
from trainer.flops import device_peak_flops, training_flops_per_token
from trainer.loop import Trainer
from trainer.memory import MemorySnapshots
from trainer.metrics import MetricsLog, record_history_owner
from trainer.nonfinite import weights_finite
from trainer.optimizer import NamedAdamW
from trainer.preemption import STOPPED_FILE, StopOnSignal, StopRequest, take_over_stop_marker
from trainer.parallelize import (
    DTYPE_NAMES, DTYPES, block_factory, build_chunks, cp_context, parallelize, tp_context,
)
from trainer.sampler import GlobalBatchSampler, HeldOutSampler, split_windows
from trainer.profiling import StepProfiler
from trainer.resume import refuse_a_changed_run_early, resume, resumed_checkpoint
from trainer.state import checkpoint_state
from trainer.validate import inert_keys, layout_noops
from trainer.tensorboard import TensorBoardLog
from trainer.token_shards import TOKENS_FILE
from trainer.tokenizer import Tokenizer


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def select_device(launch: LaunchEnv) -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(launch.local_rank)
        # NCCL blocks the compute stream, not the host: exposed comm is timed with stream events.
        comm.time_waits_on_stream(partial(torch.cuda.Event, enable_timing=True))
        return torch.device("cuda", launch.local_rank)
    return torch.device("cpu")


def compute_dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype:
    name = cfg.compute_dtype or ("bf16" if device.type == "cuda" else "fp32")
    return DTYPES[name]


def build_runtime(
    cfg: TrainConfig, mesh: ParallelMesh, chunks: list, roots: list, dtype: torch.dtype, device: torch.device
) -> PipelineRuntime:
    """This rank's program of the step; stages exchange [microbatch, seq / cp (/tp under SP), dim] tensors."""
    pp_rank = mesh.rank_in("pp")
    program = schedule_actions(
        cfg.pipeline_schedule, cfg.pipeline_parallel_size, cfg.virtual_pipeline_stages, cfg.num_microbatches, pp_rank
    )
    seq = cfg.seq_len // cfg.context_parallel_size // (cfg.model_parallel_size if cfg.model.sequence_parallel else 1)
    shape = (cfg.microbatch_size, seq, cfg.model.dim)
    return PipelineRuntime(program, cfg.pipeline_parallel_size, chunks, roots, mesh.group("pp"), shape, dtype, device)


def exit_with_launcher() -> None:
    """A worker must not train on after its torchrun agent is killed (kill -9 leaves it orphaned, still
    writing into the dump_dir): Linux sends it SIGKILL when its parent dies. Elsewhere a no-op."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # the agent died before prctl took effect
        os._exit(1)


def log0(rank: int, msg: str) -> None:
    if rank == 0:
        print(msg, file=sys.stderr, flush=True)


def run(cfg: TrainConfig, launch: LaunchEnv, dims: ParallelDims) -> None:
    """Train with a validated config (trainer.validate.validate gave `dims`)."""
    stop_request = StopRequest(cfg.stop_signal)  # first: a stop signal during start-up is kept
    for note in layout_noops(cfg, dims):
        log0(launch.rank, note)
    if launch.torchrun:
        exit_with_launcher()
    device = select_device(launch)
    if cfg.enable_deterministic_training:
        enable_deterministic(device.type)
    seed_everything(cfg.seed)
    init_process_group(launch, device, cfg.comm_timeout_s)
    try:
        _train(cfg, launch, dims, device, stop_request)
    except BaseException as e:
        raise _without_frames(e)
    finally:
        shutdown_process_groups()


def _without_frames(e: BaseException) -> BaseException:
    """The exception with its traceback kept as text (a note) instead of frames. The frames of a failed
    step hold the trainer and, through it, the process groups, which must be freed before they are
    destroyed: a gloo group still alive at interpreter exit can abort the process."""
    e.add_note("".join(traceback.format_exception(e)).rstrip())
    link: BaseException | None = e
    while link is not None:
        link.__traceback__ = None
        link = link.__cause__ or link.__context__
    return e


def _train(cfg: TrainConfig, launch: LaunchEnv, dims: ParallelDims, device: torch.device,
           stop_request: StopRequest) -> None:
    _same_config_on_every_rank(cfg)  # first: ranks of other parallel sizes would build other groups and stall
    mesh = ParallelMesh(dims, device.type, cfg.comm_timeout_s)
    # Rank 0's name for the job on every rank (a static launch's is its agent's, so per node).
    launch = dataclasses.replace(launch, run_id=comm.all_gather_object(launch.run_id, comm.world())[0])
    dump_dir = Path(cfg.dump_dir)
    lock = own_dump_dir(dump_dir, output_folders(cfg), launch.rank, launch.run_id, launch.restart_count,
                        comm.world())
    try:
        stopped = take_over_stop_marker(dump_dir, launch.run_id, launch.restart_count) if lock is not None else None
        stopped = comm.all_gather_object(stopped, comm.world())[0]
        if stopped is not None:
            log0(launch.rank, f"an earlier attempt of this job stopped after step {stopped} on its stop signal and "
                 f"torchrun restarted it when a worker failed: stopping again ({STOPPED_FILE} kept for the requeue)")
            return
        _train_in(cfg, launch, mesh, device, dump_dir, stop_request, lock)
    finally:
        if lock is not None:
            lock.release()


def _train_in(cfg: TrainConfig, launch: LaunchEnv, mesh: ParallelMesh, device: torch.device, dump_dir: Path,
              stop_request: StopRequest, lock: DumpDirLock | None) -> None:
    """`lock`: rank 0's hold on the dump_dir (None elsewhere)."""
    log = partial(log0, launch.rank)
    dtype_name = DTYPE_NAMES[compute_dtype(cfg, device)]
    refuse_a_changed_run_early(cfg, config_fingerprint(cfg, dtype_name, cfg.batch_size * mesh.dims.dp))
    tokenizer, loader, eval_loader = _build_data(cfg, mesh, launch.rank, log)
    trainer = build_trainer(cfg, mesh, loader, device, eval_loader)
    rng = RNGStreams(cfg.seed, trainer.chunks[0].tp.rank, device)
    state = partial(checkpoint_state, trainer.roots, trainer.optimizer, rng, loader.sampler,
                    rank=launch.rank, layout=mesh.dims)
    fingerprint = run_fingerprint(
        cfg, dtype_name, loader.sampler.global_batch_size,
        tokenizer.sha256,
        data_fingerprint(loader.tokens.path / TOKENS_FILE, loader.tokens.num_tokens, loader.tokens.meta["tokens_sha256"]),
    )
    start_step = resume(cfg, partial(state, step=0), rng, loader.sampler, fingerprint, launch.rank, launch.world_size,
                        launch.run_id, log)
    if cfg.checkpoint.init_from_hf and start_step == 0:
        import_hf(Path(cfg.checkpoint.init_from_hf), trainer.roots, cfg.model_args(), log)
    elif cfg.checkpoint.init_from_hf:
        log(f"checkpoint.init_from_hf={cfg.checkpoint.init_from_hf}: not read, the weights come from the "
            f"resumed step {start_step} checkpoint")
    if start_step == cfg.steps:
        log(f"nothing to do: the newest checkpoint is step {start_step} = steps; raise steps to train on")
        return
    comm.barrier(comm.world())  # every rank has read metrics.jsonl (resume) before rank 0 repairs it
    config_file = dump_dir / CONFIG_FILE
    if launch.rank == 0:
        config_file.write_text(json.dumps(dataclasses.asdict(cfg), indent=1))
        layout = dataclasses.asdict(mesh.dims) | {"inert_keys": inert_keys(cfg, mesh.dims)}
        (dump_dir / LAYOUT_FILE).write_text(json.dumps(layout, indent=1))
        write_fingerprint(dump_dir, fingerprint)
        record_history_owner(dump_dir, launch.run_id)
    extra_files = {"tokenizer.model": tokenizer.model_bytes, CONFIG_FILE: config_file,
                   FINGERPRINT_FILE: dump_dir / FINGERPRINT_FILE}
    _fit(cfg, trainer, start_step, state, extra_files, launch.rank, log, stop_request, launch.run_id, lock)


def build_trainer(
    cfg: TrainConfig, mesh: ParallelMesh, loader: BatchLoader, device: torch.device, eval_loader: BatchLoader | None = None
) -> Trainer:
    """This rank's model chunks (TP-shaped, FSDP-sharded, initialized), optimizer and pipeline program."""
    dtype = compute_dtype(cfg, device)
    chunks = build_chunks(cfg, tp_context(cfg, mesh), mesh.rank_in("pp"), cp_context(cfg, mesh), block_factory(cfg, mesh))
    roots = [parallelize(chunk, cfg, mesh, dtype, device) for chunk in chunks]
    return Trainer(
        cfg, mesh, chunks, roots, build_runtime(cfg, mesh, chunks, roots, dtype, device), NamedAdamW(chunks, cfg.optim),
        loader, device,
        flops_per_token=training_flops_per_token(cfg.model_args(), cfg.seq_len),
        peak_flops=device_peak_flops(device),
        eval_loader=eval_loader,
    )


def _build_data(
    cfg: TrainConfig, mesh: ParallelMesh, rank: int, log: Callable[[str], None]
) -> tuple[Tokenizer, BatchLoader, BatchLoader | None]:
    """The tokenizer, the training batches and (with eval.freq) the held-out evaluation batches."""
    tokenizer_path = run_tokenizer(cfg.data.tokenizer, cfg.checkpoint.init_from_hf, resumed_checkpoint(cfg))
    if tokenizer_path != cfg.data.tokenizer:
        log(f"data: tokenizer {tokenizer_path} (that of checkpoint.init_from_hf; data.tokenizer is null)")
    tokenizer, tokens = prepare_dataset(
        cfg.data.source, tokenizer_path, cfg.model.vocab_size, Path(cfg.data.cache_dir).expanduser(),
        is_main_rank=rank == 0, log=log, timeout_s=cfg.data.prepare_timeout_s, agree=_same_data_on_every_rank,
    )
    dp, global_batch = mesh.dims.dp, cfg.batch_size * mesh.dims.dp
    tokens.num_sequences(cfg.seq_len)  # refuses data shorter than one sequence in a line naming seq_len
    train_windows, held_out = split_windows(tokens.num_tokens, cfg.seq_len, cfg.data.held_out_fraction)
    sampler = GlobalBatchSampler(train_windows, global_batch, cfg.seed, cfg.data.held_out_fraction)
    log(sampler.epochs_line(cfg.steps))
    loader = BatchLoader(tokens, sampler, cfg.seq_len, mesh.dp_rank, dp, cfg.microbatch_size, tokenizer.bos_id)
    if not cfg.eval.freq:
        return tokenizer, loader, None
    eval_sampler = HeldOutSampler(held_out, global_batch)
    if eval_sampler.num_batches < cfg.eval.steps:
        raise ConfigError(
            f"eval.steps={cfg.eval.steps} global batches of {global_batch} sequences need "
            f"{cfg.eval.steps * global_batch} held-out sequences, but data.held_out_fraction="
            f"{cfg.data.held_out_fraction} holds {len(held_out)}; lower eval.steps or raise the fraction"
        )
    return tokenizer, loader, BatchLoader(tokens, eval_sampler, cfg.seq_len, mesh.dp_rank, dp, cfg.microbatch_size,
                                          tokenizer.bos_id)


def _same_config_on_every_rank(cfg: TrainConfig) -> None:
    """Every rank resolved the same config: a node launched with other overrides, or a value resolved
    per process (`dump_dir=run_${now:%H%M%S}`), would train other models or write into other folders."""
    configs = comm.all_gather_object(flat_values(cfg), comm.world())
    for rank, other in enumerate(configs):
        differing = [key for key, value in configs[0].items() if other.get(key) != value]
        if differing:
            key = differing[0]
            raise ConfigError(
                f"{key}: rank {rank} resolved {other.get(key)!r}, rank 0 {configs[0][key]!r}; every rank must "
                f"run the same overrides, and a value that resolves per process (such as ${{now:...}}) cannot be used")


def _same_data_on_every_rank(cache_key: str) -> None:
    """The data cache key (source paths, sizes and mtimes, vocabulary, tokenizer) is every rank's."""
    keys = comm.all_gather_object(cache_key, comm.world())
    differing = [rank for rank, key in enumerate(keys) if key != keys[0]]
    if differing:
        raise ConfigError(
            f"data.source: rank {differing[0]} sees other source files or tokenizer than rank 0 (path, size or "
            f"modification time differ); every node needs the same files, with data.cache_dir shared")


def _fit(
    cfg: TrainConfig, trainer: Trainer, start_step: int, state: Callable[..., dict], extra_files: ExtraFiles,
    rank: int, log: Callable[[str], None], stop_request: StopRequest, job: str, lock: DumpDirLock | None,
) -> None:
    metrics = MetricsLog(Path(cfg.dump_dir), is_writer=rank == 0, total_steps=cfg.steps, start_step=start_step)
    tensorboard = TensorBoardLog(Path(cfg.dump_dir), start_step) if cfg.metrics.tensorboard and rank == 0 else None
    ckpt_root = Path(cfg.dump_dir) / CHECKPOINTS_DIR
    profiler = StepProfiler(cfg, rank, trainer.device)
    memory = MemorySnapshots(cfg.mem_snapshot_stop_step, start_step, Path(cfg.dump_dir), rank, trainer.device,
                             trainer.roots, trainer.optimizer)
    stop = StopOnSignal(stop_request, comm.world(), trainer.device, Path(cfg.dump_dir), job)
    background = AsyncCheckpointer(ckpt_root, comm.world(), trainer.mesh.checkpoint_group, rank,
                                   cfg.checkpoint.keep, extra_files, log, trainer.device) \
        if cfg.checkpoint.async_save else None
    try:
        for step in range(start_step + 1, cfg.steps + 1):
            with profiler.step(step), memory.recording(step):
                m = trainer.train_step(step)
            if profiler.due(step):
                m.profiled = True
            memory.after_step(step)
            if lock is not None:
                lock.check_owned()  # before this step's outputs are written
            evaluate = cfg.eval.freq > 0 and (step % cfg.eval.freq == 0 or step == cfg.steps)
            if evaluate:
                m.eval_loss = trainer.evaluate()
            if evaluate or cfg.log_all_steps or step % cfg.log_freq == 0 or step in (1, cfg.steps):
                metrics.log(m)
                if tensorboard is not None:
                    tensorboard.log(m)
            stopping = stop.agreed() and step < cfg.steps
            if background is not None:
                background.poll()
            # With checkpoints on, the last step is saved too: steps past the last multiple of freq are not lost.
            if (cfg.checkpoint.freq and (step % cfg.checkpoint.freq == 0 or step == cfg.steps)) or stopping:
                _checkpoint(cfg, trainer, step, state, extra_files, rank, log, background, in_background=not stopping)
            if stopping:
                if rank == 0:
                    stop.record(step)
                log(f"stopping after step {step} on SIG{cfg.stop_signal}: run the same command again to resume")
                break
    except FloatingPointError:
        # A non-finite halt is agreed by every rank, so they can still complete the save in flight
        # together: it holds the last good state, which the next job's folder clean-up would delete.
        if background is not None:
            background.wait()
        raise
    if background is not None:
        background.wait()
    if tensorboard is not None:
        tensorboard.close()


def _checkpoint(
    cfg: TrainConfig, trainer: Trainer, step: int, state: Callable[..., dict], extra_files: ExtraFiles, rank: int,
    log: Callable[[str], None], background: AsyncCheckpointer | None, in_background: bool,
) -> None:
    """Save after `step`: in the background (checkpoint.async_save), or now (before stopping on a signal).
    Either way the save in flight, if any, completes first (its own line reports what that cost); the
    stall reported here starts with the weight check, in both modes."""
    comm.set_phase("checkpoint save")
    if background is not None:
        background.wait()
    start = time.perf_counter()
    if not weights_finite(trainer.roots, comm.world()):
        raise FloatingPointError(f"step {step}: the weights are not finite; no checkpoint written")
    root = Path(cfg.dump_dir) / CHECKPOINTS_DIR
    if background is not None and in_background:
        background.save(step, state(step=step))
        log(f"saving checkpoint of step {step} in the background (the step loop stalled "
            f"{time.perf_counter() - start:.3f} s)")
        return
    path = save_checkpoint(root, step, state(step=step), comm.world(), rank, extra_files)
    if rank == 0:
        prune_checkpoints(root, cfg.checkpoint.keep)
    log(f"saved checkpoint {path} (the step loop stalled {time.perf_counter() - start:.3f} s)")
