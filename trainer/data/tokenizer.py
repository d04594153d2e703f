"""The one tokenizer interface the data path uses, which file a run's tokenizer is, and the loading of any
supported format behind it.

Formats are told apart by content, not by name (Llama 3 ships a tiktoken file named tokenizer.model, the
name sentencepiece models have too): a Hugging Face tokenizer.json (tokenizer_hf.py), a tiktoken BPE file
(tokenizer_tiktoken.py), or a sentencepiece model (tokenizer_spm.py, also what the trainer builds from
the corpus when no tokenizer is given). A folder is read through the first of FOLDER_FILES it holds.
"""

import re
from pathlib import Path
from typing import NamedTuple, Protocol

from parallel.errors import ConfigError
from trainer.config.vocab import VocabPadding, model_vocab_size
from trainer.data.tokenizer_hf import CONFIG_FILE as HF_CONFIG_FILE
from trainer.data.tokenizer_hf import JSON_FILE, HuggingFaceTokenizer
from trainer.data.tokenizer_spm import SentencePieceTokenizer
from trainer.data.tokenizer_tiktoken import TiktokenTokenizer, parse_ranks
from trainer.outputs import TOKENIZER_FILE

FORMATS = "a sentencepiece model, a Hugging Face tokenizer.json or a tiktoken BPE file"
# In a folder (a Hugging Face model, a checkpoint): tokenizer.json first, as transformers reads it.
FOLDER_FILES = (JSON_FILE, TOKENIZER_FILE, f"original/{TOKENIZER_FILE}")


class Tokenizer(Protocol):
    kind: str  # "sentencepiece", "huggingface" or "tiktoken"
    path: Path  # the file read
    vocab_size: int  # ids are 0 .. vocab_size - 1, special tokens included
    bos_id: int
    eos_id: int
    adds_bos: bool  # whether a text (a prompt) starts with bos for this tokenizer's models
    sha256: str  # of the files read, as they were read

    @property
    def files(self) -> dict[str, bytes]:
        """What checkpoints carry (and a resume reads back): {file name: the bytes read}."""

    @property
    def special_tokens(self) -> dict[str, int]:
        """{text: id} of the special tokens (Llama 3's `<|eot_id|>`, sentencepiece's control `<s>`): what a
        chat template spells in a prompt (encode_with_special_tokens)."""

    def encode(self, text: str) -> list[int]:
        """The ids of `text` (no bos or eos; text spelling a special token stays text)."""

    def encode_batch(self, texts: list[str], num_threads: int = 2) -> list[list[int]]:
        """encode for many texts in one call."""

    def decode(self, ids: list[int]) -> str:
        """The text of `ids`."""


def encode_with_special_tokens(tokenizer: Tokenizer, text: str) -> list[int]:
    """The ids of `text` in which the text of a special token is that token (as a chat template writes
    `<|start_header_id|>user<|end_header_id|>`), and the text between them is encoded as `encode` does;
    the longest special text wins where one is a prefix of another. A Hugging Face tokenizer.json reads
    them with its own package, which applies what the file says around them."""
    if isinstance(tokenizer, HuggingFaceTokenizer):
        return tokenizer.encode_reading_special_tokens(text)
    specials = tokenizer.special_tokens
    if not specials:
        return tokenizer.encode(text)
    pattern = "|".join(re.escape(name) for name in sorted(specials, key=len, reverse=True))
    ids: list[int] = []
    for i, piece in enumerate(re.split(f"({pattern})", text)):
        ids += [specials[piece]] if i % 2 else (tokenizer.encode(piece) if piece else [])
    return ids


def tokenizer_file(path: Path) -> Path | None:
    """The file a tokenizer path names: itself, or a folder's first FOLDER_FILES; None: nothing there."""
    if path.is_dir():
        return next((path / name for name in FOLDER_FILES if (path / name).is_file()), None)
    return path if path.is_file() else None


def missing_tokenizer(path: str | Path, origin: str, when: str = "after the run chose it") -> str:
    """The error line of a tokenizer file the run chose (not one the user named: `origin` says whose it
    is) that is gone when it is read."""
    return f"the tokenizer {path} is missing: it is {origin}, and was deleted {when}"


def load_tokenizer(path: str | Path, key: str = "data.tokenizer", origin: str | None = None) -> Tokenizer:
    """The tokenizer in `path` (a file, or a folder holding one), whatever its format; `key` names where the
    path came from in error lines; `origin`: whose tokenizer the run chose, where `key` is not a setting the
    user named (TokenizerChoice.origin)."""
    given = Path(path).expanduser()
    file = tokenizer_file(given)
    if file is None and origin is not None and not given.exists():
        raise ConfigError(missing_tokenizer(path, origin))
    if file is None:
        what = f"is a folder without {' or '.join(FOLDER_FILES)}" if given.is_dir() else \
            "is not a file" if given.exists() else "does not exist"
        raise ConfigError(f"{key}={path} {what}")
    try:
        data = file.read_bytes()
    except FileNotFoundError as e:  # deleted since tokenizer_file found it
        raise ConfigError(missing_tokenizer(file, origin) if origin else f"{key}={file} does not exist") from e
    except OSError as e:
        raise ConfigError(f"{key}={file} cannot be read: {e.strerror or e}") from e
    where = f"{key}={file}"
    if data.lstrip()[:1] == b"{":
        config = file.with_name(HF_CONFIG_FILE)
        return HuggingFaceTokenizer(file, data, config.read_bytes() if config.is_file() else None, where)
    ranks = parse_ranks(data)
    if ranks is not None:
        return TiktokenTokenizer(file, data, ranks, where)
    try:
        return SentencePieceTokenizer(file, data, where)
    except ConfigError:
        raise ConfigError(f"{where} is none of the formats this trainer reads ({FORMATS})") from None


