"""checkpoint.async_save=true writes the same files as a synchronous save, and resumes the same; a run
that halts while a save is in flight completes that save first."""

import json
from pathlib import Path

from scripts.bench.checkpoint import stalls_per_save
from tests.e2e.conftest import CHECKPOINTED_RUN
from tests.e2e.launch import metrics, train
from trainer.checkpoint.dcp_io import SafeFileSystemReader

RUN = (*CHECKPOINTED_RUN, "checkpoint.async_save=true")


def shard_files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.glob("*.distcp")}


def test_async_save_writes_what_a_synchronous_save_writes(tmp_path, checkpointed_run):
    sync, background = checkpointed_run, tmp_path / "async"
    # Every rank stops as step 3 begins (an agreed nan_policy=halt), step 2's save still in flight:
    # nothing polled it yet, so only the halt's own wait can complete it.
    first = train(2, background, *RUN, fault="halt:3:all")
    assert first.returncode != 0 and "non-finite gradient (faulty_train)" in first.stderr, first.stderr[-3000:]
    assert (background / "checkpoints" / "step_2" / "manifest.json").is_file(), first.stdout + first.stderr[-3000:]
    resumed = train(2, background, *RUN)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout + resumed.stderr

    stalls = stalls_per_save(resumed.stdout + resumed.stderr)
    # Steps 4 and 6, each reported in two parts (its start, its completion), as the benchmark reads them.
    assert sorted(stalls) == [4, 6] and all(len(parts) == 2 for parts in stalls.values()), resumed.stderr[-2000:]
    print(f"async save: the step loop stalled {stalls} s (start, completion)")

    numbers = [[(r["step"], r["loss"], r["grad_norm"]) for r in metrics(d)] for d in (background, sync)]
    assert numbers[0] == numbers[1]
    for step in (2, 4, 6):
        ours, theirs = (d / "checkpoints" / f"step_{step}" for d in (background, sync))
        assert shard_files(ours) == shard_files(theirs) and shard_files(ours), step
        assert SafeFileSystemReader(ours).read_metadata().state_dict_metadata == \
            SafeFileSystemReader(theirs).read_metadata().state_dict_metadata
        listed = [{k: v for k, v in json.loads((d / "manifest.json").read_text())["files"].items() if "distcp" in k}
                  for d in (ours, theirs)]
        assert listed[0] == listed[1] and listed[0].keys() == shard_files(ours).keys()
