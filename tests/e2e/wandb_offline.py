"""Reading back what an offline W&B run wrote: the records of its `run-<id>.wandb` file, with the wandb
package's own protobuf messages.

The file is a LevelDB-style log (W&B's transaction log, which `wandb sync` uploads): a 7-byte header
(":W&B", magic 0xBEE1, version 0), then 32 KiB blocks of records, each a 7-byte header (CRC-32, length,
type: full, or the first, middle or last fragment of one too long for its block) and its bytes.
"""

import json
import struct
import zlib
from pathlib import Path

from wandb.proto import wandb_internal_pb2

_FILE_HEADER = struct.Struct("<4sHB")
_RECORD_HEADER = struct.Struct("<IHB")
_BLOCK = 32768
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def records(path: Path) -> list[wandb_internal_pb2.Record]:
    data = path.read_bytes()
    ident, magic, version = _FILE_HEADER.unpack_from(data)
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), (ident, magic, version)
    found, pending, pos = [], b"", _FILE_HEADER.size
    while pos + _RECORD_HEADER.size <= len(data):
        if _BLOCK - pos % _BLOCK < _RECORD_HEADER.size:  # a block's tail too short for a header is padding
            pos += _BLOCK - pos % _BLOCK
            continue
        checksum, length, kind = _RECORD_HEADER.unpack_from(data, pos)
        if (checksum, length, kind) == (0, 0, 0):
            break
        body = data[pos + _RECORD_HEADER.size:pos + _RECORD_HEADER.size + length]
        assert zlib.crc32(body, zlib.crc32(bytes([kind]))) == checksum, f"{path}: bad checksum at byte {pos}"
        pos += _RECORD_HEADER.size + length
        pending = body if kind in (_FULL, _FIRST) else pending + body
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            found.append(record)
    return found


def history(path: Path) -> list[dict]:
    """The logged rows of a run file, in order: {"_step": step, scalar name: value}."""
    rows = []
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            rows.append(items)
    return rows
