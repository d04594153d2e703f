"""What a run started from a Hugging Face folder carries of it from checkpoint to checkpoint, and what an
export takes from that."""

import json
from pathlib import Path

from trainer.checkpoint.hf_origin import ORIGIN_FILE, exported_eos, origin_config_bytes, read_origin_config


def test_the_resumed_checkpoints_copy_wins_over_the_folder_which_may_be_gone(tmp_path: Path) -> None:
    folder, ckpt, old = tmp_path / "hf", tmp_path / "step_3", tmp_path / "step_1"
    for path in (folder, ckpt, old):
        path.mkdir()
    (folder / "config.json").write_text('{"vocab_size": 600}')
    (ckpt / ORIGIN_FILE).write_text('{"vocab_size": 500}')
    assert origin_config_bytes(str(folder), None) == b'{"vocab_size": 600}'  # the run's start
    assert origin_config_bytes(str(folder), ckpt) == b'{"vocab_size": 500}'
    assert origin_config_bytes(None, ckpt) == b'{"vocab_size": 500}'  # a resume that dropped the key
    assert origin_config_bytes(str(tmp_path / "gone"), ckpt) == b'{"vocab_size": 500}'
    assert origin_config_bytes(str(folder), old) == b'{"vocab_size": 600}'  # saved before checkpoints carried it
    assert origin_config_bytes(None, old) is None and origin_config_bytes(None, None) is None
    assert read_origin_config(ckpt) == {"vocab_size": 500} and read_origin_config(old) is None


def test_an_instruct_folders_eos_list_is_exported_as_it_came() -> None:
    instruct = json.loads('{"eos_token_id": [128001, 128008, 128009]}')
    assert exported_eos(instruct, 128009) == [128001, 128008, 128009]
    assert exported_eos({"eos_token_id": 128001}, 128001) == 128001
    assert exported_eos({"eos_token_id": [5, 6]}, 7) == 7  # a list without the tokenizer's eos: the tokenizer's
    assert exported_eos(None, 2) == 2
