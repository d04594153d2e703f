"""Where this process sits in the job, read from torchrun's environment variables.

Without torch: the launchers read it (through train.py's override check) before any job starts.
"""

import os
import socket
import time
from dataclasses import dataclass

AGENT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"  # torchrun's default TORCHELASTIC_SIGNALS_TO_HANDLE


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job, from torchrun's variables (a lone process is rank 0 of 1)."""

    rank: int
    local_rank: int
    world_size: int
    torchrun: bool
    run_id: str  # torchrun's rendezvous run id (unique for a lone process): names the job (lock, metrics)
    # How many times torchrun has restarted the worker group (--max-restarts): this node's agent's count,
    # until init_process_group returns the one every rank agrees on (parallel/attempt.py).
    restart_count: int = 0
    # This torchrun launch's name, the same in each of its attempts, another in the next launch of the
    # same run id (parallel/attempt.py); set once the process group is up.
    launch_name: str = ""
    # The signals torchrun's agent handles itself (TORCHELASTIC_SIGNALS_TO_HANDLE): it terminates the
    # workers on them. Empty without an agent (no TORCHELASTIC_RUN_ID).
    agent_signals: tuple[str, ...] = ()
    # Whether torchrun's restarts of the group share its rendezvous store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE
    # unset, as by default), which names the launch (parallel/attempt.py).
    shared_store: bool = True

    @classmethod
    def from_torchrun(cls) -> "LaunchEnv":
        env = os.environ
        # All four, as torchrun sets them: a lone process in a shell that exports MASTER_ADDR and
        # MASTER_PORT (for other jobs) would otherwise bind or join that address's store.
        torchrun = all(key in env for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"))
        return cls(
            rank=int(env.get("RANK", 0)),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            world_size=int(env.get("WORLD_SIZE", 1)),
            torchrun=torchrun,
            run_id=_run_id(env),
            restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", 0)),
            agent_signals=tuple(s.strip().removeprefix("SIG") for s in env.get(
                "TORCHELASTIC_SIGNALS_TO_HANDLE", AGENT_SIGNALS).split(",")) if "TORCHELASTIC_RUN_ID" in env else (),
            shared_store=env.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "0") != "1",
        )


def _run_id(env: os._Environ) -> str:
    """torchrun's rendezvous id; a lone process's is unique. A static launch without --rdzv_id gets
    torchrun's default "none", the same for every job: its agent (this worker's parent, the same
    across the agent's restarts of the group) names the job then, as rank 0 sees it (run.py shares
    rank 0's id)."""
    run_id = env.get("TORCHELASTIC_RUN_ID")
    if not run_id:
        return f"local-{os.getpid()}-{time.time_ns()}"
    if run_id == "none":
        return f"none-{socket.gethostname()}-{os.getppid()}"
    return run_id
