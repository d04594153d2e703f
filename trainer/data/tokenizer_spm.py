"""SentencePiece tokenizers: a `.model` file (Llama 2's format, and what this trainer builds), and the
deterministic BPE training that builds one from the corpus when no tokenizer is given.

Training is deterministic (fixed settings, no input shuffling, first N lines) so that every run on the
same corpus and vocab size gets the byte-identical model, and therefore the same token stream. Byte
fallback plus identity normalization make encode/decode an exact round trip for any text, code
indentation included.
"""

import hashlib
import io
import json
import os
from collections.abc import Iterator
from pathlib import Path

import sentencepiece as spm

from parallel.errors import ConfigError
from trainer.data.records import RecordCount, RecordFormat, iter_documents
from trainer.outputs import TOKENIZER_FILE

BOS_ID, EOS_ID, UNK_ID = 1, 2, 0
# 256 byte pieces + unk/bos/eos: below this sentencepiece cannot even hold the byte fallback.
MIN_VOCAB_SIZE = 256 + 3 + 1
# Caps tokenizer training input: enough text for a good BPE, small enough for seconds on 2 cores.
MAX_TRAINING_LINES = 300_000
# Fixed, not the cores at hand: sentencepiece records num_threads in the model it writes, and the model's
# bytes (its sha256 is checked against the packed tokens and the run fingerprint) must not depend on the
# machine. More threads would gain little: they only normalize the lines, BPE merges run on one.
TRAINING_THREADS = 2


class SentencePieceTokenizer:
    """A loaded SentencePiece model. Its file is read once: `model_bytes` (what checkpoints and exports
    carry) and `sha256` are of the very model in use, even if the file is replaced meanwhile."""

    kind = "sentencepiece"
    adds_bos = True  # a prompt starts with bos, as every packed document does

    def __init__(self, path: Path, model_bytes: bytes | None = None, where: str | None = None) -> None:
        """`model_bytes`: the file's content, when the caller has read it already; `where`: how error lines
        name it (data.tokenizer=path unless given)."""
        self.path = Path(path)
        self._sp = spm.SentencePieceProcessor()
        where = where or f"data.tokenizer={path}"
        try:
            self.model_bytes = self.path.read_bytes() if model_bytes is None else model_bytes
        except FileNotFoundError as exc:
            raise ConfigError(f"{where} does not exist") from exc
        except OSError as exc:
            raise ConfigError(f"{where} cannot be read: {exc.strerror or exc}") from exc
        try:
            self._sp.LoadFromSerializedProto(self.model_bytes)
        except RuntimeError as exc:
            raise ConfigError(f"{where} is not a sentencepiece model") from exc
        self.sha256 = hashlib.sha256(self.model_bytes).hexdigest()

    @property
    def files(self) -> dict[str, bytes]:
        """What checkpoints carry: the model, under the name every folder gives it."""
        return {TOKENIZER_FILE: self.model_bytes}

    @property
    def vocab_size(self) -> int:
        return self._sp.GetPieceSize()

    @property
    def bos_id(self) -> int:
        return self._sp.bos_id()

    @property
    def eos_id(self) -> int:
        return self._sp.eos_id()

    @property
    def unk_id(self) -> int:
        return self._sp.unk_id()

    @property
    def special_tokens(self) -> dict[str, int]:
        """The control pieces (<s>, </s>): sentencepiece itself encodes their text as text."""
        return {self._sp.IdToPiece(i): i for i in range(self.vocab_size) if self._sp.IsControl(i)}

    def piece(self, token_id: int) -> str:
        """The text of a token (e.g. "<s>" for a bos)."""
        return self._sp.IdToPiece(token_id)

    @property
    def adds_prefix_space(self) -> bool:
        """Whether the model encodes text as if it began with a space (sentencepiece's add_dummy_prefix,
        on by default and in Llama 2's tokenizer; the BPE trained here has it off)."""
        return self._sp.Normalize("x").startswith("\u2581")  # the normalizer itself, whatever the vocabulary

    @property
    def model_type(self) -> str:
        """How the model segments: "bpe" (ours, Llama's), "unigram" (sentencepiece's default), "word", "char"."""
        from sentencepiece import sentencepiece_model_pb2

        proto = sentencepiece_model_pb2.ModelProto.FromString(self.model_bytes)
        return sentencepiece_model_pb2.TrainerSpec.ModelType.Name(proto.trainer_spec.model_type).lower()

    @property
    def has_byte_fallback(self) -> bool:
        """Whether text outside the vocabulary becomes its UTF-8 bytes rather than <unk>: sentencepiece
        adds the 256 byte pieces, <0x00> to <0xFF>, only with byte_fallback."""
        return self._sp.IsByte(self._sp.PieceToId("<0x00>"))

    def normalize(self, text: str) -> str:
        """The text as the model's normalizer hands it to the segmenter (spaces shown as "\u2581")."""
        return self._sp.Normalize(text)

    def encode(self, text: str) -> list[int]:
        return self._sp.Encode(text)

    def encode_batch(self, texts: list[str], num_threads: int = 2) -> list[list[int]]:
        """Encodes many texts in one call: far faster than a Python loop over `encode`."""
        return self._sp.Encode(texts, num_threads=num_threads)

    def decode(self, ids: list[int]) -> str:
        return self._sp.Decode(list(ids))


