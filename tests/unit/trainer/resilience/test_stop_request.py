"""The stop signal is noted from the moment the handler is installed: one that lands while the signals
held during the imports are released (Slurm sends its warning once) is not forgotten."""

import os
import signal

from trainer.resilience import early_signals
from trainer.resilience.preemption import StopRequest


def test_a_signal_during_the_release_of_the_held_ones_is_kept(monkeypatch):
    release = early_signals.release

    def signal_arrives_meanwhile(stop_signal):
        os.kill(os.getpid(), signal.SIGUSR1)  # handled by StopRequest's handler, installed just before
        return release(stop_signal)

    monkeypatch.setattr(early_signals, "release", signal_arrives_meanwhile)
    previous = signal.getsignal(signal.SIGUSR1)
    try:
        assert StopRequest("USR1").received
        monkeypatch.setattr(early_signals, "release", release)
        assert not StopRequest("USR1").received
    finally:
        signal.signal(signal.SIGUSR1, previous)
