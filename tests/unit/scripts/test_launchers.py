"""The launchers build one command: the TorchX component's AppDef runs exactly the torchrun line of the
Slurm batch script for the same overrides (the script run with stand-ins for srun and scontrol)."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.e2e.launch import REPO

OVERRIDES = ["model=tiny", "steps=7", "optim.lr=1e-3", "data.source=/data/my corpus"]


def _run_sbatch(bin_dir, overrides: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "1234", "SLURM_NNODES": "2",
           "SLURM_JOB_NODELIST": "node[7-8]", "SLURM_SUBMIT_DIR": str(REPO), "NPROC_PER_NODE": "8", **(env or {})}
    return subprocess.run(["bash", "scripts/slurm/train.sbatch", *overrides], cwd=REPO, env=env, capture_output=True,
                          text=True)


def _fake_slurm(tmp_path, stops_in: Path | None = None) -> Path:
    """Stand-ins for scontrol (its calls other than `show hostnames` logged to scontrol_calls) and srun
    (its command written to srun_command; with `stops_in`, it writes stopped.json there as a trainer
    stopped by its signal would)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "scontrol").write_text('#!/bin/sh\nif [ "$1 $2" = "show hostnames" ]; then printf "node7\\nnode8\\n"; '
                                      f'else echo "$@" >> {tmp_path}/scontrol_calls; fi\n')
    stop = f"echo '{{\"step\": 70}}' > '{stops_in}/stopped.json'\n" if stops_in is not None else ""
    (bin_dir / "srun").write_text(f'#!/bin/sh\nprintf "%s" "$4" > {tmp_path}/srun_command\n'
                                  f'printf "%s" "$SRUN_CPUS_PER_TASK" > {tmp_path}/srun_cpus\n{stop}')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    return bin_dir


def _sbatch_command(tmp_path, overrides: list[str], env: dict | None = None, stops_in: Path | None = None
                    ) -> list[str]:
    """What train.sbatch has srun run on the first node of a fake 2-node job 1234."""
    done = _run_sbatch(_fake_slurm(tmp_path, stops_in), overrides, env)
    assert done.returncode == 0, done.stderr
    script = (tmp_path / "srun_command").read_text()
    per_node = re.fullmatch(r"""trap '' USR1; if \[ "\$SLURM_NODEID" = 0 \]; then exec (.*); else exec (.*); fi""", script)
    assert per_node is not None, script
    head, other = (shlex.split(command) for command in per_node.groups())
    # Only the first node hosts the rendezvous, and says so (a port another job holds then fails at once).
    assert head == [other[0], *[a.replace("is_host=false", "is_host=true") for a in other[1:]]]
    assert "--rdzv_conf=is_host=true" in head
    return head


@pytest.mark.parametrize("override, fragments", [
    ("optim.lrr=1", ("error: optim.lrr is not a known config key",)),
    ("stop_signal=USR2", ("error: stop_signal=USR2: the scheduler sends SIGUSR1 before the time limit",)),
    ("stop_signal=null", ("error: stop_signal=null: the scheduler sends SIGUSR1",)),
    ("--cfg=job", ("error: --cfg=job is neither an override (key=value) nor one of this command's flags",)),
])
def test_the_batch_script_refuses_a_bad_override_in_one_line_before_srun(tmp_path, override, fragments):
    done = _run_sbatch(_fake_slurm(tmp_path), ["model=tiny", override])
    assert done.returncode != 0 and not (tmp_path / "srun_command").exists()
    assert [line for line in done.stderr.splitlines() if line.strip()] == [done.stderr.strip()], done.stderr
    assert all(fragment in done.stderr for fragment in fragments), done.stderr


