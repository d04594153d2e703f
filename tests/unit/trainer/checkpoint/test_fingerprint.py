"""The resume fingerprint: which changes a resume refuses, which it lets the user allow, and how it says so."""

import json

import pytest

from parallel.errors import ConfigError
from trainer.checkpoint.fingerprint import check_resumable, run_fingerprint
from trainer.config.schema import from_dict
from trainer.data.shards import data_fingerprint
from trainer.outputs import FINGERPRINT_FILE

DATA = {"data_sha256": "h" * 16, "data": "d" * 16, "data_sample": "s" * 16}


def _fingerprint(**model) -> dict:
    cfg = from_dict({"model": {"name": "tiny", **model}})
    return run_fingerprint(cfg, "float32", 8, "a" * 64, DATA)


def _saved(tmp_path, fingerprint: dict, drop: tuple[str, ...] = ()):
    (tmp_path / FINGERPRINT_FILE).write_text(json.dumps({k: v for k, v in fingerprint.items() if k not in drop}))
    return tmp_path


def test_kernel_switches_are_named_and_allowable(tmp_path):
    saved = _saved(tmp_path, _fingerprint())
    with pytest.raises(ConfigError) as err:
        check_resumable(saved, _fingerprint(efficient_attn="math"), allowed=[])
    assert "model.efficient_attn 'sdpa' -> 'math'" in str(err.value)
    assert "resume.allow_changed=[model.efficient_attn]" in str(err.value)
    assert check_resumable(saved, _fingerprint(use_te_layers=True), allowed=["model.use_te_layers"]) == [
        "model.use_te_layers False -> True"]  # what the resume logs
    assert check_resumable(saved, _fingerprint(), allowed=["model.use_te_layers"]) == []
    fused = run_fingerprint(from_dict({"model": {"name": "tiny"}, "optim": {"fused": True}}), "float32", 8, "a" * 64, DATA)
    with pytest.raises(ConfigError, match=r"optim.fused False -> True.*resume.allow_changed=\[optim.fused\]"):
        check_resumable(saved, fused, allowed=[])
    # A checkpoint from before the key: it was the default then.
    assert check_resumable(_saved(tmp_path, _fingerprint(), drop=("optim.fused",)), _fingerprint(), allowed=[]) == []


def test_a_changed_global_batch_says_how_to_keep_it(tmp_path):
    saved = _saved(tmp_path, _fingerprint())
    current = run_fingerprint(from_dict({"model": {"name": "tiny"}}), "float32", 4, "a" * 64, DATA)
    with pytest.raises(ConfigError) as err:
        check_resumable(saved, current, allowed=[])
    assert "global_batch_size 8 -> 4 (batch_size is per data-parallel rank" in str(err.value)
    assert "batch_size x dp_shard x dp_replicate stays 8" in str(err.value)


def test_an_older_fingerprint_without_the_kernel_keys_means_the_defaults(tmp_path):
    saved = _saved(tmp_path, _fingerprint(), drop=("model.use_te_layers", "model.efficient_attn"))
    check_resumable(saved, _fingerprint(), allowed=[])


def test_the_decay_shape_is_part_of_the_schedule_and_older_checkpoints_ran_the_cosine(tmp_path):
    def with_optim(**optim) -> dict:
        return run_fingerprint(from_dict({"model": {"name": "tiny"}, "optim": optim}), "float32", 8, "a" * 64, DATA)

    older = _saved(tmp_path, with_optim(), drop=("optim.decay_style", "optim.decay_start"))
    check_resumable(older, with_optim(), allowed=[])
    with pytest.raises(ConfigError, match="optim.decay_style 'cosine' -> 'linear'"):
        check_resumable(older, with_optim(decay_style="linear"), allowed=[])
    check_resumable(older, with_optim(decay_start=50, decay_steps=100), allowed=["optim.decay_start",
                                                                                  "optim.decay_steps"])


