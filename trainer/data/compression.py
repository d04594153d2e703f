"""A source file's bytes, decompressed as its name says (`.gz`, `.zst`) and streamed: a compressed
corpus is read a chunk at a time, never whole in memory."""

import gzip
import io
import zlib
from pathlib import Path
from typing import BinaryIO

import zstandard

# What a damaged or truncated compressed file raises while it is read.
CORRUPT_ERRORS = (EOFError, zlib.error, gzip.BadGzipFile, zstandard.ZstdError)
_CHUNK_BYTES = 1 << 16


def compression_of(path: Path) -> str | None:
    """"gzip", "zstd" or None (plain), from the name's last suffix in any letter case."""
    return {".gz": "gzip", ".zst": "zstd"}.get(path.suffix.lower())


def open_decompressed(path: Path) -> BinaryIO:
    """`path`'s content as a buffered binary stream; the caller closes it."""
    kind = compression_of(path)
    if kind == "gzip":
        return gzip.open(path, "rb")
    if kind == "zstd":
        return io.BufferedReader(_ZstdReader(open(path, "rb")))
    return open(path, "rb")


class _ZstdReader(io.RawIOBase):
    """The frames of a .zst file, one after another. zstandard's own stream reader ends quietly where a
    truncated file ends inside a frame; here that is an error, so a cut download is not packed short."""

    def __init__(self, raw: BinaryIO) -> None:
        self._raw, self._frame = raw, zstandard.ZstdDecompressor().decompressobj()
        self._output, self._input, self._in_frame = memoryview(b""), b"", False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self._output:
            data, self._input = self._input or self._raw.read(_CHUNK_BYTES), b""
            if not data:
                if self._in_frame:
                    raise zstandard.ZstdError("the file ends inside a frame (truncated)")
                return 0
            if self._frame.eof:
                self._frame = zstandard.ZstdDecompressor().decompressobj()
            self._output = memoryview(self._frame.decompress(data))  # sliced without copies below
            self._in_frame = not self._frame.eof
            if self._frame.eof:
                self._input = self._frame.unused_data
        size = min(len(buffer), len(self._output))
        buffer[:size] = self._output[:size]
        self._output = self._output[size:]
        return size

    def close(self) -> None:
        self._raw.close()
        super().close()
