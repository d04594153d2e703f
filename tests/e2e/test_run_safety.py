"""Run safety end to end: a dump_dir belongs to one job, a resume refuses whatever would silently change
the run, and nothing already written is cut. Each test reproduces a finding of a user trial."""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import typing
from pathlib import Path

import pytest

from tests.e2e.launch import ENV, REPO, assert_one_error, command, losses, metrics, start, train, train_ok
from trainer.data.tokenizer_spm import train_tokenizer

FAST = ("model=tiny", "seq_len=64", "batch_size=2", "log_all_steps=true", "optim.warmup_steps=1")


def _wait_for_records(dump: Path, proc: subprocess.Popen, count: int, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        path = dump / "metrics.jsonl"
        if path.exists() and len(path.read_text().splitlines()) >= count:
            return
        assert proc.poll() is None, (dump.parent / f"{dump.name}.err").read_text()[-3000:]
        time.sleep(0.2)
    raise AssertionError(f"no {count} records in {dump} after {timeout} s")


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_second_job_on_a_busy_dump_dir_is_refused_and_the_first_finishes_untouched(tmp_path):
    """The first job trains until told to stop (stop_signal), so the check does not race its end however
    slowly the second job starts."""
    dump = tmp_path / "run"
    first = start(2, dump, *FAST, "steps=100000", "stop_signal=USR1")
    try:
        _wait_for_records(dump, first, 1)
        (dump / "stopped.json").write_text("left by an earlier job")  # the first removed its own already
        second = train(0, dump, *FAST, "steps=100000", "stop_signal=USR1", timeout=120)
        assert_one_error(second, f"dump_dir={dump} is in use by job")
        assert first.poll() is None  # refused while the first trains, not after it ended
        assert (dump / "stopped.json").read_text() == "left by an earlier job"  # the refused job touched nothing
        os.kill(max(_children(first.pid)), signal.SIGUSR1)
        assert first.wait(timeout=120) == 0
    finally:
        if first.poll() is None:  # never left training for the rest of the session
            first.kill()
            first.wait()
    stopped = json.loads((dump / "stopped.json").read_text())["step"]
    assert [r["step"] for r in metrics(dump)] == list(range(1, stopped + 1))
    assert (dump / "checkpoints" / f"step_{stopped}" / "manifest.json").is_file()
    assert not (dump / ".lock").exists()


def test_workers_die_with_their_torchrun_agent_and_free_the_dump_dir(tmp_path):
    dump = tmp_path / "run"
    agent = start(2, dump, *FAST, "steps=100000")
    _wait_for_records(dump, agent, 1)
    workers = _children(agent.pid)
    assert len(workers) == 2
    agent.send_signal(signal.SIGKILL)
    agent.wait()
    deadline = time.time() + 10
    while any(_alive(w) for w in workers) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(_alive(w) for w in workers), "orphaned workers kept training"
    size = (dump / "metrics.jsonl").stat().st_size
    time.sleep(1)
    assert (dump / "metrics.jsonl").stat().st_size == size
    # The lock's holder is dead: a new job in a new folder is not needed, but this one has no checkpoint
    # and earlier metrics, so it is refused for that, not for the lock.
    assert_one_error(train(0, dump, *FAST, "steps=3", timeout=60), "no checkpoint to resume from")


def test_hydra_multirun_gives_each_job_its_own_dump_dir(tmp_path):
    sweep = tmp_path / "sweep"
    proc = subprocess.run(
        [sys.executable, str(REPO / "train.py"), "-m", f"dump_dir={sweep}", f"data.cache_dir={REPO / '.cache' / 'data'}",
         *FAST, "steps=3", "optim.lr=1e-3,1e-2"],
        cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for job, lr in ((0, "1e-3"), (1, "1e-2")):
        alone = losses(train_ok(0, tmp_path / f"alone{job}", *FAST, "steps=3", f"optim.lr={lr}"))
        assert losses(metrics(sweep / str(job))) == alone
    assert sorted(p.name for p in tmp_path.iterdir()) == ["alone0", "alone1", "sweep"]  # nothing else written
    under_torchrun = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", str(REPO / "train.py"),
         "-m", f"dump_dir={tmp_path / 'tr'}", *FAST, "optim.lr=1e-3,1e-2"],
        cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=120,
    )
    assert_one_error(under_torchrun, "multirun", "torchrun", "hydra/launcher=torchrun")