def load_given_tokenizer(tokenizer_path: str | Path | None, vocab_size: int, key: str = "data.tokenizer",
                         padding: VocabPadding | None = None, origin: str | None = None) -> Tokenizer | None:
    """The tokenizer of `tokenizer_path` (None: none given), checked for what packing and the model need:
    model.vocab_size (`vocab_size`) has a row for each of its ids, or pads them as `padding` says."""
    if tokenizer_path is None:
        return None
    tokenizer = load_tokenizer(tokenizer_path, key, origin)
    if tokenizer.bos_id < 0 or tokenizer.eos_id < 0:
        raise ConfigError(f"{key}={tokenizer.path} has no bos/eos tokens; packing needs both")
    model_vocab_size(vocab_size, tokenizer.vocab_size, padding, f"{key}={tokenizer.path}")
    return tokenizer


class TokenizerChoice(NamedTuple):
    path: str | None  # None: a tokenizer is trained on the data
    key: str  # what error lines call it
    note: str | None = None  # a log line, where it is not simply data.tokenizer
    origin: str | None = None  # whose tokenizer it is, where it is not data.tokenizer (missing_tokenizer)


def choose_tokenizer(data_tokenizer: str | None, init_from_hf: str | None, resumed: Path | None) -> TokenizerChoice:
    """The tokenizer a run uses: `data.tokenizer`; else, starting from a Hugging Face folder, the
    folder's (weights are only meaningful with the ids they were trained on); else none (a tokenizer is
    trained on the data). Resuming (`resumed`: the checkpoint continued), the copy that checkpoint keeps
    stands in for the folder's, and for a data.tokenizer file that is gone, so a resume needs neither
    any more. A folder without a tokenizer needs `data.tokenizer` named; a run that starts from a folder
    with one may not name another (a resume keeps the tokenizer it trained with, which its fingerprint
    guards)."""
    given = tokenizer_file(Path(data_tokenizer).expanduser()) if data_tokenizer is not None else None
    kept = tokenizer_file(resumed) if resumed is not None else None
    if kept is not None and data_tokenizer is not None and given is None:
        return TokenizerChoice(str(kept), "the checkpoint's tokenizer",
                               f"data: tokenizer {kept}, the copy in the resumed checkpoint (data.tokenizer="
                               f"{data_tokenizer} is gone)",
                               f"the resumed checkpoint's copy of data.tokenizer={data_tokenizer} (which is gone)")
    if init_from_hf is None or data_tokenizer is not None and resumed is not None:
        return TokenizerChoice(data_tokenizer, "data.tokenizer")
    if data_tokenizer is None and kept is not None:
        return TokenizerChoice(str(kept), "the checkpoint's tokenizer",
                               f"data: tokenizer {kept}, the copy in the resumed checkpoint of checkpoint.init_from_hf's",
                               "the resumed checkpoint's copy of checkpoint.init_from_hf's tokenizer")
    folder = Path(init_from_hf).expanduser()
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"checkpoint.init_from_hf={init_from_hf} is a file: name the Hugging Face model folder "
                          "(config.json, safetensors, tokenizer files)")
    shipped = tokenizer_file(folder) if folder.is_dir() else None
    if data_tokenizer is None and shipped is None:
        raise ConfigError(f"checkpoint.init_from_hf={init_from_hf} has no {' or '.join(FOLDER_FILES)}: set "
                          "data.tokenizer to the tokenizer its weights were trained with (data.tokenizer=null would "
                          "train a new one, with other ids)")
    if data_tokenizer is None:
        return TokenizerChoice(str(shipped), "checkpoint.init_from_hf's tokenizer",
                               f"data: tokenizer {shipped} (that of checkpoint.init_from_hf; data.tokenizer is null)",
                               f"checkpoint.init_from_hf={init_from_hf}'s tokenizer (data.tokenizer is null)")
    # A missing data.tokenizer is left to the data preparation's own error line.
    if shipped is not None and given is not None and given.read_bytes() != shipped.read_bytes():
        raise ConfigError(f"data.tokenizer={data_tokenizer} is another tokenizer than {shipped}, whose ids the "
                          "weights of checkpoint.init_from_hf were trained on: set data.tokenizer=null to use the "
                          "folder's")
    return TokenizerChoice(data_tokenizer, "data.tokenizer")
