"""A run's metrics.jsonl as the scripts that read it back see it: one record per step, a NaN or Inf the
trainer logged as null restored, a partial last line (a run still writing) left out with a note, and
anything else that is not a record one clear error."""

import json
import math
from pathlib import Path

ABSENT = object()  # a field the record does not have (eval_loss on non-eval steps)


class UnreadableMetrics(Exception):
    pass


def read_metrics(dump_dir: Path, notes: list[str]) -> dict[int, dict]:
    path = dump_dir / "metrics.jsonl"
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise UnreadableMetrics(f"{path} is not a readable metrics file: {e}") from None
    lines = [(number, line) for number, line in enumerate(text.splitlines(), 1) if line.strip()]
    records = []
    for number, line in lines:
        try:
            records.append(json.loads(line))
        except ValueError as e:
            # Only an unterminated last line is a write in progress (or cut by a kill); any other is damage.
            if number < lines[-1][0] or text.endswith("\n"):
                raise UnreadableMetrics(f"{path} line {number} is not a JSON record: {e}") from None
            notes.append(f"{path}: its last line is partial (a run still writing, or killed mid-line): left out")
    for record in records:
        _restore_nonfinite(record)
    steps = [r.get("step") if isinstance(r, dict) else None for r in records]
    odd = next((step for step in steps if type(step) is not int), ABSENT)
    if odd is not ABSENT:  # int() would have read 2.5 as step 2 and compared it with the other run's
        raise UnreadableMetrics(f"{path} is not a readable metrics file: a record's step is {odd!r}, not a whole number")
    by_step = dict(zip(steps, records))
    if not by_step:
        raise UnreadableMetrics(f"{path} holds no records")
    if len(by_step) != len(records):
        raise UnreadableMetrics(f"{path} logs some step twice (a resumed run moves the steps it redoes away)")
    return by_step


def _restore_nonfinite(record: object) -> None:
    """The trainer writes a NaN or Inf as null and names which in `nonfinite`: by field ("grad_norm"), or
    by field and key inside a per-unit field ("unit_grad_norms.layers.0"; field names hold no dot)."""
    kinds = record.get("nonfinite") if isinstance(record, dict) else None
    for key, kind in (kinds.items() if isinstance(kinds, dict) else ()):
        if kind not in ("nan", "inf", "-inf"):
            continue
        if record.get(key, ABSENT) is None:
            record[key] = float(kind)
            continue
        field, _, unit = key.partition(".")
        values = record.get(field)
        if isinstance(values, dict) and values.get(unit, ABSENT) is None:
            values[unit] = float(kind)


def check_number(value: object, what: str) -> None:
    """A logged value is a number, null (a NaN or Inf not restored) or absent; anything else is damage."""
    if value is not None and value is not ABSENT and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise UnreadableMetrics(f"{what}={value!r}, not a number")


def is_finite_number(x: object) -> bool:
    """A number a float holds: not a bool, not an int too large for one (isfinite's OverflowError)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:
        return False


def run_folder(text: str) -> Path:
    """A dump_dir, or its metrics.jsonl (what tab completion often gives)."""
    path = Path(text)
    return path.parent if path.name == "metrics.jsonl" and not path.is_dir() else path
