"""Checkpoint files: atomic completion, verification, and no arbitrary unpickling on load."""

import os
import pickle
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

from trainer.checkpoint.dcp_io import SafeFileSystemReader
from trainer.checkpoint.files import (MANIFEST, CheckpointError, complete_save, latest_checkpoint, load_checkpoint,
                                      own_files, prepare_save, prune_checkpoints, refuse_damaged_newer, save_checkpoint,
                                      verify_checkpoint)
from trainer.checkpoint.state import load_into
from trainer.data.sampler import SPLIT_VERSION
from trainer.data.shuffle import SHUFFLE_VERSION


def state(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(4, 3, generator=gen)}, "trainer": {"step": torch.tensor(seed)}}


def test_round_trip_prune_and_latest(tmp_path, world):
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, state(step), world, rank=0, extra_files={})
    (tmp_path / "step_9").mkdir()  # no manifest: an interrupted copy, not a checkpoint
    (tmp_path / ".tmp_step_10").mkdir()
    (tmp_path / "step_\u00b2").mkdir()  # a superscript two: a digit to str.isdigit(), not to int()
    assert latest_checkpoint(tmp_path) == tmp_path / "step_3"
    prune_checkpoints(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_2", "step_3", "step_9", "step_\u00b2"]
    target = {"model": {"w": torch.zeros(4, 3)}, "trainer": {"step": torch.tensor(0)}}
    verify_checkpoint(tmp_path / "step_3", world, rank=0, world=1, checksums=True)
    load_checkpoint(tmp_path / "step_3", target, world)
    assert torch.equal(target["model"]["w"], state(3)["model"]["w"]) and int(target["trainer"]["step"]) == 3


@pytest.mark.parametrize("saved, line", [
    ({"model": {"w": torch.tensor([1.7, -2.6], dtype=torch.float64)}, "trainer": {"step": torch.tensor(3)}},
     "model.w was saved as torch.float64 and this run holds it as torch.float32"),
    ({"model": {"w": torch.tensor([1.7, -2.6])}, "trainer": {"step": torch.tensor(3.9)}},
     "trainer.step was saved as torch.float32 and this run holds it as torch.int64"),
])
def test_a_tensor_saved_in_another_dtype_is_refused_not_cast(tmp_path, world, saved, line):
    """DCP casts on load: 3.9 would come back as step 3, float64 weights rounded to this run's dtype."""
    path = save_checkpoint(tmp_path, 1, saved, world, rank=0, extra_files={})
    target = {"model": {"w": torch.zeros(2)}, "trainer": {"step": torch.tensor(0)}}
    with pytest.raises(CheckpointError, match=f"cannot be loaded into this run: {line}"):
        load_checkpoint(path, target, world)
    assert not target["model"]["w"].any() and int(target["trainer"]["step"]) == 0


def test_a_kill_while_pruning_leaves_no_folder_that_looks_complete(tmp_path, world, monkeypatch):
    """rmtree may delete the shards before the manifest: the folder is renamed to a hidden name first,
    and the next save clears what the kill left."""
    from trainer.checkpoint import files as checkpoint

    for step in (1, 2):
        save_checkpoint(tmp_path, step, state(step), world, rank=0, extra_files={})
    rmtree = checkpoint.shutil.rmtree

    def killed_midway(path, *args, **kwargs):
        if kwargs.get("ignore_errors"):
            return rmtree(path, *args, **kwargs)
        next(p for p in path.iterdir() if p.name.startswith("__")).unlink()  # a shard goes, the manifest stays
        raise KeyboardInterrupt  # the kill

    monkeypatch.setattr(checkpoint.shutil, "rmtree", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        prune_checkpoints(tmp_path, keep=1)
    monkeypatch.setattr(checkpoint.shutil, "rmtree", rmtree)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".old_step_1", "step_2"]
    assert latest_checkpoint(tmp_path, before=2) is None  # no half-deleted step_1 offered as the previous one
    prepare_save(tmp_path, 3, world, rank=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp_step_3", "step_2"]


def test_a_save_is_on_disk_before_anything_is_pruned(tmp_path, world, monkeypatch):
    """Our own copies (extra files, the manifest) and the folder's entries are synced, and the rename
    into place is synced in the parent before the save returns (pruning follows it)."""
    from trainer.checkpoint import files as checkpoint

    synced: list[str] = []
    fsync = checkpoint.os.fsync

    def recording_fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        fsync(fd)

    monkeypatch.setattr(checkpoint.os, "fsync", recording_fsync)
    save_checkpoint(tmp_path, 1, state(1), world, rank=0, extra_files={"tokenizer.model": b"spm"})
    hidden = str(tmp_path / ".tmp_step_1")
    assert {f"{hidden}/tokenizer.model", f"{hidden}/{MANIFEST}", hidden} <= set(synced)
    assert synced[-1] == str(tmp_path)


def test_a_file_where_a_save_puts_its_hidden_folder_is_cleared(tmp_path, world):
    (tmp_path / ".tmp_step_4").write_text("left by hand")
    (tmp_path / ".tmp_step_7").symlink_to(tmp_path / "nowhere")
    save_checkpoint(tmp_path, 4, state(4), world, rank=0, extra_files={})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_4"]


def test_only_a_manifest_less_folder_the_run_would_overwrite_is_refused(tmp_path):
    for name in ("step_2", "step_5", ".tmp_step_9", "step_x"):  # an older damaged one, a temp, a stray name
        (tmp_path / name).mkdir()
    (tmp_path / "step_4").mkdir()
    (tmp_path / "step_4" / MANIFEST).write_text("{}")
    refuse_damaged_newer(tmp_path, after=5)
    with pytest.raises(CheckpointError, match=r"step_5 has no manifest.json: .* \(resuming from step 4\) would overwrite"):
        refuse_damaged_newer(tmp_path, after=4)
    with pytest.raises(CheckpointError, match=r"step_2 has no manifest.json: .* \(resuming from scratch\)"):
        refuse_damaged_newer(tmp_path, after=0)


def test_manifest_lists_every_file(tmp_path, world):
    path = save_checkpoint(tmp_path, 1, state(1), world, rank=0, extra_files={"notes.txt": _file(tmp_path, "hi")})
    listed = set(__import__("json").loads((path / MANIFEST).read_text())["files"])
    assert listed == {p.name for p in path.iterdir()} - {MANIFEST}


def test_a_save_whose_files_rank_0_cannot_see_is_not_completed(tmp_path, world):
    """On a dump_dir that is not shared (or stale over NFS), another rank's shard may be missing or
    short where rank 0 looks: the save fails there, before a manifest, a rename or any pruning."""
    save_checkpoint(tmp_path, 1, state(1), world, rank=0, extra_files={})
    for written, problem in ((10, "is missing"), (10**6, "is 10 bytes, written as 1000000")):
        tmp = prepare_save(tmp_path, 2, world, rank=0)
        if written != 10:  # a short file where rank 0 looks
            (tmp / "__1_0.distcp").write_bytes(b"x" * 10)
        other = {"size": written, "sha256": ""}
        with pytest.raises(CheckpointError, match=f"rank 0's file __1_0.distcp {problem} .*every rank shares"):
            complete_save(tmp, {**own_files(tmp, 0), "__1_0.distcp": other}, world, rank=0, extra_files={})
        assert not tmp.exists()  # removed: its space is free for the next save
    prune_checkpoints(tmp_path, keep=1)
    assert latest_checkpoint(tmp_path) == tmp_path / "step_1"


def _file(folder, text):
    path = folder / "src.txt"
    path.write_text(text)
    return path


class _Exploit:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_metadata_with_arbitrary_code_is_refused(tmp_path, world):
    path = save_checkpoint(tmp_path, 1, state(1), world, rank=0, extra_files={})
    (path / ".metadata").write_bytes(pickle.dumps(_Exploit()))
    with pytest.raises(pickle.UnpicklingError, match="refusing to load posix.system"):
        SafeFileSystemReader(path).read_metadata()
    target = {"model": {"w": torch.zeros(4, 3)}, "trainer": {"step": torch.tensor(0)}}
    with pytest.raises(CheckpointError, match="cannot be loaded"):
        load_checkpoint(path, target, world)


def test_a_flipped_byte_in_the_metadata_is_found_by_verification_without_checksums(tmp_path, world):
    """With checkpoint.verify_checksums=false sizes alone pass it; reading the metadata must not (a
    damaged pickle raises TypeError, KeyError, MemoryError ... as well as UnpicklingError)."""
    path = save_checkpoint(tmp_path, 1, state(1), world, rank=0, extra_files={})
    original = (path / ".metadata").read_bytes()
    for offset in (7, 10, len(original) // 2):  # the frame length (MemoryError, OverflowError), the body
        data = bytearray(original)
        data[offset] ^= 0x80
        (path / ".metadata").write_bytes(bytes(data))
        with pytest.raises(CheckpointError, match="step_1 has unreadable metadata"):
            verify_checkpoint(path, world, rank=0, world=1, checksums=False)


def test_ranks_that_list_another_newest_checkpoint_refuse_to_resume(tmp_path, world, monkeypatch):
    """Rank 1's listing of the shared folder lags: it would load step 2 while rank 0 loads step 3."""
    from trainer.checkpoint import resume

    for step in (2, 3):
        save_checkpoint(tmp_path, step, state(step), world, rank=0, extra_files={})
    assert resume.newest_checkpoint(tmp_path) == tmp_path / "step_3"
    monkeypatch.setattr(resume.comm, "all_gather_object", lambda obj, group: [obj, 2])
    with pytest.raises(CheckpointError, match=r"^dump_dir: rank 1 sees newest checkpoint step_2 in .*, rank 0 newest "
                                              r"checkpoint step_3; every rank must see the same shared folder"):
        resume.newest_checkpoint(tmp_path)


def run_state(fp8: dict, shuffle_version: int | None = SHUFFLE_VERSION,
              split_version: int | None = SPLIT_VERSION) -> dict:
    versions = {"shuffle_version": shuffle_version, "split_version": split_version}
    trainer = {"step": torch.tensor(3)} | {k: torch.tensor(v) for k, v in versions.items() if v is not None}
    return {"fp8": fp8, "trainer": trainer, "rng": {"rank0": {"shared": torch.zeros(2)}}}


def test_a_checkpoint_of_the_older_shuffle_is_refused(tmp_path, world):
    """Written before the shuffle version was stored: its data order (an argsort per epoch) cannot be
    reproduced, so resuming would silently train on other sequences."""
    old = run_state({}, shuffle_version=None, split_version=None)
    path = save_checkpoint(tmp_path, 3, old, world, rank=0, extra_files={})
    with pytest.raises(CheckpointError, match="shuffled the data another way .shuffle_version 1.; resuming would "
                                              "change the data order"):
        load_into(path, run_state({}), rng=None, sampler=None, group=world)
    newer = run_state({})
    newer["trainer"]["epoch_offset"] = torch.tensor(0)  # a key this checkpoint's trainer did not write
    path = save_checkpoint(tmp_path / "v2", 3, run_state({}), world, rank=0, extra_files={})
    with pytest.raises(CheckpointError, match="lacks trainer.epoch_offset: another trainer version wrote it"):
        load_into(path, newer, rng=None, sampler=None, group=world)


def test_a_checkpoint_of_the_older_held_out_split_is_refused(tmp_path, world):
    """Written before the split was counted in tokens: it trained on another number of windows, which the
    sampler's num_sequences check would blame on data.source, seq_len or data.held_out_fraction."""
    path = save_checkpoint(tmp_path, 3, run_state({}, split_version=None), world, rank=0, extra_files={})
    with pytest.raises(CheckpointError, match=r"held out the last fraction of seq_len windows, not of tokens "
                                              r"\(split_version 1\).*resuming would change the data order: finish the "
                                              r"run with that version, or start it over in a new dump_dir"):
        load_into(path, run_state({}), rng=None, sampler=None, group=world)


def test_fp8_state_of_the_other_implementation_is_one_clear_error(tmp_path, world):
    """A checkpoint with in-tree fp8 state resumed by TE blocks (model.use_te_layers switched, allowed):
    refused naming the switch, not DCP's missing-key dump and not a silent fresh start."""
    path = save_checkpoint(tmp_path, 3, run_state({"layers.0.attention.wqkv.fp8.scale": torch.ones(3)}), world,
                           rank=0, extra_files={})
    te_state = run_state({"layers.0.attention.wqkv.scaling_fwd.scale": torch.ones(3)})
    with pytest.raises(CheckpointError, match="saved with the other fp8 implementation .model.use_te_layers."):
        load_into(path, te_state, rng=None, sampler=None, group=world)


def test_fp8_state_saved_before_scale_flags_existed_loads_with_every_scale_set(tmp_path, world):
    """Such a checkpoint's scales were all in use: the resume keeps using them (no current-amax scaling)."""
    gemm = "layers.0.attention.wqkv.gemm"
    path = save_checkpoint(tmp_path, 3, run_state({f"{gemm}.scale": torch.full((3,), 2.0)}), world, rank=0,
                           extra_files={})
    flags, scale = torch.zeros(3, dtype=torch.bool), torch.ones(3)
    current = run_state({f"{gemm}.scale": scale, f"{gemm}.scale_is_set": flags})
    ignore = SimpleNamespace(load_state=lambda state: None, check_resumable=lambda state: None)
    assert load_into(path, current, rng=ignore, sampler=ignore, group=world) == 3
    assert flags.all() and torch.equal(scale, torch.full((3,), 2.0))


def test_a_tensor_whose_saved_boxes_leave_a_gap_is_refused(tmp_path, world):
    """DCP fills only what a tensor's saved chunks cover and leaves the rest of the target as it was: a save
    in which no rank wrote some box of a parameter would load as a silently stale parameter."""
    path = save_checkpoint(tmp_path, 1, state(1), world, rank=0, extra_files={})
    metadata = SafeFileSystemReader(path).read_metadata()
    whole = metadata.state_dict_metadata["model.w"].chunks[0]
    metadata.state_dict_metadata["model.w"].chunks = [
        ChunkStorageMetadata(offsets=whole.offsets, sizes=torch.Size([2, 3]))]  # rows 2-3 unwritten
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    target = {"model": {"w": torch.zeros(4, 3)}, "trainer": {"step": torch.tensor(0)}}
    with pytest.raises(CheckpointError, match=r"cannot be loaded into this run: model.w of shape \[4, 3\] was saved "
                                              r"as 6 of its 12 elements \(no rank wrote the rest\)$"):
        load_checkpoint(path, target, world)
    assert not target["model"]["w"].any()


def test_a_file_of_the_wrong_size_is_named_truncated_or_changed(tmp_path, world):
    path = save_checkpoint(tmp_path, 1, state(1), world, rank=0, extra_files={"notes.txt": b"saved"})
    for text, how in (("sav", "is truncated: notes.txt has 3 bytes, expected 5"),
                      ("saved, then edited", "is changed since it was saved: notes.txt has 18 bytes, expected 5")):
        (path / "notes.txt").write_text(text)
        with pytest.raises(CheckpointError, match=f"^checkpoint {path} {how}$"):
            verify_checkpoint(path, world, rank=0, world=1, checksums=False)
