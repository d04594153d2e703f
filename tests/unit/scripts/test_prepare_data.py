"""scripts/prepare_data.py refuses bad input as train.py does: one `error:` line, exit code 2, nothing built.
(tests/e2e/test_prepare_data.py runs it before a job.)"""

import pytest

from scripts.prepare_data import main


def test_a_bad_source_or_override_is_one_error_line(tmp_path, capsys) -> None:
    cache = tmp_path / "cache"
    lone = tmp_path / "corpus.bin"
    lone.write_bytes(b"\x00" * 16)
    assert main([f"data.source={lone}", f"data.cache_dir={cache}", f"dump_dir={tmp_path / 'd'}"]) == 2
    assert main([f"data.cache_dir={cache}", "data.prepare_workers=0", f"dump_dir={tmp_path / 'd'}"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"error: data.source={lone} has no corpus.idx beside it: a Megatron indexed dataset is the "
                     "pair PREFIX.bin and PREFIX.idx",
                     "error: data.prepare_workers=0 must be > 0 (or null)"]
    assert not cache.exists()


def test_a_flag_it_does_not_take_is_one_error_line(tmp_path, capsys) -> None:
    """Hydra's flags mean nothing here: one line, not the override parser's traceback."""
    with pytest.raises(SystemExit) as stopped:
        main([f"data.cache_dir={tmp_path / 'cache'}", "--foo"])
    assert stopped.value.code == 2
    assert capsys.readouterr().err == "error: --foo is neither an override (key=value) nor one of this command's flags\n"
    assert not (tmp_path / "cache").exists()
