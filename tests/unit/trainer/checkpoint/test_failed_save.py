"""A save that fails on a full disk removes what it wrote (its hidden folder), whichever step failed,
synchronous or asynchronous, and says so in one line: the next attempt finds the space it had."""

import errno
from functools import cache

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter

from trainer.checkpoint import files
from trainer.checkpoint.async_save import AsyncCheckpointer
from trainer.checkpoint.files import CheckpointError, latest_checkpoint, save_checkpoint

ZIP_WRITER = "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"


def state(seed: int) -> dict:
    return {"model": {"w": torch.randn(4, 3, generator=torch.Generator().manual_seed(seed))}}


def short_write(monkeypatch, error: BaseException) -> None:
    """DCP's write of the shards leaves a partial file behind, then fails as on a full disk."""
    def full_disk(self, plan, planner):
        (self.path / "__0_0.distcp").write_bytes(b"x" * 100)
        raise error

    monkeypatch.setattr(FileSystemWriter, "write_data", full_disk)


def hidden_folders(root) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("."))


@pytest.mark.parametrize("error, cause", [
    (OSError(errno.ENOSPC, "No space left on device"), r"\[Errno 28\] No space left on device"),
    (RuntimeError(ZIP_WRITER), r"No space left on device, or a quota reached \(\d+ bytes free there\): "
                               r"torch.save's write came up short \(.*unexpected pos 704 vs 598\)"),
])
def test_a_failed_shard_write_is_one_line_and_leaves_no_hidden_folder(tmp_path, world, monkeypatch, error, cause):
    save_checkpoint(tmp_path, 1, state(1), world, rank=0, extra_files={})
    short_write(monkeypatch, error)
    with pytest.raises(CheckpointError, match=f"checkpoint save into {tmp_path}/.tmp_step_2 failed: .*{cause}") as e:
        save_checkpoint(tmp_path, 2, state(2), world, rank=0, extra_files={})
    assert "\n" not in str(e.value)
    assert hidden_folders(tmp_path) == [] and latest_checkpoint(tmp_path) == tmp_path / "step_1"


def test_failed_extra_files_or_rename_leave_no_hidden_folder(tmp_path, world, monkeypatch):
    extra = tmp_path.parent / "config.json"
    extra.write_text("{}")

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    for owner, name in ((files.shutil, "copyfile"), (files.os, "replace")):
        with monkeypatch.context() as patch:
            patch.setattr(owner, name, full_disk)
            with pytest.raises(CheckpointError, match=r"could not be completed: \[Errno 28\] No space left"):
                save_checkpoint(tmp_path, 1, state(1), world, rank=0, extra_files={"config.json": extra})
        assert not tmp_path.joinpath("step_1").exists() and hidden_folders(tmp_path) == [], name
    assert save_checkpoint(tmp_path, 1, state(1), world, rank=0, extra_files={"config.json": extra}).is_dir()


def test_a_failed_background_write_leaves_no_hidden_folder(tmp_path, world, monkeypatch):
    saver = AsyncCheckpointer(tmp_path, world, cache(lambda: dist.new_group(backend="gloo")), 0, keep=1,
                              extra_files={}, log=lambda line: None, device=torch.device("cpu"))
    saver.save(1, state(1))
    saver.wait()
    short_write(monkeypatch, RuntimeError(ZIP_WRITER))
    saver.save(2, state(2))
    with pytest.raises(CheckpointError, match="step 2 failed: checkpoint save into .*No space left on device") as e:
        saver.wait()
    assert "\n" not in str(e.value)
    assert hidden_folders(tmp_path) == [] and latest_checkpoint(tmp_path) == tmp_path / "step_1"
