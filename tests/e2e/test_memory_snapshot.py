"""mem_snapshot_stop_step on CPU: a notice (also when a resumed job starts past it), and per rank the live tensor bytes by category at the peak;
activations follow the microbatch size, the optimizer state is Adam's two fp32 moments per shard."""

import json

from tests.e2e.launch import train

TINY = ("model=tiny", "seq_len=64", "steps=3", "mem_snapshot_stop_step=2")


def _breakdown(dump_dir, rank: int) -> dict:
    report = json.loads((dump_dir / "memory_snapshots" / f"rank{rank}_live_bytes.json").read_text())
    assert report["last_step"] == 2 and report["peak_step"] in (1, 2)
    return report["peak_bytes"]


def test_cpu_memory_breakdown_per_rank(tmp_path):
    peaks = {}
    for microbatch in (1, 2):
        dump = tmp_path / f"mb{microbatch}"
        proc = train(0, dump, *TINY, "batch_size=2", f"microbatch_size={microbatch}", "checkpoint.freq=3")
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stderr.count("notice: mem_snapshot_stop_step on CPU") == 1
        peaks[microbatch] = _breakdown(dump, 0)
    # A job resumed past the stop step records nothing, and says so.
    proc = train(0, dump, *TINY[:-2], "steps=4", "mem_snapshot_stop_step=2", "batch_size=2", "microbatch_size=2",
                 "checkpoint.freq=3", "resume.allow_changed=[optim.decay_steps]")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "mem_snapshot_stop_step=2 is not past the resumed step 3: nothing is recorded" in proc.stderr
    assert "notice: mem_snapshot_stop_step on CPU" not in proc.stderr
    one, two = peaks[1], peaks[2]
    for peak in (one, two):
        assert peak["total"] == sum(v for k, v in peak.items() if k != "total")
        assert peak["parameters"] > 0 and peak["activations"] > 0
    assert one["optimizer_state"] == two["optimizer_state"]
    assert 1.6 < two["activations"] / one["activations"] < 2.4, (one, two)

    dump = tmp_path / "dp2"
    proc = train(2, dump, *TINY, "batch_size=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [_breakdown(dump, r) for r in range(2)]
    # Sharded over two ranks: each holds about half the optimizer state of one process.
    for peak in ranks:
        assert abs(peak["optimizer_state"] / one["optimizer_state"] - 0.5) < 0.01, (peak, one)
