"""A stop_signal torchrun's agent handles itself is refused where an agent runs; elsewhere, or where
TORCHELASTIC_SIGNALS_TO_HANDLE leaves it out, it is the trainer's."""

import pytest

from parallel.errors import ConfigError
from parallel.launch_env import LaunchEnv
from trainer.resilience.preemption import check_stop_signal_reaches_workers

TORCHRUN = {"MASTER_ADDR": "h", "MASTER_PORT": "1", "RANK": "0", "WORLD_SIZE": "1", "TORCHELASTIC_RUN_ID": "j"}


def _launch(monkeypatch, env: dict) -> LaunchEnv:
    for key in (*TORCHRUN, "TORCHELASTIC_SIGNALS_TO_HANDLE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return LaunchEnv.from_torchrun()


def test_hup_is_refused_under_torchruns_agent_only(monkeypatch):
    under_agent = _launch(monkeypatch, TORCHRUN)
    with pytest.raises(ConfigError, match="stop_signal=HUP: torchrun's agent takes SIGHUP itself"):
        check_stop_signal_reaches_workers("HUP", under_agent)
    for name in ("USR1", "USR2", None):
        check_stop_signal_reaches_workers(name, under_agent)
    check_stop_signal_reaches_workers("HUP", _launch(monkeypatch, {}))
    told = _launch(monkeypatch, {**TORCHRUN, "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM, SIGINT,SIGQUIT"})
    check_stop_signal_reaches_workers("HUP", told)
    assert told.agent_signals == ("TERM", "INT", "QUIT")
