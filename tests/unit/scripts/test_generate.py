"""scripts/generate.py: greedy generation from a Hugging Face folder is transformers' generate token for
token (llama3 RoPE scaling over a prompt longer than the original context), a training checkpoint gives
what its Hugging Face export gives, sampling is reproducible and top-p filters, and a bad PATH is one
error line with exit code 2."""

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

import scripts.export_hf as export_hf
from model.attention import RotaryEmbedding
from model.generate import Sampling, top_p_filter
from model.init import init_weights
from model.transformer import Transformer
from parallel.errors import ConfigError
from scripts.generate import completion, generate_ids, main, prompt_ids
from tests import REPO
from tests.llama3_folder import ROPE, learned_ranks, llama31_folder, write_hf_tokenizer, write_tiktoken
from tests.source_kinds import train_small_tokenizer
from trainer.checkpoint.files import save_checkpoint
from trainer.checkpoint.hf_origin import ORIGIN_FILE
from trainer.checkpoint.model_folder import load_model, stop_ids
from trainer.config.schema import from_dict
from trainer.data.tokenizer import encode_with_special_tokens, load_tokenizer
from trainer.outputs import CONFIG_FILE

CPU, FP32 = torch.device("cpu"), torch.float32
PROMPT = "def value(self, x):\n    return self.token(x) for über in naïve 数据 import class"
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def llama31(tmp_path_factory) -> tuple[Path, transformers.LlamaForCausalLM]:
    """A tiny Llama 3.1 folder with its tokenizer.json, and the transformers model it holds. Its weights are
    drawn large enough for attention to depend on positions (at 0.02 it is near uniform, and RoPE moot)."""
    folder = tmp_path_factory.mktemp("llama31")
    write_hf_tokenizer(write_tiktoken(learned_ranks(), folder / "ranks" / "tokenizer.model"), folder)
    tokenizer = load_tokenizer(folder)
    return folder, llama31_folder(folder, tokenizer.vocab_size, tokenizer.bos_id, tokenizer.eos_id, init_std=0.2)


@pytest.mark.parametrize("prompt", [PROMPT, "x = 12"], ids=["past_the_original_context", "short"])
def test_greedy_ids_are_transformers_generate(llama31, prompt: str) -> None:
    folder, hf = llama31
    model, tokenizer = load_model(folder, CPU, FP32)
    ids = prompt_ids(tokenizer, prompt)
    assert ids[0] == tokenizer.bos_id
    inputs = torch.tensor([ids])
    expected = hf.generate(inputs, attention_mask=torch.ones_like(inputs), do_sample=False,
                           max_new_tokens=NEW_TOKENS, pad_token_id=tokenizer.eos_id)[0, len(ids):].tolist()
    assert generate_ids(model, tokenizer, prompt, NEW_TOKENS) == expected
    if prompt == PROMPT:  # positions past the original context: the scaled frequencies decide the ids
        assert len(ids) > ROPE["original_max_position_embeddings"]
        model.rope = RotaryEmbedding(model.args.head_dim, model.args.rope_theta, scaling=None)
        assert generate_ids(model, tokenizer, prompt, NEW_TOKENS) != expected


def test_a_tied_model_decodes_with_the_embedding_as_its_head(llama31, tmp_path: Path) -> None:
    """Llama 3.2-style (tie_word_embeddings: the one chunk's head reads the embedding's weight): the cached
    decode gives transformers' greedy ids, as the untied model does."""
    tokenizer = load_tokenizer(llama31[0])
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((llama31[0] / name).read_bytes())
    hf = llama31_folder(tmp_path, tokenizer.vocab_size, tokenizer.bos_id, tokenizer.eos_id, init_std=0.2, tied=True)
    model, tokenizer = load_model(tmp_path, CPU, FP32)
    assert model.head.output is None
    inputs = torch.tensor([prompt_ids(tokenizer, PROMPT)])
    expected = hf.generate(inputs, attention_mask=torch.ones_like(inputs), do_sample=False,
                           max_new_tokens=NEW_TOKENS, pad_token_id=tokenizer.eos_id)[0, inputs.shape[1]:].tolist()
    assert generate_ids(model, tokenizer, PROMPT, NEW_TOKENS) == expected