def test_launch_py_refuses_a_bad_override_in_one_line():
    done = subprocess.run([sys.executable, "scripts/launch.py", "--local", "model=tinyy"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.startswith("error: ") and done.stderr.count("\n") == 1, done.stderr
    assert "model/tinyy" in done.stderr


def test_the_node_command_refuses_a_bad_override_without_a_dump_dir_too():
    """launch_command.py checked the overrides only while composing the dump_dir it was given."""
    node = [sys.executable, "scripts/launch_command.py", "--nnodes", "1", "--nproc-per-node", "2", "--rdzv-endpoint",
            "h:1", "--rdzv-id", "1"]
    for overrides, fragment in ((["model=tiny", "optim.lrr=1"], "error: optim.lrr is not a known config key"),
                                (["model=tiny", "--foo"], "error: --foo is neither an override")):
        done = subprocess.run([*node, "--", *overrides], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and not done.stdout and done.stderr.count("\n") == 1, done.stderr
        assert done.stderr.startswith(fragment), done.stderr
    done = subprocess.run([*node, "--max-restarts", "-1", "model=tiny"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "--max-restarts: must be at least 0, got -1" in done.stderr, done.stderr


def test_the_launchers_refuse_values_and_flags_train_py_would_refuse_before_starting_torchrun():
    """Values were not checked: torchrun started (or the job queued) and every rank failed, with torchrun's
    traceback after train.py's line; SIGUSR1 passed the launcher's check and train.py refused it."""
    node = [sys.executable, "scripts/launch_command.py", "--nnodes", "1", "--nproc-per-node", "2", "--rdzv-endpoint",
            "h:1", "--rdzv-id", "1", "--", "model=tiny"]
    for override, line in (("steps=abc", "error: steps='abc' must be int"),
                           ("model_parallel_size=3", "error: model.n_heads=4 is not divisible by model_parallel_size=3"),
                           ("stop_signal=SIGUSR1", "error: stop_signal=SIGUSR1: the scheduler sends SIGUSR1 before the "
                            "time limit: write stop_signal=USR1, or leave it out (the launcher sets it)")):
        done = subprocess.run([*node, override], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and not done.stdout and done.stderr == line + "\n", done.stderr
    done = subprocess.run([sys.executable, "scripts/launch.py", "--local", "--nodes", "2", "model=tiny"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "error: --nodes does not combine with --local" in done.stderr, done.stderr
    # A value from the job's environment is the job's to check: here TP is unset and 3 would be refused.
    done = subprocess.run([*node, "model_parallel_size=${oc.env:TP,3}"], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={k: v for k, v in os.environ.items() if k != "TP"})
    assert done.returncode == 0 and "train.py" in done.stdout, done.stderr
    # A sweep is left to train.py (the check composed it and ended in hydra's traceback).
    done = subprocess.run([*node, "hydra.mode=MULTIRUN", "optim.lr=1e-3,1e-2"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "train.py" in done.stdout and not done.stderr, done.stderr


def test_a_slurm_sweep_refuses_a_stop_signal_submitit_does_not_send(tmp_path):
    """As scripts/launch.py: with another stop_signal the workers ignore submitit's SIGUSR2 and a point dies
    at its time limit without a checkpoint or a requeue. Every point is checked before any is submitted."""
    bin_dir = tmp_path / "bin"  # an sbatch that only notes a submission
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f"#!/bin/sh\ntouch {tmp_path}/submitted\nexit 1\n")
    (bin_dir / "sbatch").chmod(0o755)
    done = subprocess.run([sys.executable, "train.py", "-m", "hydra/launcher=torchrun_slurm", "model=tiny",
                           f"hydra.launcher.slurm.logs={tmp_path / 'logs'}", f"dump_dir={tmp_path / 'sweep'}",
                           "stop_signal=USR2,null"], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"})
    assert done.returncode != 0 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("error: stop_signal=null: the scheduler sends SIGUSR2"), done.stderr
    assert not (tmp_path / "submitted").exists()


def test_array_task_ids_get_ports_and_only_a_run_that_stopped_is_requeued(tmp_path, monkeypatch):
    """submitit's array and batch jobs have ids like 1234_5. A torchrun that failed after the stop signal
    (its save failed) is not requeued: each requeue would train to the next limit and fail. Nor is a run
    that finished without stopping (the signal came in its last step): requeued under the same id and
    dump_dir, it would train again, from step 0 where it saved no checkpoint. Only a stop is requeued."""
    import submitit

    from scripts.launch import TrainOnNode
    from scripts.launch_command import rendezvous_port

    assert rendezvous_port("1234") == rendezvous_port(1234) == 29500 + 1234
    assert rendezvous_port("1234_5") == 29500 + 1239 and rendezvous_port("2999_1") == 29500

    class Job:
        USR_SIG, job_id, num_nodes, node, hostnames = "USR2", "1234_5", 1, 0, ["node7"]

    monkeypatch.setattr(submitit, "JobEnvironment", Job)
    dump = tmp_path / "dump" / "submitit-1234_5"
    dump.mkdir(parents=True)
    for code, stopped, requeued in ((2, True, False), (0, False, False), (0, True, True)):
        (dump / "stopped.json").unlink(missing_ok=True)
        if stopped:
            (dump / "stopped.json").write_text('{"job": "1234_5", "step": 7, "signal": "SIGUSR2"}')
        node = TrainOnNode(["model=tiny"], 1, sys.executable, cwd=str(tmp_path))
        node.process = subprocess.Popen([sys.executable, "-c", f"raise SystemExit({code})"])
        assert (node.checkpoint() is not None) == requeued, (code, stopped)


def test_a_requeued_submitit_job_does_not_take_its_previous_runs_stop_for_its_own(tmp_path, monkeypatch):
    """The job stopped on its signal (stopped.json of job 4242, step 500) and submitit requeued it under
    the same id; torchrun's attempt 0 died in start-up, before the trainer took the dump_dir over. Attempt
    1 (the stand-in for torchrun here) must not find the old marker: it would stop at once, exit 0. (A
    new launch's name tells the marker apart, but not where a restart has a store of its own and goes by
    the job's id, as the stand-in does.)"""
    import submitit

    from scripts.launch import TrainOnNode

    class Job:  # submitit's view of the requeued job's first node
        USR_SIG, job_id, num_nodes, node, hostnames = "USR2", "4242", 1, 0, ["node7"]

    monkeypatch.setattr(submitit, "JobEnvironment", Job)
    dump = tmp_path / "dump" / "submitit-4242"  # the launcher's default, relative to the submit directory
    dump.mkdir(parents=True)
    (dump / "stopped.json").write_text('{"job": "4242", "launch": "L0", "step": 500, "signal": "SIGUSR2"}')
    attempt_1 = tmp_path / "torchrun"
    attempt_1.write_text(f"#!{sys.executable}\nimport sys\nsys.path.insert(0, {str(REPO)!r})\n"
                         "from pathlib import Path\nfrom trainer.resilience.preemption import take_over_stop_marker\n"
                         f"stopped = take_over_stop_marker(Path({str(dump)!r}), '', '4242')\n"
                         "sys.exit(0 if stopped is None else 3)\n")
    attempt_1.chmod(0o755)
    assert TrainOnNode(["model=tiny"], 1, str(attempt_1), cwd=str(tmp_path))() == 0


def test_torchx_component_runs_the_sbatch_command(tmp_path):
    import torchx  # noqa: F401  (the dev extra: a missing install fails here rather than skipping)

    from scripts.torchx_components import train

    command = _sbatch_command(tmp_path, OVERRIDES)
    assert command[1:4] == ["-m", "torch.distributed.run", "--nnodes=2"]
    assert "--rdzv_endpoint=node7:30734" in command and "--rdzv_id=1234" in command
    assert command[-5:] == ["stop_signal=USR1", *OVERRIDES]  # overrides pass through, spaces and all
    app = train(*OVERRIDES, nnodes=2, nproc_per_node=8, rdzv_endpoint="node7:30734", rdzv_id="1234",
                python=command[0], dump_dir="dump/slurm-1234")
    (role,) = app.roles
    # One command for every node: torch tells the rendezvous host by its name.
    assert [role.entrypoint, *role.args] == [a for a in command if a != "--rdzv_conf=is_host=true"]
    for bad, message in (({"nnodes": 0}, "--nnodes 0: must be at least 1"),
                         ({"mem_gb": -3}, "--mem_gb -3: must be at least 0"),
                         ({"gpus_per_node": -1}, "--gpus_per_node -1: must be at least 0")):
        with pytest.raises(ValueError, match=message):
            train(*OVERRIDES, **bad)
    assert role.num_replicas == 2
    assert role.resource.memMB == 0  # the scheduler's default memory, unless asked
    assert train(*OVERRIDES, mem_gb=512).roles[0].resource.memMB == 512 * 1024

    restarting = _sbatch_command(tmp_path / "restarts", OVERRIDES, env={"MAX_RESTARTS": "3"})
    assert restarting == [*command[:5], "--max-restarts=3", *command[5:]]  # a torchrun flag, before train.py
    app = train(*OVERRIDES, nnodes=2, nproc_per_node=8, rdzv_endpoint="node7:30734", rdzv_id="1234",
                python=command[0], dump_dir="dump/slurm-1234", max_restarts=3)
    assert [app.roles[0].entrypoint, *app.roles[0].args] == [a for a in restarting if "is_host" not in a]
    with pytest.raises(ValueError, match="--nnodes 2 needs --rdzv_endpoint HOST:PORT"):
        train(*OVERRIDES, nnodes=2)
    by_gpus = train(*OVERRIDES, nnodes=2, gpus_per_node=8, rdzv_endpoint="node7:30734", rdzv_id="1234")
    assert "--nproc_per_node=8" in by_gpus.roles[0].args  # one rank per GPU unless told otherwise


def test_each_node_of_a_batch_job_runs_one_rank_per_gpu_it_was_given(tmp_path):
    """The batch script runs on the first node: its SLURM_GPUS_ON_NODE is not every node's (4 + 8 GPUs
    of --gpus=12), so each node's torchrun counts its own ("gpu"); NPROC_PER_NODE still wins."""
    env = {"NPROC_PER_NODE": "", "SLURM_GPUS_ON_NODE": "4"}
    assert "--nproc_per_node=gpu" in _sbatch_command(tmp_path / "gpus", OVERRIDES, env=env)
    assert "--nproc_per_node=1" in _sbatch_command(tmp_path / "cpus", OVERRIDES, env={"NPROC_PER_NODE": ""})
    assert "--nproc_per_node=2" in _sbatch_command(tmp_path / "given", OVERRIDES, env=env | {"NPROC_PER_NODE": "2"})


def test_torchx_runs_the_component_file_as_documented(tmp_path):
    """torchx's CLI lints the component's signature and runs the file outside its folder (dry run)."""
    torchx = Path(sys.executable).with_name("torchx")
    assert torchx.is_file(), "torchx's CLI is missing: install the dev extra"
    done = subprocess.run([str(torchx), "run", "--dryrun", "--scheduler", "local_cwd", "scripts/torchx_components.py:train",
                           "--nnodes", "1", "--nproc_per_node", "2", "--", "model=tiny", "data.source=/data/my corpus"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "'data.source=/data/my corpus'" in done.stdout and "torch.distributed.run" in done.stdout


def test_batch_script_keeps_a_given_dump_dir(tmp_path):
    command = _sbatch_command(tmp_path, ["dump_dir=/shared/run7", "model=tiny"])
    assert [a for a in command if a.startswith("dump_dir=")] == ["dump_dir=/shared/run7"]


def test_the_dump_dir_the_batch_script_checks_is_the_one_the_run_writes():
    """The script requeues on {dump_dir}/stopped.json: a `++` override sets the run's dump_dir too."""
    from scripts.launch_command import dump_dir_of, torchrun_args

    for override in ("dump_dir=/data/run1", "++dump_dir=/data/run1"):
        args = torchrun_args(1, 2, "node7:30734", "7", ["model=tiny", override], "dump/slurm-7")
        assert [a for a in args if "dump_dir" in a] == [override]  # no default added beside it
        assert dump_dir_of(["model=tiny", override], "dump/slurm-7") == "/data/run1"
    assert dump_dir_of(["model=tiny"], "dump/slurm-7") == "dump/slurm-7"
    assert dump_dir_of(["dump_dir='~/run1'"], None) == str(Path.home() / "run1")  # as TrainConfig expands it


def test_a_dump_dir_from_a_picked_config_beats_the_launchers_default(tmp_path):
    """experiment=cpu_demo sets dump_dir=dump/cpu_demo: a plain torchrun writes (and resumes) there, so
    every launcher does too; its default only replaces config.yaml's own dump_dir."""
    from scripts.launch_command import dump_dir_of

    assert dump_dir_of(["experiment=cpu_demo"], "dump/slurm-7") == "dump/cpu_demo"
    assert dump_dir_of(["dump_dir=dump/default"], "dump/slurm-7") == "dump/default"  # said: kept
    command = _sbatch_command(tmp_path, ["experiment=cpu_demo", "model=tiny"])
    assert not [a for a in command if "dump_dir" in a], command


def test_a_stopped_job_requeues_whatever_form_its_dump_dir_override_takes(tmp_path):
    """The script looks for stopped.json where the trainer writes it: a quoted dump_dir, or one from an
    interpolation, is the folder the config resolves, not the override's text."""
    for i, (override, folder) in enumerate([
        (f"dump_dir='{tmp_path}/run q, 1'", tmp_path / "run q, 1"),
        ("dump_dir=${oc.env:RUNS_ROOT}/run2", tmp_path / "run2"),
    ]):
        folder.mkdir()
        case = tmp_path / f"case{i}"
        case.mkdir()
        command = _sbatch_command(case, [override, "model=tiny"], env={"RUNS_ROOT": str(tmp_path)}, stops_in=folder)
        assert override in command
        assert (case / "scontrol_calls").read_text().split() == ["requeue", "1234"], override


def test_a_marker_left_by_the_previous_run_does_not_requeue_the_job(tmp_path):
    """The job stopped and was requeued; this run failed before the trainer took its dump_dir over (and
    with it removed the marker): requeueing on the old marker would loop."""
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "stopped.json").write_text('{"step": 70, "signal": "SIGUSR1"}')
    _sbatch_command(tmp_path, [f"dump_dir={folder}", "model=tiny"])
    assert not (tmp_path / "scontrol_calls").exists() and not (folder / "stopped.json").exists()


def test_submitit_requeues_a_long_run_through_many_time_limits(tmp_path, monkeypatch):
    """submitit gives a job up after 3 time limits by default: a multi-day run meets one per requeue."""
    from scripts.launch import MAX_TIME_LIMITS, slurm_executor

    # submitit builds a Slurm executor only where `srun` is on PATH: a stand-in, so the test does not
    # depend on whether the Slurm end-to-end tests have installed the real one yet.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text("#!/bin/sh\n")
    (bin_dir / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    executor = slurm_executor(tmp_path, nodes=2, gpus_per_node=8, timeout_min=60, partition="gpu")
    assert executor._executor.max_num_timeout == MAX_TIME_LIMITS >= 1000
    assert "cpus_per_task" not in executor._executor.parameters
    assert executor._executor.parameters["signal_delay_s"] == 120
    executor = slurm_executor(tmp_path, nodes=2, gpus_per_node=8, timeout_min=60, partition="gpu", cpus_per_task=96,
                              warning_s=600)
    assert executor._executor.parameters["cpus_per_task"] == 96
    assert executor._executor.parameters["srun_args"] == ["--cpus-per-task=96"]  # srun does not inherit it
    assert executor._executor.parameters["signal_delay_s"] == 600


def test_the_batch_script_hands_srun_the_cores_sbatch_was_given(tmp_path):
    """srun does not inherit sbatch's --cpus-per-task (Slurm 22.05 on): the script passes it on."""
    _sbatch_command(tmp_path / "given", ["model=tiny"], env={"SLURM_CPUS_PER_TASK": "96"})
    assert (tmp_path / "given" / "srun_cpus").read_text() == "96"
    _sbatch_command(tmp_path / "default", ["model=tiny"])
    assert (tmp_path / "default" / "srun_cpus").read_text() == ""


def test_a_slurm_sweep_runs_one_rank_per_gpu_unless_told_otherwise():
    """As scripts/launch.py and train.sbatch: a sweep asking for 8 GPUs per node must not train on one."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    def launcher(*overrides):
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
            cfg = compose(config_name="config", overrides=["hydra/launcher=torchrun_slurm", *overrides],
                          return_hydra_config=True)
        return instantiate(cfg.hydra.launcher)

    assert launcher("hydra.launcher.slurm.gpus_per_node=8").nproc_per_node == 8
    assert launcher().nproc_per_node == 1
    assert launcher("hydra.launcher.slurm.gpus_per_node=8", "hydra.launcher.nproc_per_node=2").nproc_per_node == 2
    assert launcher("hydra.launcher.slurm.gpus_per_node=null").nproc_per_node == 1


def test_a_lone_process_in_a_shell_that_exports_a_master_address_runs_alone(monkeypatch):
    """torchrun sets MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE; the first two alone, left in a shell
    for other jobs, must not make `python train.py` join that address's store."""
    from parallel.launch_env import LaunchEnv

    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "node3")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert not LaunchEnv.from_torchrun().torchrun
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    launch = LaunchEnv.from_torchrun()
    assert launch.torchrun and (launch.rank, launch.world_size) == (1, 2)


def test_the_launchers_override_check_imports_no_torch():
    """Every launcher checks a job's overrides before submitting it (train.sbatch three times): without
    torch that takes about a second instead of several."""
    check = ("import sys; from scripts.launch_command import dump_dir_of; dump_dir_of(['model=tiny'], None); "
             "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    done = subprocess.run([sys.executable, "-c", check], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout[:300] + done.stderr[-2000:]


def test_a_local_sweep_point_hosts_its_own_rendezvous(monkeypatch):
    """As launch.py --local: with the host left to torch's guess, a process that took the free port
    meanwhile would be joined as this point's store."""
    from scripts import hydra_launcher

    ran = []
    monkeypatch.setattr(hydra_launcher.subprocess, "run", lambda argv: ran.append(argv) or SimpleNamespace(returncode=0))
    assert hydra_launcher.TorchrunLauncher(2)._run_here(["model=tiny"], 0) is None
    assert "--rdzv_conf=is_host=true" in ran[0] and "--nproc_per_node=2" in ran[0]

