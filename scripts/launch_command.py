"""The one torchrun command line every launcher uses (the Slurm batch script, submitit, TorchX).

    python scripts/launch_command.py --nnodes N --nproc-per-node P --rdzv-endpoint HOST:PORT \
        --rdzv-id ID [--hosts-rendezvous true|false] [--dump-dir DIR] [--max-restarts N] -- [hydra overrides]

prints it shell-quoted. Overrides pass through unchanged; `stop_signal=USR1` (checkpoint and exit on
Slurm's warning signal) is added unless the overrides set it, and the launcher's default `dump_dir`
only where the composed config leaves dump_dir at config.yaml's own (a `dump_dir=...` override, or a
config the overrides pick that sets it, `experiment=cpu_demo`, keeps its folder, as under a plain
torchrun); a bad override is one `error:` line (exit 2), as train.py would give it, and a `stop_signal`
other than USR1 is refused (the workers would ignore the scheduler's warning).

The rendezvous port of a job is 29500 + job id % 3000 (an array task's id, 123_4, counts as 123 + 4):
below Linux's ephemeral ports (32768 up), and the same for two jobs on one head node only when their
ids differ by a multiple of 3000. Each node says whether it hosts the rendezvous (`is_host`): left to
torch's guess, a head node whose port another job holds would silently join that job's rendezvous
(and die when it ends); told, it fails at once.
"""

import argparse
import functools
import os
import shlex
import socket
import sys
from pathlib import Path

DEFAULT_STOP_SIGNAL = "USR1"
REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script, train.py's config checks are imported from the checkout
    sys.path.insert(0, str(REPO))


def rendezvous_port(job_id: str | int) -> int:
    """The job's port; `job_id` is Slurm's (1234, or an array task's 1234_5)."""
    return 29500 + sum(int(part) for part in str(job_id).split("_")) % 3000


def ranks_per_node(nproc_per_node: int | None, gpus_per_node: int | None) -> int:
    """Ranks per node: as given, else one per GPU, else 1 (the batch script's rule too)."""
    return nproc_per_node if nproc_per_node is not None else max(gpus_per_node or 0, 1)


def node_ranks(text: str) -> int | str:
    """argparse type of ranks per node: a count, or "gpu" (torchrun counts the node's own GPUs)."""
    return text if text == "gpu" else positive_int(text)


def positive_int(text: str) -> int:
    """argparse type of node and rank counts."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def count(text: str) -> int:
    """argparse type of restart counts: 0 or more."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value


def override_key(override: str) -> str:
    """The config key a hydra override sets (`key=v`, `+key=v`, `++key=v`)."""
    return override.split("=", 1)[0].lstrip("+~")


def override_keys(overrides: list[str]) -> set[str]:
    """The config keys the overrides set (not the bare flags among them)."""
    return {override_key(o) for o in overrides if "=" in o}


def torchrun_args(nnodes: int, nproc_per_node: int | str, rdzv_endpoint: str, rdzv_id: str, overrides: list[str],
                  dump_dir: str | None = None, python: str = "python", stop_signal: str = DEFAULT_STOP_SIGNAL,
                  max_restarts: int = 0, hosts_rendezvous: bool | None = None) -> list[str]:
    """argv of torchrun on one node, running train.py with the overrides; `dump_dir`: the launcher's
    default, passed only where the config leaves dump_dir at its own default; `max_restarts`: torchrun
    restarts the whole group that often when a worker dies (the run resumes from its newest checkpoint);
    `hosts_rendezvous`: whether this node hosts the rendezvous store (None: torch guesses from the
    endpoint's host name); `nproc_per_node` "gpu": as many as the node has GPUs."""
    if nnodes < 1 or (nproc_per_node != "gpu" and nproc_per_node < 1) or max_restarts < 0:
        raise ValueError(f"nnodes={nnodes} and nproc_per_node={nproc_per_node} must be at least 1, "
                         f"max_restarts={max_restarts} at least 0")
    extra = [f"dump_dir={dump_dir}"] if dump_dir is not None and launcher_dump_dir_applies(overrides) else []
    extra += [] if "stop_signal" in override_keys(overrides) else [f"stop_signal={stop_signal}"]
    host = [] if hosts_rendezvous is None else [f"--rdzv_conf=is_host={str(hosts_rendezvous).lower()}"]
    return [
        python, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc_per_node={nproc_per_node}",
        *([f"--max-restarts={max_restarts}"] if max_restarts else []),
        "--rdzv_backend=c10d", f"--rdzv_endpoint={rdzv_endpoint}", f"--rdzv_id={rdzv_id}", *host,
        str(REPO / "train.py"), *extra, *overrides,
    ]


def check_overrides_here(overrides: list[str]) -> None:
    """Before a job is submitted: a bad override is train.py's one `error:` line (exit 2), not a
    traceback (after the submission, for a job that would fail)."""
    from parallel.launch_env import LaunchEnv
    from trainer.config.cli import check_overrides

    check_overrides(overrides, LaunchEnv.from_torchrun(), hydra_flags=False)