def test_the_command_prints_the_completion_alone(llama31) -> None:
    folder, _ = llama31
    model, tokenizer = load_model(folder, CPU, FP32)
    expected = completion(tokenizer, prompt_ids(tokenizer, PROMPT), generate_ids(model, tokenizer, PROMPT, 8))
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # the fp32 CPU run the ids above come from
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "generate.py"), str(folder), "--prompt", PROMPT,
                           "--max-new-tokens", "8"], cwd=REPO, env=env, capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.decode() == expected and expected


def test_sampling_is_reproducible_and_top_p_filters(llama31) -> None:
    model, tokenizer = load_model(llama31[0], CPU, FP32)

    def sample(seed: int, temperature: float = 1.0, top_p: float = 1.0) -> list[int]:
        return generate_ids(model, tokenizer, PROMPT, 16, Sampling(temperature, top_p, seed))

    greedy, first = generate_ids(model, tokenizer, PROMPT, 16), sample(0)
    assert sample(0) == first and sample(1) != first and first != greedy
    # A temperature so small that the logits over it overflow: the top token, as greedy (it drew from NaNs).
    assert sample(0, temperature=1e-40) == greedy
    # A nucleus that only the most likely token fills is greedy, whatever the temperature.
    assert sample(0, temperature=2.0, top_p=1e-6) == greedy
    probs = torch.tensor([0.125, 0.5, 0.375])
    assert top_p_filter(probs, 0.5).tolist() == [0.0, 0.5, 0.0]
    assert top_p_filter(probs, 0.75).tolist() == [0.0, 0.5, 0.375]
    assert top_p_filter(probs, 1.0).tolist() == probs.tolist()
    # A peaked fp32 distribution over Llama 3's vocabulary: its cumsum reaches 1.0 before the tail ends.
    peaked = torch.softmax(torch.randn(128256, generator=torch.Generator().manual_seed(0)) * 5, dim=-1)
    assert torch.equal(top_p_filter(peaked, 1.0), peaked)


def test_a_checkpoint_generates_what_its_hugging_face_export_does(llama31, world, tmp_path: Path) -> None:
    """A checkpoint written by the trainer's own save (one process, full weights by name, as every layout
    stores them), with the run's config and tokenizer: the same greedy ids as scripts/export_hf.py's folder."""
    tokenizer = load_tokenizer(llama31[0])
    cfg = from_dict({"seq_len": 64, "model": {"n_layers": 2, "dim": 64, "n_heads": 4, "n_kv_heads": 2,
                                              "vocab_size": tokenizer.vocab_size,
                                              "rope_scaling": {"original_max_position_embeddings": 16}}})
    trained = Transformer(cfg.model)
    init_weights(trained, cfg.model, seed=3)
    files = {**tokenizer.files, CONFIG_FILE: json.dumps(dataclasses.asdict(cfg)).encode()}
    ckpt = save_checkpoint(tmp_path / "checkpoints", 1, {"model": trained.state_dict()}, world, 0, files)
    export_hf.export(ckpt, tmp_path / "hf", FP32)
    from_checkpoint = generate_ids(*load_model(ckpt, CPU, FP32), PROMPT, NEW_TOKENS)
    assert from_checkpoint == generate_ids(*load_model(tmp_path / "hf", CPU, FP32), PROMPT, NEW_TOKENS)
    with torch.no_grad():  # and what the training forward predicts, recomputed without a cache
        ids = prompt_ids(tokenizer, PROMPT)
        greedy = [int(trained(torch.tensor([ids + from_checkpoint[:i]]))[0, -1].argmax()) for i in range(4)]
    assert greedy == from_checkpoint[:4]
    # A config damaged since (its size kept, so the manifest's sizes still pass) or hand-edited: one line
    # naming the file and the key, not a constructor's traceback.
    config = ckpt / CONFIG_FILE
    config.write_text(config.read_text().replace('"dim": 64', '"dim": -4'))
    hf_config = tmp_path / "hf" / "config.json"
    hf_config.write_text(json.dumps({**json.loads(hf_config.read_text()), "num_attention_heads": 0}))
    for path, message in ((ckpt, f"{config}: model.dim=-4 must be > 0"),
                          (tmp_path / "hf", f"{tmp_path / 'hf'}: model.n_heads=0 must be > 0")):
        with pytest.raises(ConfigError) as refused:
            load_model(path, CPU, FP32)
        assert str(refused.value) == message


