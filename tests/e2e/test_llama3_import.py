"""A Llama-3.1-style folder as users download it (tokenizer.json only, llama3 RoPE scaling, an
intermediate_size no sizing rule gives) starts training with model=hf on tp2 x pp2: the architecture is
the folder's, the first step's loss is transformers' loss on the same batch, one step at a negligible
LR exports back bitwise, weights and tokenizer files alike, and scripts/generate.py on the checkpoint
gives transformers' greedy output. A Llama-3.2-style folder (tied embeddings, no lm_head.weight) does
the same on pp2 x dp2, and its export loads in transformers as a tied model with the same logits."""

import json
import math
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers

from scripts.generate import generate_ids, prompt_ids
from tests.e2e.launch import REPO, train_ok
from tests.e2e.test_hf_import import hf_tensors
from tests.llama3_folder import ROPE, corpus_lines, learned_ranks, llama31_folder, write_hf_tokenizer, write_tiktoken
from trainer.checkpoint.hf_origin import ORIGIN_FILE
from trainer.checkpoint.model_folder import load_model
from trainer.data.loader import BatchLoader
from trainer.data.prepare import prepare_dataset
from trainer.data.sampler import GlobalBatchSampler, split_windows
from trainer.data.tokenizer import load_tokenizer

# The context the folder was pretrained for (ROPE) is shorter than seq_len: the scaled frequencies decide the loss.
SEQ, BATCH = 64, 2
LLAMA32_ROPE = ROPE | {"factor": 32.0}


def import_train_export(tmp_path: Path, layout: tuple[str, ...], dp: int, rope: dict = ROPE,
                        tied: bool = False, eos_list: bool = False) -> tuple[transformers.LlamaForCausalLM, Path, Path]:
    """The folder trains one step at a negligible LR with model=hf on `layout` (4 ranks, `dp` of them data
    parallel), with transformers' loss on the same global batch, and exports back bitwise, weights and
    tokenizer files alike, and its eos ids (`eos_list`: a list, as instruct models declare, with one more
    id than the tokenizer's eos); returns the model, the step-1 checkpoint and the exported folder."""
    hf_dir = tmp_path / "Llama-3-tiny"
    write_hf_tokenizer(write_tiktoken(learned_ranks(), tmp_path / "ranks" / "tokenizer.model"), hf_dir)
    tokenizer = load_tokenizer(hf_dir)
    # Weights of std 0.2, not 0.02: attention sharp enough that the RoPE scaling decides the output.
    eos = [tokenizer.eos_id - 1, tokenizer.eos_id] if eos_list else tokenizer.eos_id
    hf = llama31_folder(hf_dir, tokenizer.vocab_size, tokenizer.bos_id, eos, init_std=0.2, rope=rope, tied=tied)
    source = tmp_path / "corpus.txt"
    source.write_text("\n".join(corpus_lines(200)))
    cache = tmp_path / "cache"
    dump = tmp_path / "run"
    records = train_ok(4, dump, "model=hf", f"checkpoint.init_from_hf={hf_dir}", *layout, f"seq_len={SEQ}",
                       f"batch_size={BATCH}", "steps=1", "checkpoint.freq=1", "optim.lr=1e-30", "optim.warmup_steps=0",
                       f"data.source={source}", "data.held_out_fraction=0", f"data.cache_dir={cache}")
    saved = json.loads((dump / "train_config.json").read_text())["model"]
    architecture = (saved["intermediate_size"], saved["vocab_size"], saved["rope_scaling"]["factor"],
                    saved["tie_embeddings"])
    assert architecture == (160, tokenizer.vocab_size, rope["factor"], tied)

    _, tokens = prepare_dataset(str(source), str(hf_dir), tokenizer.vocab_size, cache, True, lambda line: None)
    windows, _ = split_windows(tokens.num_tokens, SEQ, 0.0)
    loader = BatchLoader(tokens, GlobalBatchSampler(windows, BATCH * dp, seed=0), SEQ, 0, 1, BATCH * dp)
    (inputs, targets), = loader.batch(0)
    with torch.no_grad():
        expected = F.cross_entropy(hf(input_ids=inputs).logits.flatten(0, 1), targets.flatten()).item()
    assert math.isclose(records[0]["loss"], expected, rel_tol=1e-5), (records[0]["loss"], expected)

    out = tmp_path / "exported"
    ckpt = dump / "checkpoints" / "step_1"
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "export_hf.py"), str(ckpt), str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (hf_dir / name).read_bytes(), name
    # The folder's config.json travels in the checkpoints: the export declares the folder's eos ids.
    assert (ckpt / ORIGIN_FILE).read_bytes() == (hf_dir / "config.json").read_bytes()
    config = json.loads((out / "config.json").read_text())
    assert (config["rope_scaling"], config["tie_word_embeddings"], config["eos_token_id"]) == (rope, tied, eos)
    original, exported = hf_tensors(hf_dir), hf_tensors(out)
    assert original.keys() == exported.keys()
    for name, tensor in original.items():
        assert torch.equal(tensor, exported[name]), name
    return hf, ckpt, out


def test_model_hf_on_tp2_pp2_gives_transformers_loss_and_exports_back_bitwise(tmp_path):
    hf, ckpt, _ = import_train_export(tmp_path, ("model_parallel_size=2", "pipeline_parallel_size=2"), dp=1,
                                      eos_list=True)
    # The checkpoint of any layout generates, greedily, what transformers generates from the folder, for a
    # prompt longer than the original context the scaling stretches.
    model, ours = load_model(ckpt, torch.device("cpu"), torch.float32)
    prompt = " ".join(corpus_lines(3))
    ids = prompt_ids(ours, prompt)
    assert len(ids) > ROPE["original_max_position_embeddings"]
    inputs = torch.tensor([ids])
    expected = hf.generate(inputs, attention_mask=torch.ones_like(inputs), do_sample=False, max_new_tokens=8,
                           pad_token_id=ours.eos_id)[0, len(ids):].tolist()
    assert generate_ids(model, ours, prompt, 8) == expected


def test_a_tied_llama_3_2_folder_on_pp2_dp2_imports_as_one_weight_and_exports_as_transformers_saves_it(tmp_path):
    """The first and last stages each hold a copy of the tied weight; the export ships no lm_head.weight,
    and transformers reads it back as the tied model it was."""
    hf, _, out = import_train_export(tmp_path, ("pipeline_parallel_size=2",), dp=2, rope=LLAMA32_ROPE, tied=True)
    assert "lm_head.weight" not in hf_tensors(out)
    exported = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert exported.lm_head.weight is exported.model.embed_tokens.weight
    tokens = torch.randint(0, hf.config.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(exported(input_ids=tokens).logits, hf(input_ids=tokens).logits)