def check_values_here(overrides: list[str], world_size: int | None) -> None:
    """Before torchrun starts (or a job is submitted): a value out of range or a layout the world cannot
    hold is train.py's one `error:` line, exit 2, not every rank's line and torchrun's traceback. What
    needs the job's files or devices (data, a Hugging Face folder, model=hf) is left to train.py. It
    imports torch (a few seconds, once per job), unlike the key check the launchers run before."""
    check_overrides_here(overrides)
    if any(o.lstrip("+").startswith("hydra.mode=") for o in overrides):  # a sweep: train.py says what it says
        return
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from parallel.errors import ConfigError
    from trainer.config.cli import resolved
    from trainer.config.rules import check_launchable
    from trainer.config.schema import from_dict

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        raw = compose(config_name="config", overrides=overrides)
    if "${oc.env:" in OmegaConf.to_yaml(raw):  # the job's environment gives those values, not this host's
        return
    try:
        values = resolved(raw)
    except ConfigError:  # a broken interpolation: train.py names it
        return
    if (values.get("model") or {}).get("name") == "hf":
        return
    try:
        check_launchable(from_dict(values), world_size)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def check_stop_signal(overrides: list[str], scheduler_signal: str) -> None:
    """A `stop_signal=...` override must name the signal the scheduler sends before the time limit: with
    another one (or null) the workers ignore the warning, and the job dies at its limit without a
    checkpoint. One `error:` line otherwise."""
    given = [o for o in overrides if "=" in o and override_key(o) == "stop_signal"]
    if not given:
        return
    if given[-1].split("=", 1)[1].strip("'\"") != scheduler_signal:  # train.py takes USR1, not SIGUSR1
        print(f"error: {given[-1]}: the scheduler sends SIG{scheduler_signal} before the time limit: write "
              f"stop_signal={scheduler_signal}, or leave it out (the launcher sets it)", file=sys.stderr)
        sys.exit(2)


def composed_dump_dir(overrides: list[str]) -> str:
    """dump_dir of the config composed with the overrides (`~` not expanded yet), as the trainer resolves
    it: quoting and interpolations (`${oc.env:SCRATCH}/run`) too. A bad override is train.py's one line."""
    return _composed_dump_dir(tuple(overrides))


@functools.cache  # dump_dir_of and torchrun_args each ask (twice per call at most): compose once
def _composed_dump_dir(overrides: tuple[str, ...]) -> str:
    from hydra import compose, initialize_config_dir

    overrides = list(overrides)
    check_overrides_here(overrides)
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        return str(compose(config_name="config", overrides=overrides).dump_dir)


def launcher_dump_dir_applies(overrides: list[str]) -> bool:
    """Whether a launcher's default dump_dir (dump/slurm-<job id>, ...) replaces config.yaml's own: only
    where nothing else sets it, neither an override nor a config the overrides pick (experiment=cpu_demo),
    so a launched run writes (and resumes) where a plain torchrun run would."""
    from omegaconf import OmegaConf

    if "dump_dir" in override_keys(overrides):
        return False
    return composed_dump_dir(overrides) == OmegaConf.load(REPO / "conf" / "config.yaml").dump_dir


def dump_dir_of(overrides: list[str], default: str | None) -> str:
    """Where the run writes, as the trainer will see it: the launcher's `default` where it applies
    (launcher_dump_dir_applies), else the dump_dir of the config composed with the overrides."""
    applies = default is not None and launcher_dump_dir_applies(overrides)
    return os.path.expanduser(default if applies else composed_dump_dir(overrides))  # `~` as the trainer


def hydra_quoted(value: str) -> str:
    """`value` as one hydra override value, whatever it holds (spaces, commas, brackets, quotes)."""
    return "'" + value.replace("'", "\\'") + "'"


def free_port() -> int:
    """A port free on this machine now, for a one-node rendezvous that must not meet another job's."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nnodes", type=positive_int, required=True)
    parser.add_argument("--nproc-per-node", type=node_ranks, required=True, help='a count, or "gpu": one per GPU of the node')
    parser.add_argument("--rdzv-endpoint", required=True)
    parser.add_argument("--rdzv-id", required=True)
    parser.add_argument("--dump-dir")
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--max-restarts", type=count, default=0)
    parser.add_argument("--hosts-rendezvous", choices=("true", "false"), help="default: torch's guess")
    parser.add_argument("overrides", nargs="*")
    opts = parser.parse_args()
    hosts = None if opts.hosts_rendezvous is None else opts.hosts_rendezvous == "true"
    check_stop_signal(opts.overrides, DEFAULT_STOP_SIGNAL)
    world = opts.nnodes * opts.nproc_per_node if isinstance(opts.nproc_per_node, int) else None
    check_values_here(opts.overrides, world)
    argv = torchrun_args(opts.nnodes, opts.nproc_per_node, opts.rdzv_endpoint, opts.rdzv_id, opts.overrides,
                         opts.dump_dir, opts.python, max_restarts=opts.max_restarts, hosts_rendezvous=hosts)
    print(shlex.join(argv))


if __name__ == "__main__":
    main()