def test_a_bad_path_or_option_is_one_error_line(tmp_path: Path, capsys) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    (tmp_path / "no_tokenizer").mkdir()
    (tmp_path / "no_tokenizer" / "config.json").write_text("{}")
    run = tmp_path / "run"
    (run / "checkpoints" / "step_2").mkdir(parents=True)
    (run / "checkpoints" / "step_2" / "manifest.json").write_text("{}")
    cases = [([str(tmp_path / "missing")], str(tmp_path / "missing")), ([str(tmp_path / "empty")], "neither"),
             ([str(tmp_path / "file")], str(tmp_path / "file")),
             ([str(tmp_path / "no_tokenizer")], f"PATH={tmp_path / 'no_tokenizer'} is a folder without"),
             ([str(run)], f"its newest complete checkpoint is {run / 'checkpoints' / 'step_2'}"),
             ([str(run), "--top-p", "0"], "top_p=0.0 must be in (0, 1]"),
             ([str(run), "--temperature", "-1"], "temperature=-1.0 must be"),
             ([str(run), "--seed", str(2**64)], f"seed={2**64} must be from -2**63 to 2**64 - 1")]
    for argv, fragment in cases:
        assert main([*argv, "--prompt", "x"]) == 2
        out, err = capsys.readouterr()
        assert not out and err.startswith("error: ") and err.count("\n") == 1 and fragment in err, err


CHAT = ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nWhat is 2 + 2?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_special_tokens_in_a_chat_prompt_are_the_tokens_transformers_reads(llama31) -> None:
    """--special-tokens: a Llama 3 chat prompt gives transformers' ids for the folder's tokenizer.json and for
    its tiktoken file alike, with one bos (the prompt's own); without it the text is text, as in training."""
    folder = llama31[0]
    expected = transformers.AutoTokenizer.from_pretrained(folder)(CHAT, add_special_tokens=False).input_ids
    for tokenizer in (load_tokenizer(folder), load_tokenizer(folder / "ranks" / "tokenizer.model")):
        ids = prompt_ids(tokenizer, CHAT, special_tokens=True)
        assert ids == expected and ids.count(tokenizer.bos_id) == 1, tokenizer.kind
        specials = set(tokenizer.special_tokens.values())
        plain = prompt_ids(tokenizer, CHAT)
        assert plain[0] == tokenizer.bos_id and not specials & set(plain[1:]), tokenizer.kind
        assert prompt_ids(tokenizer, "x<|eot_id|>", special_tokens=True) == [
            tokenizer.bos_id, *tokenizer.encode("x"), tokenizer.special_tokens["<|eot_id|>"]]


