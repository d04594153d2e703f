"""A Llama-3.1-style folder as users download it (tokenizer.json only, llama3 RoPE scaling, an
intermediate_size no sizing rule gives) starts training with model=hf on tp2 x pp2: the architecture is
the folder's, the first step's loss is transformers' loss on the same batch, one step at a negligible
LR exports back bitwise, weights and tokenizer files alike, and scripts/generate.py on the checkpoint
gives transformers' greedy output."""

import json
import math
import subprocess
import sys

import torch
import torch.nn.functional as F

from scripts.generate import generate_ids, prompt_ids
from tests.e2e.launch import REPO, train_ok
from tests.e2e.test_hf_import import hf_tensors
from tests.llama3_folder import ROPE, corpus_lines, learned_ranks, llama31_folder, write_hf_tokenizer, write_tiktoken
from trainer.data.loader import BatchLoader
from trainer.data.prepare import prepare_dataset
from trainer.data.sampler import GlobalBatchSampler, split_windows
from trainer.checkpoint.model_folder import load_model
from trainer.data.tokenizer import load_tokenizer

# The context the folder was pretrained for (ROPE) is shorter than seq_len: the scaled frequencies decide the loss.
SEQ, BATCH = 64, 2


def test_model_hf_on_tp2_pp2_gives_transformers_loss_and_exports_back_bitwise(tmp_path):
    hf_dir = tmp_path / "Llama-3.1-tiny"
    write_hf_tokenizer(write_tiktoken(learned_ranks(), tmp_path / "ranks" / "tokenizer.model"), hf_dir)
    tokenizer = load_tokenizer(hf_dir)
    # Weights of std 0.2, not 0.02: attention sharp enough that the RoPE scaling decides the output.
    hf = llama31_folder(hf_dir, tokenizer.vocab_size, tokenizer.bos_id, tokenizer.eos_id, init_std=0.2)
    source = tmp_path / "corpus.txt"
    source.write_text("\n".join(corpus_lines(200)))
    cache = tmp_path / "cache"
    dump = tmp_path / "run"
    records = train_ok(4, dump, "model=hf", f"checkpoint.init_from_hf={hf_dir}", "model_parallel_size=2",
                       "pipeline_parallel_size=2", f"seq_len={SEQ}", f"batch_size={BATCH}", "steps=1",
                       "checkpoint.freq=1", "optim.lr=1e-30", "optim.warmup_steps=0", f"data.source={source}",
                       "data.held_out_fraction=0", f"data.cache_dir={cache}")
    saved = json.loads((dump / "train_config.json").read_text())["model"]
    assert (saved["intermediate_size"], saved["vocab_size"], saved["rope_scaling"]["factor"]) == \
        (160, tokenizer.vocab_size, 8.0)

    _, tokens = prepare_dataset(str(source), str(hf_dir), tokenizer.vocab_size, cache, True, lambda line: None)
    windows, _ = split_windows(tokens.num_tokens, SEQ, 0.0)
    loader = BatchLoader(tokens, GlobalBatchSampler(windows, BATCH, seed=0), SEQ, 0, 1, BATCH)
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
    assert json.loads((out / "config.json").read_text())["rope_scaling"] == ROPE
    original, exported = hf_tensors(hf_dir), hf_tensors(out)
    assert original.keys() == exported.keys()
    for name, tensor in original.items():
        assert torch.equal(tensor, exported[name]), name

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
