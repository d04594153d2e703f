"""`model=hf`: the architecture comes from `checkpoint.init_from_hf`'s config.json, not from a model file.

conf/model/hf.yaml leaves each architecture key at `???` (from the folder). This fills them in before the
config is typed; a key the command line sets anyway must agree with the folder (one line naming both
values otherwise). A resume whose folder is gone takes them from its checkpoint's saved config instead,
as it takes the weights and the tokenizer from there.
"""

import json
from pathlib import Path

from parallel.errors import ConfigError
from trainer.checkpoint.files import latest_checkpoint
from trainer.checkpoint.hf_folder import KEY, MODEL_KEYS, model_keys, read_hf_config
from trainer.outputs import CHECKPOINTS_DIR, CONFIG_FILE

FROM_FOLDER = "???"  # hydra's mark of a value left to be given


def fill_hf_model(values: dict) -> dict:
    """`values` (the resolved config, as a dict) with model=hf's architecture keys filled in; any other
    model is returned as it is."""
    model = values.get("model") or {}
    if model.get("name") != "hf":
        return values
    folder = (values.get("checkpoint") or {}).get("init_from_hf")
    if not folder:
        raise ConfigError(f"model=hf takes the architecture from {KEY}'s config.json: set {KEY}=PATH")
    described, source = _described(values, Path(folder).expanduser())
    for key, value in described.items():
        given = model.get(key, FROM_FOLDER)
        if given == FROM_FOLDER:
            model[key] = value
        elif given != value:
            raise ConfigError(f"model.{key}={given!r} contradicts {source}, which gives {value!r}")
    left = [key for key, value in model.items() if value == FROM_FOLDER]
    if left:
        raise ConfigError(f"model.{left[0]}: model=hf does not know it from {source}; set it")
    return values


def _described(values: dict, folder: Path) -> tuple[dict, str]:
    """The architecture keys and where they come from: the folder's config.json, or (the folder gone) the
    resumed checkpoint's saved config."""
    try:
        return model_keys(read_hf_config(folder), folder), f"{KEY}={folder}'s config.json"
    except ConfigError:
        checkpoint = latest_checkpoint(Path(values.get("dump_dir", "")).expanduser() / CHECKPOINTS_DIR)
        if checkpoint is None or not (checkpoint / CONFIG_FILE).is_file():
            raise
    saved = json.loads((checkpoint / CONFIG_FILE).read_text())["model"]
    return {key: saved[key] for key in MODEL_KEYS if key in saved}, f"the resumed checkpoint {checkpoint}"