# Fixed settings: changing any of them changes every trained model, so they are part of the cache key.
_TRAINER_SETTINGS = dict(
    model_type="bpe",
    byte_fallback=True,
    unk_id=UNK_ID,
    bos_id=BOS_ID,
    eos_id=EOS_ID,
    pad_id=-1,
    # Identity normalization, kept whitespace and no dummy prefix: decode(encode(x)) == x exactly.
    normalization_rule_name="identity",
    remove_extra_whitespaces=False,
    add_dummy_prefix=False,
    allow_whitespace_only_pieces=True,
    split_digits=True,
    character_coverage=0.9995,
    # No shuffling: the first MAX_TRAINING_LINES lines, always the same ones.
    shuffle_input_sentence=False,
    input_sentence_size=MAX_TRAINING_LINES,
    max_sentence_length=1 << 16,
    minloglevel=2,
)


class _TrainingLines:
    """Non-blank corpus lines in file order, capped at `max_lines` (a deterministic cap).

    sentencepiece turns an exception raised inside its sentence iterator into an opaque RuntimeError,
    so the iterator keeps the original one for `train_tokenizer` to re-raise. The bad records it skips are
    not judged against data.max_bad_fraction here (the packing reads every record again and does): their
    count only explains a corpus with no text left.
    """

    def __init__(self, text_files: list[Path], max_lines: int, fmt: RecordFormat) -> None:
        self._text_files, self._fmt = text_files, fmt
        self._max_lines = max_lines
        self.error: Exception | None = None
        self.yielded = self.too_long = 0  # lines given to sentencepiece, and those it will skip as too long
        self.count = RecordCount()  # the records read, for the line saying there was no text

    def __iter__(self) -> Iterator[str]:
        try:
            yield from self._lines()
        except Exception as exc:  # any failure reading the corpus: re-raised by train_tokenizer
            self.error = exc

    def _lines(self) -> Iterator[str]:
        count = 0
        for path in self._text_files:
            for document in iter_documents(path, self._fmt, self.count):
                for line in document.splitlines():
                    if not line.strip():
                        continue
                    self.yielded += 1
                    self.too_long += len(line.encode()) > _TRAINER_SETTINGS["max_sentence_length"]
                    yield line
                    count += 1
                    if count >= self._max_lines:
                        return


def check_trainable_vocab_size(vocab_size: int) -> None:
    if vocab_size < MIN_VOCAB_SIZE:
        raise ConfigError(f"model.vocab_size={vocab_size} must be >= {MIN_VOCAB_SIZE} (the tokenizer trained on "
                          f"data.source has 256 byte pieces and the special ones)")


def train_tokenizer(text_files: list[Path], vocab_size: int, model_path: Path, fmt: RecordFormat = RecordFormat()) -> Path:
    """Trains a byte-fallback BPE model on `text_files` (their documents read as `fmt` says) and writes it
    atomically to `model_path`."""
    check_trainable_vocab_size(vocab_size)
    lines = _TrainingLines(text_files, MAX_TRAINING_LINES, fmt)
    # In memory and without a model_prefix: the prefix would be recorded in the model, which must
    # depend only on the corpus and the settings to be byte-identical across runs.
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.Train(
            sentence_iterator=iter(lines),
            model_writer=model,
            vocab_size=vocab_size,
            num_threads=TRAINING_THREADS,
            **_TRAINER_SETTINGS,
        )
    except RuntimeError as exc:
        if lines.error is not None:
            raise lines.error from None
        if lines.yielded == lines.too_long:  # sentencepiece's "sentences_.empty()": no usable line
            what = "no text (empty, or blank lines only)" if not lines.yielded else (
                f"no line shorter than {_TRAINER_SETTINGS['max_sentence_length']} bytes (the tokenizer learns "
                "from lines: split the text into lines)")
            raise ConfigError(f"data.source holds {what}{lines.count.skipped_note()}") from exc
        # Keep sentencepiece's human reason, drop its "INTERNAL: file.cc(744) [check] " prefix.
        reason = str(exc).strip().splitlines()[-1].split("] ", 1)[-1]
        message = f"model.vocab_size={vocab_size} cannot be trained on data.source: {reason}"
        raise ConfigError(message) from exc
    if lines.error is not None:
        raise lines.error
    return _write_atomically(model.getvalue(), Path(model_path))


def _write_atomically(data: bytes, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    # Same folder as the target so os.replace is atomic; pid keeps concurrent writers apart.
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return path


def trainer_settings_fingerprint() -> str:
    """A stable string of the training settings, for cache keys."""
    return json.dumps({**_TRAINER_SETTINGS, "max_lines": MAX_TRAINING_LINES}, sort_keys=True)