def test_special_tokens_are_read_as_the_tokenizer_json_reads_them(tmp_path: Path) -> None:
    """What tokenizer.json says around special tokens holds: Metaspace's prepend_scheme "first" (Llama 2's and
    Mistral's files as transformers now writes them) puts its space before the text's start only, and a token
    with rstrip (Phi-3's chat tokens) takes the whitespace after it. Cutting the prompt at the special tokens
    and encoding each piece gave an extra space token after each, and the newline as a token."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    raw.decoder = decoders.Metaspace(prepend_scheme="first")
    raw.train_from_iterator(["hi there, more text here\nand more"] * 20, trainers.BpeTrainer(
        vocab_size=80, special_tokens=["<unk>", "<s>", "</s>"]))
    raw.add_special_tokens([AddedToken("<|user|>", rstrip=True, special=True, normalized=False)])
    raw.save(str(tmp_path / "tokenizer.json"))
    tokenizer = load_tokenizer(tmp_path / "tokenizer.json")
    for prompt in ("<s>hi there</s>more", "<|user|>\nhi</s>"):
        expected = Tokenizer.from_file(str(tmp_path / "tokenizer.json")).encode(prompt, add_special_tokens=False).ids
        assert encode_with_special_tokens(tokenizer, prompt) == expected
        pieces = [tokenizer.special_tokens.get(p) or tokenizer.encode(p) for p in
                  re.split(r"(<s>|</s>|<\|user\|>)", prompt) if p]
        assert [i for p in pieces for i in (p if isinstance(p, list) else [p])] != expected  # the case it missed
    assert tokenizer.encode("<|user|>") != [tokenizer.special_tokens["<|user|>"]]  # encode still reads text


def test_sentencepieces_control_pieces_are_its_special_tokens(tmp_path: Path) -> None:
    tokenizer = train_small_tokenizer(tmp_path)
    assert tokenizer.special_tokens == {"<s>": tokenizer.bos_id, "</s>": tokenizer.eos_id}
    assert encode_with_special_tokens(tokenizer, "<s>def x</s>") == [tokenizer.bos_id, *tokenizer.encode("def x"),
                                                                     tokenizer.eos_id]


def test_the_command_notes_a_special_tokens_text_read_as_text(llama31, capsys) -> None:
    folder = str(llama31[0])
    assert main([folder, "--prompt", "x<|eot_id|>", "--max-new-tokens", "1"]) == 0
    assert capsys.readouterr().err == ("note: the prompt spells <|eot_id|>, read as text; --special-tokens reads it "
                                       "as the token\n")
    assert main([folder, "--prompt", "x<|eot_id|>", "--max-new-tokens", "1", "--special-tokens"]) == 0
    assert capsys.readouterr().err == ""


def test_generation_stops_at_each_eos_id_the_folder_declares(llama31, tmp_path: Path) -> None:
    """An instruct model's eos list (config.json or generation_config.json, as transformers' generate reads
    them; a checkpoint carries its run's folder's config.json): generation ends at any of them, as
    transformers' does. It ran on past every id but the tokenizer's eos before."""
    folder, hf = llama31
    model, tokenizer = load_model(folder, CPU, FP32)
    assert stop_ids(folder, tokenizer) == [tokenizer.eos_id]
    greedy = generate_ids(model, tokenizer, PROMPT, NEW_TOKENS)
    assert tokenizer.eos_id not in greedy
    listed = greedy[5]  # the sixth id, taken as an end of turn
    stop_at = greedy.index(listed)
    inputs = torch.tensor([prompt_ids(tokenizer, PROMPT)])
    expected = hf.generate(inputs, attention_mask=torch.ones_like(inputs), do_sample=False, max_new_tokens=NEW_TOKENS,
                           pad_token_id=tokenizer.eos_id, eos_token_id=[tokenizer.eos_id, listed])
    assert expected[0, inputs.shape[1]:].tolist() == greedy[: stop_at + 1]
    for name in ("config.json", "generation_config.json"):
        copy = tmp_path / name.split(".")[0]
        copy.mkdir()
        for file in folder.iterdir():
            if file.is_file():
                (copy / file.name).write_bytes(file.read_bytes())
        config = json.loads((copy / "config.json").read_text()) if name == "config.json" else {}
        (copy / name).write_text(json.dumps(config | {"eos_token_id": [tokenizer.eos_id, listed, "x", 10**9]}))
        stops = stop_ids(copy, tokenizer)
        assert stops == [tokenizer.eos_id, listed]  # what is not an id of the tokenizer is left out
        assert generate_ids(model, tokenizer, PROMPT, NEW_TOKENS, stops=stops) == greedy[: stop_at + 1]
        assert completion(tokenizer, [], greedy[: stop_at + 1], stops) == tokenizer.decode(greedy[:stop_at])
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "manifest.json").write_text("{}")
    (ckpt / ORIGIN_FILE).write_text(json.dumps({"eos_token_id": [tokenizer.eos_id, listed]}))
    assert stop_ids(ckpt, tokenizer) == [tokenizer.eos_id, listed]


def test_a_completion_keeps_the_leading_space_its_decoder_drops_alone(tmp_path: Path) -> None:
    """A sentencepiece model with add_dummy_prefix (Llama 2's and Mistral's) drops a text's leading space:
    the ids of " Paris" decoded alone are "Paris", so prompt and completion printed together lost the space."""
    import io

    import sentencepiece as spm

    lines = ["The capital of France is Paris and the capital of Italy is Rome"] * 50 + ["hello world foo bar"] * 50
    model = io.BytesIO()
    spm.SentencePieceTrainer.Train(sentence_iterator=iter(lines), model_writer=model, vocab_size=300,
                                   model_type="bpe", byte_fallback=True, add_dummy_prefix=True, unk_id=0, bos_id=1,
                                   eos_id=2, pad_id=-1, minloglevel=2)
    (tmp_path / "tokenizer.model").write_bytes(model.getvalue())
    tokenizer = load_tokenizer(tmp_path / "tokenizer.model")
    prompt, whole = tokenizer.encode("The capital of France is"), tokenizer.encode("The capital of France is Paris")
    assert whole[: len(prompt)] == prompt
    new = whole[len(prompt):] + [tokenizer.eos_id]
    assert tokenizer.decode(new[:-1]) == "Paris"  # alone, its space is gone
    assert completion(tokenizer, [tokenizer.bos_id, *prompt], new) == " Paris"
