"""A TorchX component for the trainer, so a TorchX scheduler (local_cwd on a workstation, slurm, MAST
where available) launches it the same way as scripts/slurm/train.sbatch:

    torchx run --scheduler local_cwd scripts/torchx_components.py:train --nnodes 1 --nproc_per_node 2 -- model=tiny

One role, one replica per node, torchrun as the entrypoint with the same command line as the other
launchers (scripts/launch_command.py). Importable without TorchX installed; building the AppDef then
says how to install it.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.launch_command import torchrun_args  # noqa: E402

try:
    from torchx import specs
except ImportError:  # the component stays importable; train() explains
    specs = None


def train(*overrides: str, nnodes: int = 1, nproc_per_node: int = 1, rdzv_endpoint: str = "localhost:29500",
          rdzv_id: str | None = None, gpus_per_node: int = 0, image: str = ".", python: str = "python",
          dump_dir: str | None = None) -> "specs.AppDef":
    """The trainer as a TorchX app: `overrides` are hydra overrides (model=small steps=1000 ...)."""
    if specs is None:
        raise ImportError("scripts/torchx_components.py needs TorchX: pip install torchx")
    run_id = rdzv_id or specs.macros.app_id
    python_cmd, *args = torchrun_args(nnodes, nproc_per_node, rdzv_endpoint, run_id, list(overrides),
                                      dump_dir or f"dump/torchx-{run_id}", python)
    role = specs.Role(
        name="trainer", image=image, entrypoint=python_cmd, args=args, num_replicas=nnodes,
        resource=specs.Resource(cpu=max(nproc_per_node, 1), gpu=gpus_per_node, memMB=16 * 1024),
    )
    return specs.AppDef(name="llm-train", roles=[role])