def test_extending_a_run_at_constant_lr_needs_no_decay_end(tmp_path):
    """With min_lr_ratio=1 there is no decay end to keep (and optim.decay_steps is refused then)."""
    def run(steps: int, min_lr_ratio: float) -> dict:
        cfg = from_dict({"model": {"name": "tiny"}, "steps": steps, "optim": {"min_lr_ratio": min_lr_ratio}})
        return run_fingerprint(cfg, "float32", 8, "a" * 64, DATA)

    check_resumable(_saved(tmp_path, run(100, 1.0)), run(200, 1.0), allowed=[])
    with pytest.raises(ConfigError, match="optim.decay_steps 100 -> 200 .*pass optim.decay_steps=100"):
        check_resumable(_saved(tmp_path, run(100, 0.1)), run(200, 0.1), allowed=[])
    # Decay switched on at the resume of a constant-LR run: named, and allowable (it was a TypeError).
    with pytest.raises(ConfigError) as err:
        check_resumable(_saved(tmp_path, run(100, 1.0)), run(200, 0.1), allowed=[])
    assert "optim.decay_steps None -> 200 (the saved run held its LR constant (optim.min_lr_ratio=1)" in str(err.value)
    assert "resume.allow_changed=[optim.min_lr_ratio,optim.decay_steps]" in str(err.value)


def test_the_fp8_format_cannot_change_while_saved_scales_carry_over(tmp_path):
    saved = _saved(tmp_path, _fingerprint(use_fp8=True))
    with pytest.raises(ConfigError) as err:
        check_resumable(saved, _fingerprint(use_fp8=True, fp8_format="e4m3"), allowed=["model.fp8_format"])
    message = str(err.value)
    assert "model.fp8_format 'hybrid' -> 'e4m3'" in message and "old format's range" in message
    assert "allow_changed" not in message and "\n" not in message
    # Without saved scales (fp8 was off) the format is free: switching fp8 on is the change to allow.
    check_resumable(_saved(tmp_path, _fingerprint()), _fingerprint(use_fp8=True, fp8_format="e4m3"),
                    allowed=["model.use_fp8"])


def test_fp8_can_be_switched_off_and_on_whatever_its_history_length(tmp_path):
    """The history's length is its checkpointed shape, so it cannot change while fp8 stays on; switching
    fp8 off (its keys then back at their defaults) or on (no saved history loaded) must stay possible."""
    on_with_4 = _fingerprint(use_fp8=True, fp8_amax_history_len=4, fp8_margin=1)
    check_resumable(_saved(tmp_path, on_with_4), _fingerprint(), allowed=["model.use_fp8"])
    check_resumable(_saved(tmp_path, _fingerprint()), on_with_4, allowed=["model.use_fp8"])
    with pytest.raises(ConfigError, match="model.fp8_amax_history_len 4 -> 16") as err:
        check_resumable(_saved(tmp_path, on_with_4), _fingerprint(use_fp8=True, fp8_amax_history_len=16, fp8_margin=1),
                        allowed=[])
    assert "allow_changed" not in str(err.value)
    with pytest.raises(ConfigError, match="model.use_fp8 True -> False"):
        check_resumable(_saved(tmp_path, on_with_4), _fingerprint(), allowed=[])