def test_torchrun_launcher_runs_each_sweep_point_on_its_own_ranks(tmp_path):
    """hydra/launcher=torchrun: every point is a 2-rank torchrun job in its own dump_dir (a relative one
    is the directory hydra started in, as without the launcher, and may need quoting); a point that
    fails (seed=-1 is refused) fails the sweep without stopping the others. Relative paths in the
    overrides mean what they mean where hydra runs."""
    sweep = tmp_path / "my sweep, 1"
    (tmp_path / "cache").symlink_to(REPO / ".cache" / "data")
    proc = subprocess.run(
        [sys.executable, str(REPO / "train.py"), "-m", "hydra/launcher=torchrun", "hydra.launcher.nproc_per_node=2",
         "dump_dir='my sweep, 1'", "data.cache_dir=cache", *FAST, "steps=3", "seed=-1,3"],
        cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300,
    )
    assert not (REPO / "cache").exists()
    assert proc.returncode != 0 and "error: seed=-1 must be >= 0" in proc.stderr, proc.stderr[-3000:]
    assert not (sweep / "0" / "metrics.jsonl").exists()
    alone = losses(train_ok(2, tmp_path / "alone", *FAST, "steps=3", "seed=3"))
    assert losses(metrics(sweep / "1")) == alone
    assert json.loads((sweep / "1" / "train_config.json").read_text())["dump_dir"] == str(sweep / "1")


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory) -> Path:
    """4 steps of an 8-step schedule, checkpoints at 2 and 4."""
    dump = tmp_path_factory.mktemp("ckpt") / "dump"
    train_ok(0, dump, *FAST, "steps=4", "optim.decay_steps=8", "checkpoint.freq=2")
    return dump


def _copy(checkpointed: Path, tmp_path: Path) -> Path:
    dump = tmp_path / "dump"
    shutil.copytree(checkpointed, dump)
    return dump


def test_a_damaged_newer_checkpoint_is_refused_not_overwritten(tmp_path, checkpointed):
    """step_4 without its manifest (damaged, or copied in by hand) is not resumed from; the run would
    write step 4 over it, so it stops in one line and leaves the folder as it was."""
    dump = _copy(checkpointed, tmp_path)
    damaged = dump / "checkpoints" / "step_4"
    (damaged / "manifest.json").unlink()
    (damaged / "NOTES.txt").write_text("mine")
    files, before = sorted(p.name for p in damaged.iterdir()), (dump / "metrics.jsonl").read_text()
    proc = train(0, dump, *FAST, "steps=8", "optim.decay_steps=8", timeout=120)
    assert_one_error(proc, f"checkpoint {damaged} has no manifest.json", "resuming from step 2", "move it out of")
    assert sorted(p.name for p in damaged.iterdir()) == files and (dump / "metrics.jsonl").read_text() == before


def _other_tokenizer(tmp_path: Path) -> Path:
    """A tokenizer with the same vocabulary size, trained on other text (a few stdlib modules)."""
    return train_tokenizer([Path(argparse.__file__), Path(typing.__file__)], 512, tmp_path / "other.model")


