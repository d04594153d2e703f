"""Bad input exits non-zero with one clear line naming the key, never hangs, never harms a checkpoint."""

import hashlib
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

from tests.e2e.launch import ENV, REPO, assert_one_error, command, metrics, train, train_ok

FAST = ("model=tiny", "seq_len=64", "batch_size=2")


# Each rule of validate() is checked in-process by tests/unit/test_config.py; here one of them shows that
# the CLI prints it as one line, beside what only the CLI path meets (data, hydra, types, interpolation).
@pytest.mark.parametrize(
    "overrides, fragments",
    [
        (("model_parallel_size=3",), ("model.n_heads=4", "model_parallel_size=3")),
        (("data.source=/no/such/corpus",), ("data.source=/no/such/corpus", "does not exist")),
        (("steps=many",), ("steps='many'", "int")),
        (("data.source=[stdlib,/no/such/corpus]", "data.weights=[1,2,3]"),
         ("data.weights has 3 weights for the 2 sources of data.source",)),
        (("eval.freq=2", "eval.steps=100000"), ("eval.steps=100000", "held-out sequences", "data.held_out_fraction")),
        (("optimm.lr=1e-3",), ("error: optimm.lr is not a known config key (did you mean optim.lr?)",)),
        (("hydra.job.nme=x",), ("Could not override 'hydra.job.nme'", "+hydra.job.nme=x")),  # hydra's, in one line
        (("model=nope",), ("model/nope", "small | tiny")),
        (("seq_len",), ("seq_len", "missing EQUAL")),
        (("hydra/launcher=torchrun", "hydra.launcher.nproc_per_node=2"),
         ("hydra/launcher=torchrun picks how a sweep (-m) launches its points; without -m it changes nothing",)),
        (("~steps",), ("~steps: deleting a config key is not supported; set its value instead",)),
        (("data=null",), ("error: data=null: Config group override must be a string or a list",)),
        (("optim=3",), ("error: optim=3: Config group override must be a string or a list",)),
        (("seed=${oc.env:NO_SUCH_VARIABLE}",), ("seed: ", "Environment variable 'NO_SUCH_VARIABLE' not found")),
    ],
)
def test_bad_config_one_line(tmp_path, overrides, fragments):
    dump = tmp_path / "dump"
    proc = train(0, dump, *FAST, *overrides, cwd=tmp_path, timeout=60)
    assert_one_error(proc, *fragments)
    assert proc.returncode == 2  # bad input (docs/outputs.md's exit codes)
    assert not (dump / "metrics.jsonl").exists()


def test_a_stop_signal_torchruns_agent_takes_is_refused(tmp_path):
    """torchrun's agent handles SIGHUP itself (it terminates the workers, mid-step, no checkpoint)."""
    proc = train(1, tmp_path / "dump", *FAST, "stop_signal=HUP", timeout=120)
    assert_one_error(proc, "stop_signal=HUP: torchrun's agent takes SIGHUP itself", "use USR1 or USR2")


def test_world_size_not_divisible(tmp_path):
    proc = train(2, tmp_path / "dump", *FAST, "dp_replicate=3", timeout=120)
    assert_one_error(proc, "world size 2", "dp_replicate=3")


def test_ranks_that_resolve_another_config_are_refused_before_anything_is_written(tmp_path):
    """A value resolved in each process (here the time, to the microsecond) differs between ranks: they
    would each train into a folder of their own."""
    proc = train(2, tmp_path / "dump", *FAST, f"dump_dir={tmp_path}/run_${{now:%H%M%S%f}}", timeout=120)
    assert_one_error(proc, "dump_dir: rank 1 resolved", "every rank must run the same overrides",
                     "such as ${now:...}")
    assert not list(tmp_path.glob("run_*/metrics.jsonl")) and not list(tmp_path.glob("run_*/.lock"))


def test_ranks_launched_with_other_parallel_sizes_are_refused_not_left_waiting(tmp_path):
    """A node started with other overrides (here rank 1 alone gets model_parallel_size=2) would build
    other process groups and wait in them until comm_timeout_s: the config check comes first."""
    wrapper = tmp_path / "rank1_differs.py"
    wrapper.write_text(
        "import os, runpy, sys\n"
        "extra = ['model_parallel_size=2'] if os.environ['RANK'] == '1' else []\n"
        f"sys.argv = [{str(REPO / 'train.py')!r}, *sys.argv[1:], *extra]\n"
        f"runpy.run_path({str(REPO / 'train.py')!r}, run_name='__main__')\n")
    argv = command(2, tmp_path / "dump", *FAST, "model.n_kv_heads=4")
    argv[argv.index(str(REPO / "train.py"))] = str(wrapper)
    proc = subprocess.run(argv, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120)
    assert_one_error(proc, "model_parallel_size: rank 1 resolved 2, rank 0 1", "every rank must run the same overrides")
    assert not (tmp_path / "dump" / "metrics.jsonl").exists()


