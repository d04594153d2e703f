"""A padded vocabulary through a Hugging Face folder, one step at a negligible LR: a folder of its
tokenizer's size trains padded by make_vocab_size_divisible_by on tp=2 (the padding rows zero, on the
second rank) and exports back bitwise at the tokenizer's size; a folder its makers padded beyond its
tokenizer imports with model=hf (one plain process), trains on the loss of the tokenizer's ids
(transformers' logits, padding masked), and exports back bitwise at its own size."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.e2e.launch import DATA_CACHE, REPO, train_ok
from tests.e2e.test_hf_import import FROZEN, hf_tensors, tiny_llama
from tests.llama3_folder import corpus_lines
from trainer.checkpoint.state import load_full_weights
from trainer.config.schema import from_dict
from trainer.data.loader import BatchLoader
from trainer.data.prepare import prepare_dataset
from trainer.data.sampler import GlobalBatchSampler, split_windows

IDS, SEQ, BATCH = 512, 64, 2  # the default data's tokenizer, which the folders ship


def _folder(tmp_path: Path, vocab_size: int):
    folder = tmp_path / "hf"
    hf = tiny_llama(folder, vocab_size=vocab_size)
    shipped, _ = prepare_dataset(None, None, IDS, DATA_CACHE, True, print)
    shutil.copyfile(shipped.path, folder / "tokenizer.model")
    return folder, hf


def _train_and_export(tmp_path: Path, folder: Path, nproc: int, *overrides: str) -> tuple[Path, list[dict]]:
    """One frozen step of model=hf from `folder` on a small corpus, exported back: the export is the folder,
    bitwise, config.json's vocab_size included. Returns the checkpoint and the metrics."""
    source = tmp_path / "corpus.txt"
    source.write_text("\n".join(corpus_lines(200)))
    dump = tmp_path / "run"
    frozen = [o for o in FROZEN if not o.startswith("model=")]
    records = train_ok(nproc, dump, *frozen, "model=hf", f"checkpoint.init_from_hf={folder}", f"batch_size={BATCH}",
                       f"data.source={source}", "data.held_out_fraction=0", f"data.cache_dir={tmp_path / 'cache'}",
                       *overrides)
    ckpt, out = dump / "checkpoints" / "step_1", tmp_path / "exported"
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "export_hf.py"), str(ckpt), str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    original, exported = hf_tensors(folder), hf_tensors(out)
    assert original.keys() == exported.keys()
    for name, tensor in original.items():
        assert torch.equal(tensor, exported[name]), name
    vocab = [json.loads((path / "config.json").read_text())["vocab_size"] for path in (folder, out)]
    assert vocab[0] == vocab[1], vocab
    return ckpt, records


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # single-process DCP load is intended
def test_the_key_pads_a_folder_of_its_tokenizers_size_and_the_export_drops_the_padding(tmp_path):
    folder, _ = _folder(tmp_path, IDS)
    ckpt, _ = _train_and_export(tmp_path, folder, 2, "model_parallel_size=2", "make_vocab_size_divisible_by=160")
    cfg = from_dict(json.loads((ckpt / "train_config.json").read_text()))
    assert cfg.model.vocab_size == 640  # 512 ids rounded up to a multiple of 160 x 2
    weights = load_full_weights(ckpt, cfg, ["tok_embeddings.weight", "head.output.weight"])
    for name, weight in weights.items():
        assert weight.shape[0] == 640 and weight[:IDS].any() and not weight[IDS:].any(), name


def test_a_folder_padded_beyond_its_tokenizer_trains_on_its_ids_and_exports_at_its_own_size(tmp_path):
    folder, hf = _folder(tmp_path, IDS + 64)
    _, records = _train_and_export(tmp_path, folder, 0)
    _, tokens = prepare_dataset(str(tmp_path / "corpus.txt"), str(folder / "tokenizer.model"), IDS + 64,
                                tmp_path / "cache", True, lambda line: None)
    windows, _ = split_windows(tokens.num_tokens, SEQ, 0.0)
    (inputs, targets), = BatchLoader(tokens, GlobalBatchSampler(windows, BATCH, seed=0), SEQ, 0, 1, BATCH).batch(0)
    with torch.no_grad():
        logits = hf(input_ids=inputs).logits[..., :IDS]  # the folder's padding is no token: masked out
    expected = F.cross_entropy(logits.flatten(0, 1), targets.flatten()).item()
    assert abs(records[0]["loss"] - expected) <= 1e-5 * expected, (records[0]["loss"], expected)