@pytest.mark.parametrize("overrides, fragments", [
    # Same parameter shapes: the weights would load, read in another head layout.
    (("model.n_heads=8", "model.n_kv_heads=4"), ("model.n_heads 4 -> 8", "model.n_kv_heads 2 -> 4")),
    (("optim.lr=1e-2",), ("optim.lr 0.003 -> 0.01", "resume.allow_changed=[optim.lr]")),
    (("compute_dtype=bf16",), ("compute_dtype 'fp32' -> 'bf16'",)),
])
def test_resume_refuses_a_changed_run_naming_the_keys(tmp_path, checkpointed, overrides, fragments):
    """Before any data preparation: here an empty cache, which would first train a tokenizer."""
    dump = _copy(checkpointed, tmp_path)
    before = (dump / "metrics.jsonl").read_text()
    proc = train(0, dump, *FAST, "steps=8", "optim.decay_steps=8", *overrides, f"data.cache_dir={tmp_path / 'cache'}",
                 timeout=120)
    assert_one_error(proc, "would change the run", *fragments)
    assert (dump / "metrics.jsonl").read_text() == before
    assert "data: preparing" not in proc.stderr and not (tmp_path / "cache").exists()


def test_resume_refuses_another_tokenizer_of_the_same_size(tmp_path, checkpointed):
    dump = _copy(checkpointed, tmp_path)
    proc = train(0, dump, *FAST, "steps=8", "optim.decay_steps=8", f"data.tokenizer={_other_tokenizer(tmp_path)}",
                 timeout=120)
    assert_one_error(proc, "would change the run", "tokenizer", "data.tokenizer")


def test_allowed_change_resumes(tmp_path, checkpointed):
    dump = _copy(checkpointed, tmp_path)
    proc = train(0, dump, *FAST, "steps=6", "optim.decay_steps=8", "optim.lr=1e-2", "resume.allow_changed=[optim.lr]")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ("resume.allow_changed permits, or changing no step taken): optim.lr 0.003 -> 0.01"
            in proc.stdout + proc.stderr)
    assert [r["step"] for r in metrics(dump)] == [1, 2, 3, 4, 5, 6]


