"""Whose stop stopped.json is: an earlier attempt of this torchrun launch (a restart stops again), or
an earlier launch of the same job id (a rerun, which trains: the marker is removed)."""

import json

from trainer.resilience.preemption import take_over_stop_marker


def _marker(folder, job: str, launch: str, step: int = 70) -> None:
    (folder / "stopped.json").write_text(json.dumps({"step": step, "signal": "SIGUSR1", "job": job, "launch": launch}))


def test_a_restart_of_the_launch_that_stopped_stops_again(tmp_path):
    _marker(tmp_path, "my-run", "a1b2")
    assert take_over_stop_marker(tmp_path, "a1b2", "my-run") == 70
    assert (tmp_path / "stopped.json").exists()  # kept for the batch script's requeue


def test_a_rerun_under_the_same_rdzv_id_trains_and_drops_the_last_runs_stop(tmp_path):
    """`torchrun --rdzv_id=my-run` again after a stop, its first attempt dead before taking the dump_dir
    over: the second attempt must not read the last run's stop as its own (it exited 0, untrained)."""
    _marker(tmp_path, "my-run", "a1b2")
    assert take_over_stop_marker(tmp_path, "c3d4", "my-run") is None
    assert not (tmp_path / "stopped.json").exists()


def test_a_restart_that_cannot_name_its_launch_goes_by_the_job_id(tmp_path):
    _marker(tmp_path, "my-run", "a1b2")
    assert take_over_stop_marker(tmp_path, "", "other-run") is None
    _marker(tmp_path, "my-run", "a1b2")
    assert take_over_stop_marker(tmp_path, "", "my-run") == 70


def test_a_marker_without_a_launch_or_unreadable_is_an_earlier_runs(tmp_path):
    (tmp_path / "stopped.json").write_text('{"step": 70, "job": "my-run"}')
    assert take_over_stop_marker(tmp_path, "a1b2", "my-run") is None
    (tmp_path / "stopped.json").write_text("{half")
    assert take_over_stop_marker(tmp_path, "a1b2", "my-run") is None and not (tmp_path / "stopped.json").exists()
