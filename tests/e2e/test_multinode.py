"""Two torchrun "nodes" of 2 processes each on this machine, c10d rendezvous over loopback, train the
same as one node of 4 processes, bit for bit."""

import subprocess
import sys

from tests.e2e.launch import DATA_CACHE, ENV, REPO, free_port, losses, metrics, train_ok

RUN = ("model=tiny", "seq_len=64", "steps=4", "batch_size=1", "log_all_steps=true", f"data.cache_dir={DATA_CACHE}")


def test_two_nodes_over_loopback_match_one_node(tmp_path):
    one_node = losses(train_ok(4, tmp_path / "one_node", *RUN[:-1]))
    port, dump = free_port(), tmp_path / "two_nodes"
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=2",
               "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=two-nodes",
               str(REPO / "train.py"), f"dump_dir={dump}", *RUN]
    nodes = [subprocess.Popen(command, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    for node in nodes:
        out, err = node.communicate(timeout=300)
        assert node.returncode == 0, err[-3000:]
    assert losses(metrics(dump)) == one_node
