"""scripts/export_hf.py: a trained checkpoint loads in transformers' Llama and gives our logits.

Catches any mapping slip (a swapped gate/up, a RoPE layout change, a config field HF reads differently)
that a name-level check would miss, and checks that a bad checkpoint is one error line, exit code 2.
"""

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers

from model.hf import to_hf
from model.transformer import Transformer
from tests.e2e.launch import REPO, train_ok
from trainer.checkpoint.state import load_full_weights
from trainer.config.schema import from_dict
from trainer.data.tokenizer_spm import BOS_ID, SentencePieceTokenizer

EXPORT = REPO / "scripts" / "export_hf.py"
# Relative to the logit scale. Not bitwise: HF may pick another attention kernel (eager measured ~2e-7).
MAX_REL_DIFF = 1e-4


def _export(ckpt: Path, out: Path, cwd: Path = REPO) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(EXPORT), str(ckpt), str(out)]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300)


def _our_model(ckpt: Path) -> Transformer:
    """Our model with the checkpoint's full weights (unflattened from the FSDP units' flat tensors)."""
    cfg = from_dict(json.loads((ckpt / "train_config.json").read_text()))
    model = Transformer(cfg.model)
    model.load_state_dict(load_full_weights(ckpt, cfg))
    return model.eval()


LAYOUTS = {"single": (0, ()), "pp2": (2, ("pipeline_parallel_size=2",))}


