"""Warning signals that arrive before the trainer listens for its stop signal.

Our launchers start the workers with the scheduler's warning signals ignored (torchrun's agent must
survive them, and an ignored signal stays ignored across exec). Until the config says which one stops
the job, seconds of imports and config composition pass, in which such a signal would be dropped and
the job would run into its time limit. `hold()`, the first thing train.py does, notes them instead;
`release()` hands the note to the trainer's StopRequest and puts the other signals back as they were.
A signal whose disposition is not "ignore" is left alone (its default still ends the process).
"""

import signal

WARNING_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)
_held: set[signal.Signals] = set()
_noted: set[int] = set()


def hold() -> None:
    for sig in WARNING_SIGNALS:
        if signal.getsignal(sig) == signal.SIG_IGN:
            _held.add(sig)
            signal.signal(sig, _note)


def _note(signum: int, frame: object) -> None:
    _noted.add(signum)


def release(stop_signal: signal.Signals | None) -> bool:
    """After the caller has installed its own handler for `stop_signal`: the other held signals are
    ignored again; returns whether `stop_signal` arrived while held."""
    for sig in _held - {stop_signal}:
        signal.signal(sig, signal.SIG_IGN)
    arrived = stop_signal in _noted
    _held.clear()
    _noted.clear()
    return arrived
