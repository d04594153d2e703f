"""What keeps a run safe to stop, restart and share a folder: one job per dump_dir (`dump_dir_lock.py`),
stop signals before a time limit or preemption (`preemption.py`, `early_signals.py`), and the policy for
a NaN or Inf loss or gradient (`nonfinite.py`).

Nothing is imported here: train.py imports `early_signals` before anything heavy."""