@pytest.fixture(scope="module")
def checkpoint_of(tmp_path_factory) -> Callable[[str], Path]:
    """The step-2 checkpoint of a short run on the named layout, trained once per module."""
    trained = {}

    def checkpoint(name: str) -> Path:
        if name not in trained:
            nproc, layout = LAYOUTS[name]
            run = tmp_path_factory.mktemp(name)
            train_ok(nproc, run, "model=tiny", "steps=2", "checkpoint.freq=2", "log_freq=1", *layout)
            trained[name] = run / "checkpoints" / "step_2"
        return trained[name]

    return checkpoint


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # single-process DCP load is intended
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_export_matches_transformers_llama(tmp_path: Path, checkpoint_of, name: str) -> None:
    """pp2 gathers the full weights from two stages' checkpoints. The export of TP-sharded (and
    FSDP-sharded) flat checkpoints is test_hf_import's: tp2 x dp2, back to transformers' tensors bitwise.
    Which ranks wrote the shards changes nothing else: export reads the full parameters' boxes."""
    ckpt = checkpoint_of(name)
    done = _export(ckpt, tmp_path / "hf")
    assert done.returncode == 0, done.stderr

    ours = _our_model(ckpt)
    hf, info = transformers.LlamaForCausalLM.from_pretrained(
        tmp_path / "hf", torch_dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    hf_weights = hf.state_dict()
    for name, weight in to_hf(ours.state_dict(), ours.args).items():
        assert torch.equal(hf_weights[name], weight), name

    args = ours.args
    tokens = torch.randint(0, args.vocab_size, (2, args.max_seq_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ours(tokens)
        got = hf.eval()(input_ids=tokens).logits
    abs_diff = (got - expected).abs().max().item()
    rel_diff = abs_diff / expected.abs().max().item()
    print(f"export_hf logits: max abs diff {abs_diff:.3e}, relative to the logit scale {rel_diff:.3e}")
    assert rel_diff < MAX_REL_DIFF

    # The exported tokenizer gives training's ids: BOS first, then our encoding.
    text = "def tokenize(line):\n    return line.split()  # 42 words"
    hf_ids = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")(text).input_ids
    assert hf_ids == [BOS_ID, *SentencePieceTokenizer(ckpt / "tokenizer.model").encode(text)]


def test_a_bad_checkpoint_or_a_used_output_folder_is_one_error_line(tmp_path: Path, checkpoint_of) -> None:
    ckpt = checkpoint_of("single")
    corrupt = tmp_path / "corrupt"
    shutil.copytree(ckpt, corrupt)
    shard = next(corrupt.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the manifest's sha256 can tell
    shard.write_bytes(bytes(data))
    used = tmp_path / "hf"
    used.mkdir()
    (used / "model.safetensors").write_bytes(b"an earlier export")
    # A missing or corrupt checkpoint, and an export over an existing model folder (whose stale shards
    # a reader could take for the export's).
    for bad, out, fragment in ((tmp_path / "missing", tmp_path / "hf_bad", "is not a checkpoint"),
                               (corrupt, tmp_path / "hf_bad", "sha256"),
                               (ckpt, used, "is not an empty folder"),
                               (ckpt, ckpt / "hf", f"is inside the checkpoint {ckpt}"),
                               # The empty folder one is in: it failed only after the whole export (EBUSY).
                               (ckpt, Path("."), ". is the current folder, which the export cannot replace")):
        (tmp_path / "here").mkdir(exist_ok=True)
        failed = _export(bad, out, cwd=tmp_path / "here")
        lines = failed.stderr.strip().splitlines()
        assert failed.returncode == 2 and len(lines) == 1 and lines[0].startswith("error:"), failed.stderr
        assert fragment in lines[0], lines[0]


def test_a_tokenizer_transformers_reads_otherwise_is_refused_unless_left_out(tmp_path: Path, checkpoint_of,
                                                                              monkeypatch, capsys) -> None:
    """The refusal's wiring (which tokenizers differ is tests/unit/test_export_tokenizer.py's): nothing is
    written, and --no-tokenizer exports the weights and config alone."""
    import scripts.export_hf as export_hf

    monkeypatch.setattr(export_hf, "tokenization_difference", lambda tokenizer: "'x  y' differs")
    ckpt = checkpoint_of("single")
    assert export_hf.main([str(ckpt), str(tmp_path / "refused")]) == 2
    line = capsys.readouterr().err.strip()
    assert "\n" not in line and "'x  y' differs" in line and "--no-tokenizer" in line, line
    assert not (tmp_path / "refused").exists()
    assert export_hf.main([str(ckpt), str(tmp_path / "weights"), "--no-tokenizer"]) == 0
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["config.json", "model.safetensors"]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # single-process DCP load is intended
def test_an_export_that_fails_midway_leaves_nothing_behind(tmp_path: Path, checkpoint_of, monkeypatch,
                                                           capsys) -> None:
    """A disk that fills while the weights are written (after config.json): one line, no half-written
    folder that a retry would refuse as not empty, no staging folder left; the retry then exports."""
    import scripts.export_hf as export_hf
    from safetensors import SafetensorError

    def full_disk(tensors, path, metadata=None):
        raise SafetensorError("Error while serializing: IoError(File too large (os error 27))")

    out = tmp_path / "exports" / "hf"
    with monkeypatch.context() as patch:
        patch.setattr(export_hf, "save_file", full_disk)
        assert export_hf.main([str(checkpoint_of("single")), str(out)]) == 2
    line = capsys.readouterr().err.strip()
    assert "\n" not in line and line.startswith("error: ") and "File too large" in line, line
    assert list((tmp_path / "exports").iterdir()) == []
    assert export_hf.main([str(checkpoint_of("single")), str(out)]) == 0
    assert (out / "model.safetensors").is_file() and list((tmp_path / "exports").iterdir()) == [out]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # single-process DCP load is intended
def test_the_declared_context_is_seq_len_unless_given(tmp_path: Path, checkpoint_of, capsys) -> None:
    """A model imported with a longer context and trained at a shorter seq_len keeps that context for
    inference servers (which cap prompts at max_position_embeddings) only where the export is told it."""
    import scripts.export_hf as export_hf

    ckpt = checkpoint_of("single")
    declared = {}
    for name, flag in (("default", []), ("given", ["--max-position-embeddings", "8192"])):
        assert export_hf.main([str(ckpt), str(tmp_path / name), "--no-tokenizer", *flag]) == 0
        declared[name] = transformers.AutoConfig.from_pretrained(tmp_path / name).max_position_embeddings
    assert declared == {"default": export_hf.read_train_config(ckpt).seq_len, "given": 8192}
    capsys.readouterr()
    assert export_hf.main([str(ckpt), str(tmp_path / "zero"), "--max-position-embeddings", "0"]) == 2
    assert capsys.readouterr().err.strip() == "error: --max-position-embeddings=0 must be a positive number of positions"
    assert not (tmp_path / "zero").exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_sharded_export_loads_one_shard_at_a_time_and_gives_the_same_model(tmp_path: Path, checkpoint_of,
                                                                           monkeypatch) -> None:
    """--max-shard-size: numbered shards and transformers' index, the same tensors as one file, and no
    load asks for more than one shard's parameters (a 70B export would otherwise hold the whole model)."""
    import scripts.export_hf as export_hf
    import trainer.checkpoint.state

    ckpt = checkpoint_of("single")
    assert export_hf.main([str(ckpt), str(tmp_path / "whole"), "--no-tokenizer"]) == 0
    largest = max(p.numel() for p in _our_model(ckpt).parameters())
    loaded = []
    load = trainer.checkpoint.state.load_checkpoint
    monkeypatch.setattr(trainer.checkpoint.state, "load_checkpoint",
                        lambda path, state, group: (loaded.append(sum(t.numel() for t in state["model"].values())),
                                                    load(path, state, group)))
    max_bytes = 200_000
    assert export_hf.main([str(ckpt), str(tmp_path / "sharded"), "--no-tokenizer", "--max-shard-size", "200KB"]) == 0
    files = sorted(p.name for p in (tmp_path / "sharded").glob("*.safetensors"))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors", files
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == files
    assert len(loaded) == len(files) and max(loaded) * 4 <= max(max_bytes, largest * 4), loaded
    whole = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "whole", torch_dtype=torch.float32).state_dict()
    sharded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "sharded", torch_dtype=torch.float32)
    for name, tensor in sharded.state_dict().items():
        assert torch.equal(tensor, whole[name]), name
    assert export_hf.main([str(ckpt), str(tmp_path / "bad"), "--max-shard-size", "lots"]) == 2
    assert not (tmp_path / "bad").exists()
