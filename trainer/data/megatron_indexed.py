"""Megatron's indexed datasets, read directly: `PREFIX.bin` holds token ids back to back, `PREFIX.idx`
says where each sequence starts and which sequences make each document (the layout of Megatron-LM's
megatron/core/datasets/indexed_dataset.py, which its tools/preprocess_data.py writes):

    b"MMIDIDX\\x00\\x00"  u64 version (1)  u8 dtype code  u64 sequence count  u64 document count
    int32 sequence lengths  int64 sequence byte offsets into .bin  int64 document indices

A document is the sequences [document_indices[i], document_indices[i + 1]); the first index is 0 and the
last the sequence count. The dtype is uint16 for vocabularies below 65500, int32 above.
"""

import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from parallel.errors import ConfigError

INDEX_HEADER = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
# Megatron's DType codes: the value each numpy type is written as.
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
               8: np.uint16}
_INTEGER_CODES = (1, 2, 3, 4, 5, 8)
_FIXED = struct.Struct("<QBQQ")  # version, dtype code, sequence count, document count


def index_path(bin_path: Path) -> Path:
    return bin_path.with_suffix(".idx")


def is_indexed_dataset(path: Path) -> bool:
    """Whether `path` is the .bin of a pair (its .idx beside it): such a file is read as tokens, not text."""
    return path.suffix.lower() == ".bin" and index_path(path).is_file()


class IndexedDataset:
    """One .bin/.idx pair, memory-mapped: documents as arrays of token ids."""

    def __init__(self, bin_path: Path) -> None:
        self.bin_path, self.idx_path = Path(bin_path), index_path(Path(bin_path))
        where = f"data.source {self.idx_path}"
        index = np.memmap(self.idx_path, dtype=np.uint8, mode="r") if self.idx_path.stat().st_size else b""
        head = bytes(index[: len(INDEX_HEADER) + _FIXED.size])
        if head[: len(INDEX_HEADER)] != INDEX_HEADER or len(head) < len(INDEX_HEADER) + _FIXED.size:
            raise ConfigError(f"{where} is not a Megatron index (it does not start with {INDEX_HEADER!r})")
        version, code, sequences, documents = _FIXED.unpack(head[len(INDEX_HEADER):])
        if version != INDEX_VERSION:
            raise ConfigError(f"{where} is index version {version}; this trainer reads version {INDEX_VERSION}")
        if code not in _INTEGER_CODES:
            raise ConfigError(f"{where} has dtype code {code}, not a token id type "
                              f"({', '.join(f'{c}={np.dtype(DTYPE_CODES[c]).name}' for c in _INTEGER_CODES)})")
        self.dtype = np.dtype(DTYPE_CODES[code])
        offset = len(head)
        expected = offset + sequences * 4 + sequences * 8 + documents * 8
        if len(index) != expected:
            extra = "; a multimodal index (sequence modes) is not read" if len(index) == expected + sequences else ""
            raise ConfigError(f"{where} is {len(index)} bytes, but its header ({sequences} sequences, {documents} "
                              f"document indices) makes it {expected}{extra}")
        self.lengths = np.frombuffer(index, np.int32, sequences, offset)
        self.pointers = np.frombuffer(index, np.int64, sequences, offset + sequences * 4)
        self.document_indices = np.frombuffer(index, np.int64, documents, offset + sequences * 12)
        self._check(where)
        count = self.bin_path.stat().st_size // self.dtype.itemsize  # stray trailing bytes are never pointed at
        self._tokens = (np.memmap(self.bin_path, dtype=self.dtype, mode="r", shape=(count,)) if count
                        else np.zeros(0, self.dtype))

    def _check(self, where: str) -> None:
        """A damaged or mismatched pair is one line here rather than garbage tokens later."""
        bounds = self.document_indices
        if len(bounds) == 0 or bounds[0] != 0 or bounds[-1] != len(self.lengths) or np.any(np.diff(bounds) < 0):
            raise ConfigError(f"{where}: its document indices do not run from 0 up to its {len(self.lengths)} "
                              "sequences")
        if np.any(self.lengths < 0):
            raise ConfigError(f"{where}: a sequence length is negative")
        ends = self.pointers + self.lengths.astype(np.int64) * self.dtype.itemsize
        size = self.bin_path.stat().st_size
        if len(ends) and (np.any(self.pointers < 0) or ends.max() > size):
            raise ConfigError(f"{where} points past the end of {self.bin_path} ({size} bytes): not its .bin, or "
                              "a truncated copy")
        if np.any(self.pointers % self.dtype.itemsize):  # read by token, such a pointer gives shifted bytes
            raise ConfigError(f"{where} has a sequence pointer that is not a multiple of its {self.dtype.name} "
                              "token size: not a Megatron index")

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    def documents(self) -> Iterator[np.ndarray]:
        """Each document's ids, its sequences joined, in index order."""
        itemsize = self.dtype.itemsize
        for first, end in zip(self.document_indices[:-1], self.document_indices[1:]):
            parts = [self._tokens[p // itemsize: p // itemsize + n]
                     for p, n in zip(self.pointers[first:end], self.lengths[first:end])]
            yield np.concatenate(parts) if parts else np.zeros(0, self.dtype)
