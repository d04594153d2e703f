"""Hugging Face tokenizers: a `tokenizer.json` (Llama 3's own format, and most models' on the Hub), read with
the `tokenizers` package, beside the `tokenizer_config.json` that names its bos and eos tokens.

Text that spells a special token ("<|end_of_text|>" inside a document about tokenizers) stays text, as
it does for the other formats: only packing puts bos and eos ids around a document.
"""

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

from parallel.errors import ConfigError

if TYPE_CHECKING:
    from tokenizers import Tokenizer

JSON_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
MAP_FILE = "special_tokens_map.json"  # checked against CONFIG_FILE, not read for ids
# Where tokenizer_config.json is silent: the names Llama 3 and Llama 2 / sentencepiece-derived files use.
_BOS_NAMES = ("<|begin_of_text|>", "<s>")
_EOS_NAMES = ("<|end_of_text|>", "</s>")


class HuggingFaceTokenizer:
    """A loaded tokenizer.json; its files are read once, so what checkpoints carry and `sha256` are of the
    tokenizer in use."""

    kind = "huggingface"

    def __init__(self, path: Path, data: bytes, config: bytes | None, where: str) -> None:
        """`path`: the tokenizer.json read; `data` its bytes; `config` those of the tokenizer_config.json
        beside it (None: there is none); `where`: how error lines name it (the key and path)."""
        from tokenizers import Tokenizer

        self.path, self._where = Path(path), where
        self._files = {JSON_FILE: data} | ({CONFIG_FILE: config} if config is not None else {})
        try:
            self._tok = _untruncated(Tokenizer.from_str(data.decode("utf-8")))
        except Exception as e:  # the Rust side raises its own exception type for any malformed field
            raise ConfigError(f"{where} is not a Hugging Face tokenizer.json ({str(e)[:120]})") from e
        self._tok.encode_special_tokens = True
        self._reading: "Tokenizer | None" = None  # encode_reading_special_tokens' instance, made when first used
        settings = _read_config(f"{where}: its {CONFIG_FILE}", config)
        self.bos_id = self._special_id(settings.get("bos_token"), _BOS_NAMES, "bos")
        self.eos_id = self._special_id(settings.get("eos_token"), _EOS_NAMES, "eos")
        self._check_special_tokens_map()
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1
        # Whether the tokenizer's own post-processor starts a text with bos (Llama 3's does).
        self.adds_bos = self._tok.encode("", add_special_tokens=True).ids[:1] == [self.bos_id]
        self.sha256 = _files_sha256(self._files)

    @property
    def files(self) -> dict[str, bytes]:
        return dict(self._files)

    def _special_id(self, given: str | dict | None, defaults: tuple[str, ...], what: str) -> int:
        """The id of the tokenizer_config.json's bos or eos token (a string, or an object with "content");
        else of the first default name the vocabulary holds."""
        names = [given.get("content") if isinstance(given, dict) else given] if given is not None else list(defaults)
        for name in names:
            token_id = self._tok.token_to_id(name) if isinstance(name, str) else None
            if token_id is not None:
                return token_id
        raise ConfigError(f"{self._where}: no {what} token ({' or '.join(map(str, names))}) in its "
                          f"vocabulary; name it as {what}_token in {CONFIG_FILE}")

    def _check_special_tokens_map(self) -> None:
        """transformers lets a special_tokens_map.json beside the file override tokenizer_config.json's bos and
        eos: one naming other tokens than those read here is refused, not trained with other separators."""
        where = f"{self._where}: its {MAP_FILE}"
        path = self.path.with_name(MAP_FILE)
        settings = _read_config(where, path.read_bytes()) if path.is_file() else {}
        for what, ours in (("bos", self.bos_id), ("eos", self.eos_id)):
            given = settings.get(f"{what}_token")
            name = given.get("content") if isinstance(given, dict) else given
            if isinstance(name, str) and self._tok.token_to_id(name) != ours:
                raise ConfigError(f"{where} names {what}_token {name!r}, but the {what} read here is "
                                  f"{self._tok.id_to_token(ours)!r} ({CONFIG_FILE}'s, or the default name where it "
                                  "is silent), and transformers reads the map's: make them agree")

    @property
    def special_tokens(self) -> dict[str, int]:
        return {token.content: token_id for token_id, token in self._tok.get_added_tokens_decoder().items()
                if token.special}

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_reading_special_tokens(self, text: str) -> list[int]:
        """The ids of `text` whose special tokens' text is the token, as the package reads a chat prompt:
        with each token's lstrip/rstrip and the pre-tokenizer's prepend scheme (Metaspace's "first" puts
        its space before the text's start only, not after every special token), which cutting the text at
        the special tokens and encoding each piece would miss. A second instance: this one's setting stays."""
        if self._reading is None:
            from tokenizers import Tokenizer

            self._reading = _untruncated(Tokenizer.from_str(self._files[JSON_FILE].decode("utf-8")))
        return self._reading.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str], num_threads: int = 2) -> list[list[int]]:
        """Many texts in one call, in parallel on the package's own thread pool (every core: it takes no
        count), or one by one in this thread for num_threads=1, as a preparation worker encodes (workers
        each on their own pool would oversubscribe the cores: measured 0.95x one process instead of 1.9x)."""
        if num_threads == 1:
            return [self._tok.encode(text, add_special_tokens=False).ids for text in texts]
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)


def _read_config(where: str, config: bytes | None) -> dict:
    if config is None:
        return {}
    try:
        settings = json.loads(config)
    except ValueError as e:
        raise ConfigError(f"{where} is not JSON ({e})") from e
    if not isinstance(settings, dict):
        raise ConfigError(f"{where} holds a JSON {type(settings).__name__}, not an object")
    return settings


def _files_sha256(files: dict[str, bytes]) -> str:
    """One hash of several named files: each name and length before its bytes, so no two sets collide."""
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(f"{name}\0{len(files[name])}\0".encode())
        digest.update(files[name])
    return digest.hexdigest()


def _untruncated(tok: "Tokenizer") -> "Tokenizer":
    """Without the truncation and padding a tokenizer.json may have saved (some releases keep a
    max_length, embedding tokenizers a fixed padding): they would cut every document to that length, or
    pad it with pad ids that depend on how documents fall into batches. transformers applies them only
    when a call asks to."""
    tok.no_truncation()
    tok.no_padding()
    return tok