def test_hydra_writes_nothing_outside_dump_dir(tmp_path):
    train_ok(0, tmp_path / "dump", *FAST, "steps=1", cwd=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dump"]


@pytest.fixture(scope="module")
def two_step_checkpoint(tmp_path_factory):
    dump = tmp_path_factory.mktemp("ckpt") / "dump"
    train_ok(0, dump, *FAST, "steps=2", "checkpoint.freq=2")
    return dump


def _digests(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("damage, fragment", [("truncate", "is truncated"), ("flip", "is corrupt"),
                                              ("fingerprint", "fingerprint.json fails its sha256 check")])
def test_damaged_checkpoint_is_refused_and_left_alone(tmp_path, two_step_checkpoint, damage, fragment):
    """Named as damage, never as a changed run: a fingerprint.json altered in place (still valid JSON)
    must not read as another seed."""
    dump = tmp_path / "dump"
    shutil.copytree(two_step_checkpoint, dump)
    step_dir = dump / "checkpoints" / "step_2"
    shard = next(step_dir.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    if damage == "truncate":
        shard.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(data)
    else:
        fingerprint = step_dir / "fingerprint.json"
        fingerprint.write_text(fingerprint.read_text().replace('"seed": 0', '"seed": 1'))
    before = _digests(step_dir)
    proc = train(0, dump, *FAST, "steps=2", "checkpoint.freq=2", timeout=60)  # the config of the run saved
    assert_one_error(proc, "checkpoint", str(step_dir), fragment)
    assert _digests(step_dir) == before
    assert sorted(p.name for p in (dump / "checkpoints").iterdir()) == ["step_2"]


@pytest.mark.parametrize(
    "override, fragments",
    [("model.dim=128", ("would change the run", "model.dim 64 -> 128")),
     ("seed=1", ("would change the run", "seed 0 -> 1"))],
)
def test_checkpoint_of_another_run_is_refused(tmp_path, two_step_checkpoint, override, fragments):
    dump = tmp_path / "dump"
    shutil.copytree(two_step_checkpoint, dump)
    proc = train(0, dump, *FAST, override, "steps=3", timeout=60)
    assert_one_error(proc, *fragments)


def test_divergence_stops_with_one_line(tmp_path):
    """A non-finite gradient norm stops every rank before the update, the workers exit 3 (divergence: a
    restart would diverge again); the metrics file stays valid JSON."""
    dump = tmp_path / "dump"
    proc = train(2, dump, *FAST, "steps=3", "optim.lr=1e30", "optim.weight_decay=0", "optim.warmup_steps=0",
                 "log_all_steps=true", timeout=120)
    assert_one_error(proc, "step 2: loss", "gradient norm nan", "first non-finite gradient is in unit tok_embeddings")
    assert "exitcode  : 3 " in proc.stderr, proc.stderr[-3000:]
    assert [r["step"] for r in metrics(dump)] == [1]


def test_an_error_on_one_rank_is_one_line_with_its_rank_and_the_root_cause(tmp_path):
    """Rank 1 alone fails (it gives up waiting for rank 0's data preparation): its line names it, the
    job exits non-zero without hanging, and torchrun's summary carries the traceback (@record)."""
    corpus = Path(sysconfig.get_paths()["stdlib"]) / "email"  # a second or so of tokenizer training
    proc = train(2, tmp_path / "dump", f"data.source={corpus}", f"data.cache_dir={tmp_path / 'cache'}",
                 "data.prepare_timeout_s=0.001", "model.vocab_size=512", "seq_len=16", "steps=2", timeout=120)
    assert_one_error(proc, "rank 1: TimeoutError", "did not finish", "within data.prepare_timeout_s=0.001 s")
    root_cause = proc.stderr[proc.stderr.index("Root Cause"):]
    assert "rank      : 1" in root_cause and "in train_or_exit" in root_cause