def test_data_fingerprint_sees_a_change_anywhere_in_a_small_file(tmp_path):
    """Up to 4 MiB the blocks cover the whole file; beyond, 64 evenly spread blocks (first and last)."""
    tokens = tmp_path / "tokens.bin"
    data = bytearray(range(256)) * (3 << 12)  # 3 MiB
    tokens.write_bytes(data)
    before = data_fingerprint(tokens, 100, "0" * 64)["data_sample"]
    for offset in (0, len(data) // 3, len(data) // 2 + 12345, len(data) - 1):
        changed = bytearray(data)
        changed[offset] ^= 1
        tokens.write_bytes(changed)
        assert data_fingerprint(tokens, 100, "0" * 64)["data_sample"] != before, offset
    tokens.write_bytes(data)
    assert data_fingerprint(tokens, 100, "0" * 64)["data_sample"] == before
    assert data_fingerprint(tokens, 101, "0" * 64)["data_sample"] != before


def test_a_fingerprint_that_is_no_json_object_is_one_line(tmp_path):
    for text in ("[1, 2]", "{broken", ""):
        (tmp_path / FINGERPRINT_FILE).write_text(text)
        with pytest.raises(ConfigError, match=rf"^checkpoint {tmp_path} has no readable fingerprint.json \(.*\); it was"):
            check_resumable(tmp_path, _fingerprint(), allowed=[])


def test_data_fingerprint_carries_the_whole_file_hash_recorded_at_packing(tmp_path):
    tokens = tmp_path / "tokens.bin"
    tokens.write_bytes(bytes(1000))
    assert data_fingerprint(tokens, 500, "ab" * 32)["data_sha256"] == "ab" * 8


def test_any_data_change_is_refused_and_older_checkpoints_are_checked_by_the_sampled_hashes(tmp_path):
    """The sampled hashes miss a same-length edit between their blocks; the whole-file hash does not."""
    with pytest.raises(ConfigError, match="data_sha256 'hhhhhhhhhhhhhhhh' -> 'iiiiiiiiiiiiiiii'"):
        check_resumable(_saved(tmp_path, _fingerprint()), _fingerprint() | {"data_sha256": "i" * 16}, allowed=[])
    saved = _saved(tmp_path, _fingerprint(), drop=("data_sample", "data_sha256"))
    check_resumable(saved, _fingerprint(), allowed=[])
    with pytest.raises(ConfigError, match="data 'dddddddddddddddd' -> 'eeeeeeeeeeeeeeee'"):
        check_resumable(saved, _fingerprint() | {"data": "e" * 16}, allowed=[])
    with pytest.raises(ConfigError, match="data_sample 'ssssssssssssssss' -> 'tttttttttttttttt'"):
        check_resumable(_saved(tmp_path, _fingerprint()), _fingerprint() | {"data_sample": "t" * 16}, allowed=[])


def test_eval_steps_is_what_eval_loss_averages(tmp_path):
    """Another eval.steps gives eval_loss over another held-out subset: refused unless allowed; a
    checkpoint older than the key is not compared on it."""
    saved = _saved(tmp_path, _fingerprint())
    fewer = _fingerprint() | {"eval.steps": 1}
    with pytest.raises(ConfigError, match=r"eval.steps 4 -> 1 \(eval_loss averages .* resume.allow_changed=\[eval.steps\]"):
        check_resumable(saved, fewer, allowed=[])
    check_resumable(saved, fewer, allowed=["eval.steps"])
    check_resumable(_saved(tmp_path, _fingerprint(), drop=("eval.steps",)), fewer, allowed=[])


def test_a_longer_run_is_told_how_to_keep_the_schedule_only_when_it_can(tmp_path):
    def run_of(steps: int, **optim) -> dict:
        return run_fingerprint(from_dict({"model": {"name": "tiny"}, "steps": steps, "optim": optim}),
                               "float32", 8, "a" * 64, DATA)

    with pytest.raises(ConfigError) as err:
        check_resumable(_saved(tmp_path, run_of(20, warmup_steps=10)), run_of(30, warmup_steps=10), allowed=[])
    assert "pass optim.decay_steps=20 to continue the same schedule" in str(err.value)
    # A run that ended inside its warmup has no decay to continue: optim.decay_steps=3 would be refused.
    # (A checkpoint folder whose step is not known cannot show that no LR it used changes.)
    with pytest.raises(ConfigError) as err:
        check_resumable(_saved(tmp_path, run_of(3, warmup_steps=10)), run_of(4, warmup_steps=10), allowed=[])
    assert "optim.decay_steps=3" not in str(err.value)
    assert "ended at step 3, inside the warmup of 10 steps configured now" in str(err.value)
    assert "resume.allow_changed=[optim.decay_steps]" in str(err.value)


def _run_of(steps: int, **optim) -> dict:
    return run_fingerprint(from_dict({"model": {"name": "tiny"}, "steps": steps, "optim": optim}),
                           "float32", 8, "a" * 64, DATA)


def _step_folder(tmp_path, step: int, fingerprint: dict):
    folder = tmp_path / f"step_{step}"
    folder.mkdir()
    return _saved(folder, fingerprint)


def test_a_run_that_ended_inside_its_warmup_may_be_extended(tmp_path):
    """Every LR of steps 1..3 is the same warmup LR whatever the decay end: a longer run is the same run."""
    saved = _step_folder(tmp_path, 3, _run_of(3, warmup_steps=10))
    assert check_resumable(saved, _run_of(100, warmup_steps=10), allowed=[]) == [
        "optim.decay_steps 3 -> 100 (accepted: the checkpoint's 3 steps all came before the LR decay, which starts "
        "after step 10, so every LR they used stays the same)"]


def test_a_run_that_stopped_in_its_stable_phase_may_be_extended(tmp_path):
    """Warmup-stable-decay: steps up to optim.decay_start ran at the peak LR, whatever the decay end."""
    saved = _step_folder(tmp_path, 40, _run_of(100, warmup_steps=10, decay_start=50))
    changes = check_resumable(saved, _run_of(200, warmup_steps=10, decay_start=50), allowed=[])
    assert changes == ["optim.decay_steps 100 -> 200 (accepted: the checkpoint's 40 steps all came before the LR "
                       "decay, which starts after step 50, so every LR they used stays the same)"]
    # The decay start itself moved before the checkpoint's step: that LR changed, refused as ever.
    with pytest.raises(ConfigError, match="optim.decay_start 50 -> 30"):
        check_resumable(saved, _run_of(200, warmup_steps=10, decay_start=30), allowed=[])


def test_a_run_whose_decay_had_begun_keeps_its_decay_end(tmp_path):
    """Step 60 of a decay from step 50 to 100 used an LR that a decay to 200 would not give."""
    saved = _step_folder(tmp_path, 60, _run_of(100, warmup_steps=10, decay_start=50))
    with pytest.raises(ConfigError) as err:
        check_resumable(saved, _run_of(200, warmup_steps=10, decay_start=50), allowed=[])
    assert ("optim.decay_steps 100 -> 200 (where the LR decay ends: optim.decay_steps, or steps when unset; pass "
            "optim.decay_steps=100 to continue the same schedule)") in str(err.value)
    assert "resume.allow_changed=[optim.decay_steps]" in str(err.value)
    saved = _step_folder(tmp_path, 11, _run_of(20, warmup_steps=10))  # one step into the cosine
    with pytest.raises(ConfigError, match="pass optim.decay_steps=20 to continue the same schedule"):
        check_resumable(saved, _run_of(30, warmup_steps=10), allowed=[])


def test_the_attention_kernel_is_part_of_the_run_under_cp_too():
    """model.efficient_attn picks CP's chunk-pair kernel too (math: the plain formula): another run."""
    def cp_run(**model) -> dict:
        cfg = from_dict({"model": {"name": "tiny", **model}, "context_parallel_size": 2})
        return run_fingerprint(cfg, "float32", 8, "a" * 64, DATA)

    assert cp_run(efficient_attn="math") != cp_run()
    assert _fingerprint(efficient_attn="math") != _fingerprint()


def test_rope_scaling_is_architecture_stored_as_json_and_null_in_older_checkpoints(tmp_path):
    scaled = _fingerprint(rope_scaling={"factor": 32.0})
    assert scaled["model.rope_scaling"] == {"type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    check_resumable(_saved(tmp_path, scaled), scaled, allowed=[])  # equal once read back from JSON
    with pytest.raises(ConfigError, match=r"model.rope_scaling \{.*'factor': 32.0.*\} -> \{.*'factor': 8.0") as err:
        check_resumable(_saved(tmp_path, scaled), _fingerprint(rope_scaling={}), allowed=[])
    assert "allow_changed" not in str(err.value)  # the architecture: never allowable
    older = _saved(tmp_path, _fingerprint(), drop=("model.rope_scaling",))
    check_resumable(older, _fingerprint(), allowed=[])
    with pytest.raises(ConfigError, match=r"model.rope_scaling None -> \{'type': 'llama3'"):
        check_resumable(older, scaled, allowed=[])


def test_tied_embeddings_are_architecture_and_absent_means_untied(tmp_path):
    tied = _fingerprint(tie_embeddings=True)
    with pytest.raises(ConfigError, match=r"model.tie_embeddings True -> False") as err:
        check_resumable(_saved(tmp_path, tied), _fingerprint(), allowed=[])
    assert "allow_changed" not in str(err.value)
    older = _saved(tmp_path, _fingerprint(), drop=("model.tie_embeddings",))
    check_resumable(older, _fingerprint(), allowed=[])
    with pytest.raises(ConfigError, match=r"model.tie_embeddings False -> True"):
        check_resumable(older, tied, allowed=[])


def test_a_blend_with_other_weights_is_refused_and_older_checkpoints_were_one_source(tmp_path):
    cfg = from_dict({"model": {"name": "tiny"}})
    blend = run_fingerprint(cfg, "float32", 8, "a" * 64, DATA | {"data.weights": [0.8, 0.2]})
    saved = _saved(tmp_path, blend)
    with pytest.raises(ConfigError) as err:
        check_resumable(saved, run_fingerprint(cfg, "float32", 8, "a" * 64, DATA | {"data.weights": [0.5, 0.5]}), [])
    assert "data.weights [0.8, 0.2] -> [0.5, 0.5] (the blend's shares changed: data.weights" in str(err.value)
    assert "resume.allow_changed" not in str(err.value)  # another data order: never allowable
    one = run_fingerprint(cfg, "float32", 8, "a" * 64, DATA | {"data.weights": [1.0]})
    check_resumable(_saved(tmp_path, one, drop=("data.weights",)), one, allowed=[])  # written before blends
