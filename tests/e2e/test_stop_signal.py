"""stop_signal=USR1 without a scheduler: the signal reaching ONE worker stops every rank after the same
step with a checkpoint of it; the same command then resumes and ends bitwise like an uninterrupted run."""

import json
import os
import signal
import subprocess
import time

from tests.e2e.launch import ENV, REPO, command, losses, metrics, start, train, train_ok

RUN = ("model=tiny", "seq_len=64", "batch_size=2", "log_all_steps=true", "steps=40", "stop_signal=USR1")


def _worker_pids(dump_dir) -> list[int]:
    out = subprocess.run(["pgrep", "-f", f"train.py dump_dir={dump_dir}"], capture_output=True, text=True).stdout
    return [int(pid) for pid in out.split()]


def test_signal_to_one_worker_stops_all_with_a_checkpoint_then_resumes_bitwise(tmp_path):
    # Steps of tens of milliseconds: 40 of them could end before a loaded machine's poll, pgrep and kill
    # came through (the run then finished unstopped); 200 leave seconds for the signal.
    run = (*RUN[:-2], "steps=200", RUN[-1])
    straight = losses(train_ok(2, tmp_path / "straight", *run))
    dump = tmp_path / "run"
    job = start(2, dump, *run)
    deadline = time.monotonic() + 120
    while not (dump / "metrics.jsonl").exists() or len(metrics(dump)) < 3:
        assert time.monotonic() < deadline and job.poll() is None
        time.sleep(0.1)
    workers = [pid for pid in _worker_pids(dump) if pid != job.pid]
    assert len(workers) == 2, workers
    os.kill(max(workers), signal.SIGUSR1)  # one rank only
    assert job.wait(timeout=120) == 0
    stopped = json.loads((dump / "stopped.json").read_text())
    assert stopped["signal"] == "SIGUSR1" and stopped["step"] < 200
    assert (dump / "checkpoints" / f"step_{stopped['step']}" / "manifest.json").is_file()
    assert max(losses(metrics(dump))) == stopped["step"]
    train_ok(2, dump, *run)  # the same command resumes
    assert not (dump / "stopped.json").exists()
    assert losses(metrics(dump)) == straight


def test_a_signal_during_start_up_stops_after_the_first_step_and_a_restart_stops_too(tmp_path):
    """Data preparation, model build and checkpoint load take minutes at scale: a warning signal then
    must neither kill the rank nor be lost (under Slurm the agent's ignored signal is inherited). A
    worker then dies after the stop: torchrun's restart must stop again, keeping stopped.json (training
    on would end at the time limit, with no requeue)."""
    dump = tmp_path / "run"
    proc = train(2, dump, *RUN, fault="signal_then_die:0:1", max_restarts=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "faulty_train: killing rank 1 at signal_then_die after the stop" in proc.stderr  # the restart ran
    assert "an earlier attempt of this job stopped after step 1 on its stop signal" in proc.stdout + proc.stderr
    stopped = json.loads((dump / "stopped.json").read_text())
    assert {key: stopped[key] for key in ("step", "signal")} == {"step": 1, "signal": "SIGUSR1"}
    assert [r["step"] for r in metrics(dump)] == [1]
    assert (dump / "checkpoints" / "step_1" / "manifest.json").is_file()


def test_a_worker_dying_in_the_stops_own_save_still_stops_the_restart(tmp_path):
    """stopped.json is written before the stop's save: a worker that dies in that save (its own shard
    written, the checkpoint incomplete) leaves it, so torchrun's restart stops at once and the batch script
    requeues the job, which resumes from the newest complete checkpoint. Written after the save, the
    restart trained on into the time limit, unrequeued (Slurm warns once)."""
    dump = tmp_path / "run"
    proc = train(2, dump, *RUN, fault="signal_then_die_saving:0:1", max_restarts=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "faulty_train: killing rank 1 at signal_then_die_saving in the stop's save" in proc.stderr
    assert "an earlier attempt of this job stopped after step 1 on its stop signal" in proc.stdout + proc.stderr
    assert json.loads((dump / "stopped.json").read_text())["step"] == 1
    assert not (dump / "checkpoints" / "step_1").exists()


def _catches(pid: int, sig: signal.Signals) -> bool:
    status = open(f"/proc/{pid}/status").read()
    caught = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
    return bool(caught >> (sig - 1) & 1)


def test_a_signal_while_train_py_imports_is_kept_where_the_launcher_ignores_it(tmp_path):
    """The launchers start workers with the warning signal ignored; train.py notes it from its first line,
    before seconds of imports and config composition (torch not even loaded yet)."""
    dump = tmp_path / "run"
    ignore = lambda: signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # noqa: E731
    job = subprocess.Popen(command(0, dump, *RUN), cwd=REPO, env=ENV, preexec_fn=ignore, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not _catches(job.pid, signal.SIGUSR1):
        assert time.monotonic() < deadline and job.poll() is None
        time.sleep(0.005)
    torch_loaded = "libtorch" in open(f"/proc/{job.pid}/maps").read()
    job.send_signal(signal.SIGUSR1)
    out, err = job.communicate(timeout=180)
    assert not torch_loaded  # the signal was sent during the imports
    assert job.returncode == 0, err[-3000:]
    assert json.loads((dump / "stopped.json").read_text())["step"] == 1
    assert [r["step"] for r in metrics(dump)] == [1]
