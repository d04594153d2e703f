"""The command line before the trainer runs: hydra overrides checked into one `error:` line, the composed
config resolved (train.py, scripts/inspect_data.py), and how every rank exits on bad input.

Without torch, so that the launchers (the Slurm batch script, submitit, TorchX, the sweep launchers)
check a job's overrides in about a second (not the several that importing torch takes) before
submitting it.
"""

import os
import re
import signal
import sys
import time
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from parallel.errors import ConfigError
from parallel.launch_env import LaunchEnv
from trainer.config.schema import DERIVED, unknown_key

RANK0_FIRST_S = 2.0
CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
# conf/config.yaml's sweep folder expands `~` in dump_dir as TrainConfig does.
OmegaConf.register_new_resolver("expanduser", os.path.expanduser, replace=True)
CONFIG_GROUPS = {p.parent.relative_to(CONF_DIR).as_posix() for p in CONF_DIR.rglob("*.yaml") if p.parent != CONF_DIR}


def check_overrides(overrides: list[str], launch: LaunchEnv, hydra_flags: bool = True) -> None:
    """Hydra reports a bad override (an unknown key, a missing config option, broken syntax) in several
    lines and exits 1 before the trainer runs: compose the config first, so that it is one `error:` line
    and exit 2 as for every other bad config. Hydra's own flags (--help, -m sweeps, and sweeps asked for
    by hydra.mode=MULTIRUN) go to it unchecked, except for deletions; where no hydra command line reads
    them (`hydra_flags=False`: the scripts that compose the config themselves), a flag is refused."""
    deletions = [o for o in overrides if o.startswith("~")]
    if deletions:  # the trainer would fill the deleted key with its built-in default, without a word
        exit_on_bad_input(f"{deletions[0]}: deleting a config key is not supported; set its value instead", launch,
                          code=2)
    derived = [key for o in overrides if "=" in o and (key := o.split("=", 1)[0].lstrip("+")) in DERIVED]
    if derived:  # hydra would add it (with +), and the config would drop it as one a saved run holds
        exit_on_bad_input(unknown_key(derived[0]), launch, code=2)
    flags = [arg for arg in overrides if arg.startswith("-")]
    if flags and not hydra_flags:
        exit_on_bad_input(f"{flags[0]} is neither an override (key=value) nor one of this command's flags", launch,
                          code=2)
    if flags or any(arg.lstrip("+").startswith("hydra.mode=") for arg in overrides):
        return
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            compose(config_name="config", overrides=overrides)
    except HydraException as e:
        unknown = unknown_override_key(e)
        exit_on_bad_input(unknown_key(unknown) if unknown else unquoted_tilde(e) or one_line(e), launch, code=2)
    except ValueError as e:  # hydra's own wording for e.g. `data=null` or `optim=3`, without the override
        offending = [o for o in overrides if is_bad_group_choice(o)] or overrides
        exit_on_bad_input(f"{' '.join(offending)}: {e}", launch, code=2)


def unknown_override_key(e: HydraException) -> str | None:
    """`optim.lrr=1e-3`, `optimm.lr=1e-3`: the trainer's key that hydra could not override because it
    does not exist. Hydra suggests adding it with `+`, which the trainer then refuses as unknown: say so
    at once."""
    named = re.match(r"Could not override '([^']+)'", str(e))
    if named is None or not isinstance(e.__cause__, ConfigAttributeError | ConfigKeyError):
        return None
    key, inner = named.group(1), e.__cause__.full_key or ""
    key = inner if inner.startswith(f"{key}.") else key  # a group given as a dict (optim={lrr:1}): its bad key
    return None if key.startswith("hydra.") else key


def unquoted_tilde(e: HydraException) -> str | None:
    """`data.source=~/corpus`: the shell leaves a `~` after `=` unexpanded, and hydra's grammar has no
    unquoted `~` (its lexer error names neither): say how to write it."""
    override = getattr(e, "override", None)
    if not isinstance(e, OverrideParseException) or not isinstance(override, str) or "=" not in override:
        return None
    key, _, value = override.partition("=")
    if "~" not in value or value[:1] in "'\"":
        return None
    if value.startswith("[") and value.endswith("]"):  # a list of paths (data.source=[~/a,b]): quote each path
        quoted = ",".join(f"'{item}'" if "~" in item else item for item in value[1:-1].split(","))
        return (f"{override}: `~` must be quoted or expanded by the shell, e.g. {key}=[{quoted}] (the trainer "
                "expands a leading ~ in its path keys)")
    home = f" or {key}=$HOME/{value[2:]}" if value.startswith("~/") else ""
    return (f"{override}: `~` must be quoted or expanded by the shell, e.g. {key}='{value}' (the trainer expands a "
            f"leading ~ in its path keys){home}")


def is_bad_group_choice(override: str) -> bool:
    """`group=value` for a config group (a folder of conf/) whose value is neither a name nor a list of
    names (hydra's rule), e.g. `optim=3` or `data=null`."""
    parsed = OverridesParser.create().parse_overrides([override])[0]
    return parsed.key_or_group in CONFIG_GROUPS and not isinstance(parsed.value(), str | list)


def one_line(e: HydraException) -> str:
    lines = [line.strip().rstrip(".") for line in str(e).splitlines()]
    if isinstance(e, MissingConfigException) and e.options:
        return f"{lines[0]} (available: {' | '.join(e.options)})"
    text = "; ".join(line for line in lines if line and not line.startswith("See https://"))
    if isinstance(e, OverrideParseException) and e.override not in text:
        text = f"override '{e.override}': {text}"
    return text


def exit_on_bad_input(message: str, launch: LaunchEnv, code: int) -> None:
    """Every rank sees the same bad input: one line from rank 0, every rank exits `code`. The others
    leave a moment later: torchrun stops the whole group as soon as one worker exits, which could kill
    rank 0 before it has printed."""
    if launch.rank == 0:
        print(f"error: {message}", file=sys.stderr, flush=True)
    else:
        linger(RANK0_FIRST_S)
    sys.exit(code)


def resolved(raw: DictConfig) -> dict:
    """The config with interpolations resolved; a broken one (`seed=${nope}`) is one line naming its key."""
    try:
        return OmegaConf.to_container(raw, resolve=True)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        raise ConfigError(f"{key + ': ' if key else ''}{str(e).splitlines()[0]}") from e


def linger(seconds: float) -> None:
    """Wait before exiting with a failure already decided: torchrun's SIGTERM, which comes as soon as
    another rank has exited, now just ends this rank (no traceback, no second line)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    time.sleep(seconds)
