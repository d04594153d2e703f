"""A Llama-3.1-style folder, made here and never downloaded. Its tokenizer: a byte-level BPE learned from a
small corpus with the `tokenizers` package, written as Meta's tiktoken ranks file, and converted from it to
a tokenizer.json by transformers' own TikTokenConverter (how Llama 3's tokenizer.json was made), with
Llama 3's special tokens and the post-processor that starts a text with <|begin_of_text|>. Its model: a
tiny transformers Llama with llama3 RoPE scaling over a short original context (16 positions)."""

import base64
from pathlib import Path
from typing import TYPE_CHECKING

from trainer.data.tokenizer_tiktoken import LLAMA3_PATTERN, write_hf_files

if TYPE_CHECKING:  # transformers is imported where a model is built: a tokenizer alone does not need it
    import transformers

ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}
WORDS = ["def", "return", "self", "value", "import", "class", "for", "in", "über", "naïve", "数据", "x", "y", "the",
         "token", "  ", "\n", "(", ")", ":", "=", "0", "12", "345"]


def corpus_lines(count: int = 400) -> list[str]:
    """Deterministic lines of code-like text with non-ASCII words."""
    return [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(10)) for i in range(count)]


def learned_ranks(vocab_size: int = 400, texts: list[str] | None = None) -> dict[bytes, int]:
    """A byte-level BPE with Llama 3's split pattern, learned from `texts` (default: corpus_lines()), as
    tiktoken ranks: the 256 bytes first, then each merge in the order it was learned (a token's rank is
    its merge priority, as in tiktoken)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(corpus_lines() if texts is None else texts, trainer)
    byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
    ranks = {bytes([b]): b for b in range(256)}
    for token, _ in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1]):
        ranks.setdefault(bytes(byte_of[c] for c in token), len(ranks))
    return ranks


def write_tiktoken(ranks: dict[bytes, int], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"{base64.b64encode(token).decode()} {rank}\n" for token, rank in ranks.items()))
    return path


def write_hf_tokenizer(tiktoken_file: Path, folder: Path) -> Path:
    """tokenizer.json and tokenizer_config.json in `folder`, converted from `tiktoken_file` by transformers."""
    write_hf_files(tiktoken_file, folder)
    return folder / "tokenizer.json"


def llama31_folder(folder: Path, vocab_size: int, bos: int, eos: int | list[int], init_std: float = 0.02, rope: dict = ROPE,
                   tied: bool = False) -> "transformers.LlamaForCausalLM":
    """A tiny random Llama 3.1 (GQA, an intermediate_size no sizing rule gives, `rope`) saved in `folder`;
    its weights drawn with std `init_std` (transformers' initializer_range); with `tied`, Llama 3.2-style:
    the head is the embedding (no lm_head.weight saved)."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=dict(rope),
        max_position_embeddings=128, bos_token_id=bos, eos_token_id=eos, tie_word_embeddings=tied,
        initializer_range=init_std, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(folder)
    return model
