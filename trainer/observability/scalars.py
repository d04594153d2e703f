"""The scalars of a logged step, by the name every scalar sink (TensorBoard, Weights & Biases) shows:
loss, eval loss, LR, grad norm, tokens/s, step time, TFLOP/s and MFU (end to end and computing), exposed
communication, peak memory, skipped steps, communication bytes per op, and (with metrics.unit_norms) each
unit's gradient and parameter norm. One set, so the sinks never differ."""

from trainer.observability.metrics import StepMetrics

_TRAIN = ("loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "tflops", "tflops_compute", "comm_wait_s", "mfu",
          "mfu_compute", "mem_peak_gib", "skipped_steps")


def step_scalars(m: StepMetrics) -> dict[str, float]:
    """{name: value} of step `m`; a field that is not set on this step (eval loss, MFU on CPU) is left out."""
    scalars = {f"train/{name}": getattr(m, name) for name in _TRAIN if getattr(m, name) is not None}
    if m.eval_loss is not None:
        scalars["eval/loss"] = m.eval_loss
    scalars |= {f"comm_bytes/{op}": entry["bytes"] for op, entry in m.comm.items()}
    for kind, norms in (("grad", m.unit_grad_norms), ("param", m.unit_param_norms)):
        scalars |= {f"unit_{kind}_norm/{unit}": value for unit, value in (norms or {}).items()}
    return scalars
