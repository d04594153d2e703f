"""A TorchX component for the trainer, so a TorchX scheduler (local_cwd on a workstation, slurm, MAST
where available) launches it the same way as scripts/slurm/train.sbatch:

    torchx run --scheduler local_cwd scripts/torchx_components.py:train --nnodes 1 --nproc_per_node 2 -- model=tiny

Run it from the repository (TorchX executes this file outside its folder, so the checkout is found
from the working directory). One role, one replica per node, torchrun as the entrypoint with the same
command line as the other launchers (scripts/launch_command.py). Several nodes need the rendezvous
host named (`--rdzv_endpoint HOST:PORT`, a host every node reaches). Importable without TorchX
installed; building the AppDef then says how to install it.
"""

import sys
from pathlib import Path
from typing import Optional

# TorchX runs this file with its own globals (__file__ is then TorchX's finder): fall back to the
# working directory, the repository the command is documented to run from.
_HERE = Path(__file__).resolve().parents[1]
REPO = _HERE if (_HERE / "scripts" / "launch_command.py").is_file() else Path.cwd()
sys.path.insert(0, str(REPO))

from scripts.launch_command import ranks_per_node, torchrun_args  # noqa: E402

try:
    from torchx import specs
    from torchx.specs import AppDef
except ImportError:  # the component stays importable; train() explains
    specs = AppDef = None


def train(*overrides: str, nnodes: int = 1, nproc_per_node: int = 0, rdzv_endpoint: Optional[str] = None,
          rdzv_id: Optional[str] = None, gpus_per_node: int = 0, image: str = ".", python: str = "python",
          dump_dir: Optional[str] = None, max_restarts: int = 0, mem_gb: int = 0) -> AppDef:
    """The trainer as a TorchX app: `overrides` are hydra overrides (model=small steps=1000 ...); ranks per
    node: `nproc_per_node`, else (0) one per GPU (`gpus_per_node`), else 1, as the other launchers;
    `dump_dir`: the folder where the config leaves dump_dir at its default (dump/torchx-<app id> if not
    given); `mem_gb`: host memory per node the scheduler reserves (Slurm's --mem), 0 for its default (a
    fixed guess would be too small for one rank per GPU, or for checkpoint.async_save's host copy)."""
    if specs is None:
        raise ImportError("scripts/torchx_components.py needs TorchX: pip install torchx")
    for name, value, least in (("nnodes", nnodes, 1), ("nproc_per_node", nproc_per_node, 0),
                               ("gpus_per_node", gpus_per_node, 0), ("mem_gb", mem_gb, 0),
                               ("max_restarts", max_restarts, 0)):
        if value < least:  # a negative count reached the scheduler's resource request (memMB=-3072)
            raise ValueError(f"--{name} {value}: must be at least {least}")
    if rdzv_endpoint is None:
        if nnodes > 1:
            raise ValueError(f"--nnodes {nnodes} needs --rdzv_endpoint HOST:PORT on a host every node reaches "
                             "(each node would otherwise host its own rendezvous on localhost)")
        rdzv_endpoint = "localhost:29500"
    run_id = rdzv_id or specs.macros.app_id
    nproc_per_node = ranks_per_node(nproc_per_node or None, gpus_per_node)
    # One node hosts its own rendezvous: said, so that a port another job holds fails at once instead
    # of joining that job's rendezvous. Several nodes run one command: torch tells the host by its name.
    python_cmd, *args = torchrun_args(nnodes, nproc_per_node, rdzv_endpoint, run_id, list(overrides),
                                      dump_dir or f"dump/torchx-{run_id}", python, max_restarts=max_restarts,
                                      hosts_rendezvous=True if nnodes == 1 else None)
    role = specs.Role(
        name="trainer", image=image, entrypoint=python_cmd, args=args, num_replicas=nnodes,
        resource=specs.Resource(cpu=max(nproc_per_node, 1), gpu=gpus_per_node, memMB=mem_gb * 1024),
    )
    return specs.AppDef(name="llm-train", roles=[role])
