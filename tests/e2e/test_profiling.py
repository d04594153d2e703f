"""profile_freq + dump_profile_traces: one Chrome trace per rank for the profiled step, holding the named
communication ranges (op, group, FSDP unit or pipeline actions) and the pipeline's compute ranges."""

import json

from tests.e2e.launch import metrics, train, train_ok


def test_profiled_step_writes_one_trace_per_rank_with_named_communication(tmp_path):
    dump = tmp_path / "run"
    train_ok(4, dump, "model=tiny", "seq_len=32", "steps=2", "batch_size=2", "pipeline_parallel_size=2",
             "profile_freq=2", "dump_profile_traces=true")
    folder = dump / "profile_traces" / "step_2"
    assert sorted(p.name for p in folder.iterdir()) == [f"rank{r}.json" for r in range(4)]
    assert not (dump / "profile_traces" / "step_1").exists()
    for rank in range(4):
        names = {e["name"] for e in json.loads((folder / f"rank{rank}.json").read_text())["traceEvents"]
                 if e.get("ph") == "X"}
        pp_rank = rank // 2  # tp=1: pp varies slowest, over the 2 data-parallel ranks
        unit = "tok_embeddings" if pp_rank == 0 else "head"
        assert f"all_gather dp_shard_cp {unit}" in names and f"reduce_scatter dp_shard_cp {unit}" in names
        assert f"r{pp_rank} F c0 m1" in names and f"r{pp_rank} B c0 m1" in names
        sends = [n for n in names if n.startswith("send_recv pp ")]
        assert any(f"r{pp_rank} SEND_{'F' if pp_rank == 0 else 'B'} c0 m0" in n for n in sends), sends


def test_the_printed_table_lists_operators_not_python_frames(tmp_path):
    """With profile_with_stack, every thread's Python frames are recorded; the dump_dir lock's idle
    heartbeat thread would otherwise top rank 0's table of operators. The profiled step's record says
    it was profiled (its times include the profiler's overhead); the others do not."""
    proc = train(1, tmp_path / "run", "model=tiny", "seq_len=32", "steps=3", "batch_size=2", "profile_freq=2",
                 "profile_with_stack=true", "log_all_steps=true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r.get("profiled") for r in metrics(tmp_path / "run")] == [None, True, None]
    table = proc.stderr.split("profile of step 2 (rank 0):")[1]
    rows = [line for line in table.splitlines() if "%" in line]
    assert rows and all(".py(" not in row for row in rows), rows
    assert any("aten::" in row for row in rows)
    assert "Input Shapes" in table  # what profile_with_stack adds to the table: calls told apart by shape
