"""The Hugging Face folder a run started from (`checkpoint.init_from_hf`), as its checkpoints carry it: the
folder's config.json, read once as the run starts and then handed from checkpoint to checkpoint, so an
export gives back what the folder declared (its own vocabulary, its list of eos ids) after resumes on
other layouts and after the folder itself is gone."""

import json
from pathlib import Path

ORIGIN_FILE = "hf_origin_config.json"


def origin_config_bytes(init_from_hf: str | None, resumed: Path | None) -> bytes | None:
    """What a run's checkpoints carry: the resumed checkpoint's copy, else the folder's config.json (a run
    started from it), else nothing."""
    if resumed is not None and (resumed / ORIGIN_FILE).is_file():
        return (resumed / ORIGIN_FILE).read_bytes()
    if init_from_hf is None:
        return None
    config = Path(init_from_hf).expanduser() / "config.json"
    return config.read_bytes() if config.is_file() else None


def read_origin_config(ckpt: Path) -> dict | None:
    """The carried config.json of the folder the checkpoint's run started from; None for a run started
    afresh (or saved before checkpoints carried it)."""
    path = ckpt / ORIGIN_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def exported_eos(origin: dict | None, eos_id: int) -> int | list[int]:
    """config.json's eos_token_id: the folder's list where it had one (an instruct model stops at each of
    them; the import checked that it holds the tokenizer's eos), else the tokenizer's eos."""
    listed = None if origin is None else origin.get("eos_token_id")
    return listed if isinstance(listed, list) and eos_id in listed else eos_id