def test_a_job_with_nothing_left_to_train_clears_an_earlier_stop(tmp_path, checkpointed):
    """A stopped.json left by an earlier job would make the batch script requeue this one, which ends at
    once, again and again."""
    dump = _copy(checkpointed, tmp_path)
    (dump / "stopped.json").write_text('{"step": 4, "signal": "SIGUSR1"}')
    before = (dump / "metrics.jsonl").read_bytes()
    proc = train(0, dump, *FAST, "steps=4", "optim.decay_steps=8", "checkpoint.freq=2", timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "nothing to do: the newest checkpoint is step 4 = steps" in proc.stdout + proc.stderr
    assert not (dump / "stopped.json").exists()
    assert (dump / "metrics.jsonl").read_bytes() == before


def test_extending_steps_keeps_the_schedule_or_is_refused(tmp_path, checkpointed):
    """The checkpoint's run decays to step 8 (optim.decay_steps=8). Without it, steps=12 would move the end
    of the cosine to step 12 and jump the LR; the refusal names the key that keeps the schedule."""
    dump = _copy(checkpointed, tmp_path)
    assert_one_error(train(0, dump, *FAST, "steps=12", timeout=60), "optim.decay_steps 8 -> 12",
                     "optim.decay_steps=8 to continue the same schedule")
    straight = train_ok(0, tmp_path / "straight", *FAST, "steps=8")
    resumed = train_ok(0, dump, *FAST, "steps=12", "optim.decay_steps=8")
    for a, b in zip(straight[4:8], resumed[4:8]):
        assert (a["step"], a["lr"], a["loss"]) == (b["step"], b["lr"], b["loss"])


def test_nothing_written_is_ever_cut(tmp_path, checkpointed):
    # A new job in a dump_dir with metrics but no checkpoint would rewrite them from scratch.
    dump = tmp_path / "no_ckpt"
    train_ok(0, dump, *FAST, "steps=2")
    before = (dump / "metrics.jsonl").read_text()
    assert_one_error(train(0, dump, *FAST, "steps=4", timeout=60), "already holds metrics.jsonl", "steps 1-2")
    assert (dump / "metrics.jsonl").read_text() == before
    # So is a static torchrun's, although every such launch gets the rendezvous id "none".
    dump = tmp_path / "static"
    train_ok(1, dump, *FAST, "steps=2", standalone=False)
    before = (dump / "metrics.jsonl").read_text()
    assert_one_error(train(1, dump, *FAST, "steps=4", timeout=60, standalone=False), "already holds metrics.jsonl")
    assert (dump / "metrics.jsonl").read_text() == before
    # steps below the newest checkpoint would train nothing and drop the later records.
    dump = _copy(checkpointed, tmp_path)
    before = (dump / "metrics.jsonl").read_text()
    assert_one_error(train(0, dump, *FAST, "steps=3", "optim.decay_steps=8", timeout=60),
                     "steps=3 ends before the newest checkpoint")
    assert (dump / "metrics.jsonl").read_text() == before


def test_a_crash_mid_write_leaves_a_partial_line_that_a_resume_repairs(tmp_path, checkpointed):
    dump = _copy(checkpointed, tmp_path)
    shutil.rmtree(dump / "checkpoints" / "step_4")  # the crash came after step 4's record, before its save
    with (dump / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "loss": 6.')
    proc = train(0, dump, *FAST, "steps=6", "optim.decay_steps=8", "checkpoint.freq=2", timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "moved 2 record(s) after step 2 and a partial last line to metrics.superseded.jsonl" in proc.stderr
    assert [r["step"] for r in metrics(dump)] == [1, 2, 3, 4, 5, 6]
    superseded = (dump / "metrics.superseded.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in superseded[:2]] == [3, 4] and superseded[2] == '{"step": 5, "loss": 6.'


def test_a_damaged_newest_checkpoint_says_how_to_use_the_previous_one(tmp_path, checkpointed):
    dump = _copy(checkpointed, tmp_path)
    shard = next((dump / "checkpoints" / "step_4").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    proc = train(0, dump, *FAST, "steps=8", "optim.decay_steps=8", timeout=60)
    assert_one_error(proc, "is truncated", "previous complete checkpoint step_2", "move step_4 out of")


@pytest.mark.parametrize("content, name, fragment", [
    (os.urandom(50_000), "random.bin", "has no random.idx beside it"),
    (os.urandom(50_000), "random.dat", "is not one of the sources this trainer reads (.txt/.jsonl/.jsonl.gz/.jsonl.zst"),
    (b"\xff\xfe" + os.urandom(50_000), "random.txt", "is not UTF-8 text"),
    (b"", "empty.txt", "holds no text"),
    (b"x" * 70_000, "one_line.txt", "no line shorter than 65536 bytes"),
])
def test_data_that_is_not_text_is_one_clear_line(tmp_path, content, name, fragment):
    source = tmp_path / name
    source.write_bytes(content)
    proc = train(0, tmp_path / "dump", *FAST, "steps=2", f"data.source={source}", f"data.cache_dir={tmp_path / 'c'}",
                 timeout=120)
    assert_one_error(proc, "data.source", fragment)
    assert "model.vocab_size" not in proc.stderr


def test_unwritable_outputs_are_found_before_training(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert_one_error(train(0, blocker / "run", *FAST, "steps=2", timeout=60), "is not a writable folder")
    dump = tmp_path / "run"
    dump.mkdir()
    (dump / "checkpoints").write_text("")
    proc = train(0, dump, *FAST, "steps=2", "checkpoint.freq=1", timeout=60)
    assert_one_error(proc, "checkpoints/ folder", "is not a writable folder")
    assert not (dump / "metrics.jsonl").exists()


def test_export_of_a_dump_dir_names_its_checkpoint(tmp_path, checkpointed):
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "export_hf.py"), str(checkpointed), str(tmp_path / "hf")],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert_one_error(proc, "is not a checkpoint", "newest complete checkpoint is", "step_4")


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_ctrl_c_or_sigterm_stops_every_rank_with_one_line(tmp_path, how):
    dump = tmp_path / "run"
    job = subprocess.Popen(command(2, dump, *FAST, "steps=100000"), cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.time() + 120
    while not (dump / "metrics.jsonl").exists() and time.time() < deadline:
        time.sleep(0.2)
    if how == "ctrl-c":
        os.killpg(job.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole foreground group
        line = "interrupted: "
    else:
        os.kill(job.pid, signal.SIGTERM)  # `kill` of torchrun alone: it passes SIGTERM on to its workers
        line = "stopped by SIGTERM (torchrun sends it to every worker when one of them fails or when it is stopped itself): "
    _, stderr = job.communicate(timeout=60)
    assert job.returncode != 0
    assert stderr.count(line) == 1, stderr[-3000:]
    assert ("stopped before the next checkpoint; a restart resumes from the newest one (with none yet, start again "
            "in a new dump_dir)") in stderr
    assert "KeyboardInterrupt" not in stderr and "Terminated" not in stderr  # no per-rank tracebacks


def test_resume_refuses_another_corpus_with_the_same_sequence_count(tmp_path):
    """The same documents in reverse order: the same token and sequence counts, the same tokenizer, other
    batches. Only the data fingerprint (a hash of the packed tokens) can tell, and it does."""
    documents = [p.read_text() for p in sorted(Path(argparse.__file__).parent.joinpath("email").glob("*.py"))]
    corpora = {}
    for name, order in (("a", documents), ("b", documents[::-1])):
        corpora[name] = tmp_path / f"{name}.jsonl"
        corpora[name].write_text("".join(json.dumps({"text": d}) + "\n" for d in order))
    dump, cache = tmp_path / "dump", tmp_path / "cache"
    train_ok(0, dump, *FAST, "steps=2", "optim.decay_steps=4", "checkpoint.freq=2", f"data.source={corpora['a']}",
             f"data.cache_dir={cache}")
    proc = train(0, dump, *FAST, "steps=4", "optim.decay_steps=4", f"data.source={corpora['b']}",
                 f"data.cache_dir={cache}", f"data.tokenizer={dump / 'checkpoints' / 'step_2' / 'tokenizer.model'}",
                 timeout=120)
    assert_one_error(proc, "would change the run", "data.source (or its packed tokens) changed", "data_sha256 '")
    assert "tokenizer" not in proc.stderr.split("would change the run")[1]
    counts = {json.loads(p.read_text())["num_tokens"] for p in cache.glob("tokens-*/meta.json")}
    assert len(list(cache.glob("tokens-*/meta.json"))) == 2 and len(counts) == 1, counts


@pytest.mark.parametrize("schedule, first_steps, fault, steps", [
    # The first run ends inside its warmup; then a longer one.
    (("optim.warmup_steps=10",), 3, None, 6),
    # Warmup-stable-decay: a run of 8 steps, its decay after step 5, dies after its step-3 checkpoint
    # (in the stable phase); the job goes on with steps=12.
    (("optim.warmup_steps=1", "optim.decay_start=5"), 8, "step_start:4:0", 12),
], ids=["warmup", "stable"])
def test_a_run_stopped_before_its_decay_extends_to_the_straight_run_bitwise(tmp_path, schedule, first_steps, fault,
                                                                            steps):
    straight = train_ok(0, tmp_path / "straight", *FAST, *schedule, f"steps={steps}")
    dump = tmp_path / "extended"
    train(1, dump, *FAST, *schedule, f"steps={first_steps}", "checkpoint.freq=3", fault=fault)
    assert [r["step"] for r in metrics(dump)] == [1, 2, 3]
    proc = train(0, dump, *FAST, *schedule, f"steps={steps}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"optim.decay_steps {first_steps} -> {steps} (accepted" in proc.stdout + proc.stderr
    extended = metrics(dump)
    assert [(r["step"], r["lr"], r["loss"]) for r in extended] == [(r["step"], r["lr"], r["loss"]) for r in straight]
