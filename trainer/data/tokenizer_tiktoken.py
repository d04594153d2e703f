"""tiktoken BPE files: Llama 3's `original/tokenizer.model`, one `base64-token rank` line per mergeable token.

The file holds the byte-pair ranks only. Llama 3's pre-tokenizing pattern and its 256 special tokens
(bos, eos, the chat headers, the reserved ones) live in Meta's code, so they are Llama 3's here too:
the specials take the ids after the ranks, `<|begin_of_text|>` first and `<|end_of_text|>` second.
Text that spells a special token stays text.
"""

import base64
import json
import binascii
import hashlib
from pathlib import Path

from parallel.errors import ConfigError
from trainer.outputs import TOKENIZER_FILE

# Llama 3's split pattern (Meta's llama3 tokenizer.py, the same in 3.1-3.3).
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
NUM_SPECIAL_TOKENS = 256
_NAMED_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                   "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>", "<|start_header_id|>",
                   "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>")
LLAMA3_SPECIALS = _NAMED_SPECIALS + tuple(
    f"<|reserved_special_token_{2 + i}|>" for i in range(NUM_SPECIAL_TOKENS - len(_NAMED_SPECIALS)))


def parse_ranks(data: bytes) -> dict[bytes, int] | None:
    """The ranks of a tiktoken BPE file, or None when `data` is not one (every line `base64 rank`)."""
    ranks = {}
    try:
        for line in data.splitlines():
            if line:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
    except (ValueError, binascii.Error):
        return None
    return ranks or None


class TiktokenTokenizer:
    """A loaded tiktoken BPE file with Llama 3's pattern and special tokens."""

    kind = "tiktoken"
    adds_bos = True  # Llama 3 starts every text with <|begin_of_text|>

    def __init__(self, path: Path, data: bytes, ranks: dict[bytes, int], where: str) -> None:
        """`data`: the file's bytes; `ranks`: parse_ranks(data); `where`: how error lines name it."""
        import tiktoken

        self.path, self.model_bytes = Path(path), data
        if sorted(ranks.values()) != list(range(len(ranks))):
            raise ConfigError(f"{where}: its ranks are not 0..{len(ranks) - 1}, each once")
        specials = {name: len(ranks) + i for i, name in enumerate(LLAMA3_SPECIALS)}
        self._enc = tiktoken.Encoding(name=self.path.name, pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks,
                                      special_tokens=specials)
        self.bos_id, self.eos_id = specials[LLAMA3_SPECIALS[0]], specials[LLAMA3_SPECIALS[1]]
        self.special_tokens = specials
        self.vocab_size = len(ranks) + NUM_SPECIAL_TOKENS
        self.sha256 = hashlib.sha256(data).hexdigest()

    @property
    def files(self) -> dict[str, bytes]:
        return {TOKENIZER_FILE: self.model_bytes}

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def encode_batch(self, texts: list[str], num_threads: int = 2) -> list[list[int]]:
        return self._enc.encode_ordinary_batch(texts, num_threads=num_threads)

    def decode(self, ids: list[int]) -> str:
        return self._enc.decode(list(ids))


def write_hf_files(ranks_file: Path, folder: Path) -> None:
    """tokenizer.json and tokenizer_config.json for a tiktoken file, as Llama 3 folders ship them: the
    vocabulary and merges converted by transformers' own TikTokenConverter, Llama 3's special tokens, and
    a post-processor that starts a text with bos, so AutoTokenizer gives this tokenizer's ids."""
    try:
        from tokenizers import processors
        from transformers.convert_slow_tokenizer import TikTokenConverter
    except ImportError as e:
        raise ConfigError(f"writing a tiktoken tokenizer as tokenizer.json needs transformers ({e})") from e
    tokenizer = TikTokenConverter(vocab_file=str(ranks_file), pattern=LLAMA3_PATTERN,
                                  extra_special_tokens=list(LLAMA3_SPECIALS)).converted()
    bos, eos = LLAMA3_SPECIALS[:2]
    tokenizer.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                      special_tokens=[(bos, tokenizer.token_to_id(bos))])])
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
              "clean_up_tokenization_spaces": False}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
