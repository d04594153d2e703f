"""What a run shows about itself: `metrics.jsonl` and the console line (`metrics.py`), TensorBoard
events (`tensorboard.py`), profiler traces (`profiling.py`), memory snapshots and breakdowns
(`memory.py`), model FLOPs and device peaks for TFLOP/s and MFU (`flops.py`)."""
