"""The same documents in every source kind the trainer reads, written here from each format's own
description: .txt files, JSON lines, Parquet, a Hugging Face dataset folder (save_to_disk) and a Megatron
indexed dataset (.bin/.idx, written from the layout Megatron-LM's indexed_dataset.py documents, not with
the trainer's reader)."""

import gzip
import json
import struct
from pathlib import Path

import numpy as np

from trainer.data.tokenizer_spm import SentencePieceTokenizer, train_tokenizer

DOCUMENTS = [f"document {i}: the quick brown fox {'jumps ' * (i % 7)}over the lazy dog.\nline two {i}\n"
             for i in range(40)] + ["unicode: δ ü 漢字\r\nand a CRLF"]
# Megatron's DType codes (megatron/core/datasets/indexed_dataset.py): what preprocess_data.py writes for
# vocabularies below 65500 (uint16) and above (int32).
MEGATRON_DTYPE_CODES = {np.uint16: 8, np.int32: 4}


def train_small_tokenizer(folder: Path) -> SentencePieceTokenizer:
    """A 400-token sentencepiece model learned from DOCUMENTS, in `folder`."""
    corpus = folder / "corpus.txt"
    corpus.write_text("".join(DOCUMENTS) * 20)
    return SentencePieceTokenizer(train_tokenizer([corpus], 400, folder / "spm.model"))


def write_text_files(folder: Path, documents: list[str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i, document in enumerate(documents):
        (folder / f"doc{i:03d}.txt").write_bytes(document.encode())
    return folder


def write_jsonl(path: Path, documents: list[str], key: str = "text") -> Path:
    path.write_bytes("".join(json.dumps({"id": i, key: doc}) + "\n" for i, doc in enumerate(documents)).encode())
    return path


def write_jsonl_gz(path: Path, documents: list[str]) -> Path:
    path.write_bytes(gzip.compress(write_jsonl(path.with_suffix(".plain"), documents).read_bytes()))
    path.with_suffix(".plain").unlink()
    return path


def write_parquet(path: Path, documents: list, key: str = "text", row_group_size: int = 16) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"id": list(range(len(documents))), key: pa.array(documents)})
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def write_hf_dataset(folder: Path, documents: list[str], key: str = "text") -> Path:
    import datasets

    datasets.Dataset.from_dict({"id": list(range(len(documents))), key: documents}).save_to_disk(str(folder))
    return folder


def write_megatron(prefix: Path, token_documents: list[list[int]], dtype, append_eod: int | None = None,
                   sequences_per_document: int = 1) -> Path:
    """PREFIX.bin and PREFIX.idx as Megatron's _IndexWriter lays them out. Each document is cut into
    `sequences_per_document` sequences (as preprocess_data.py --split-sentences does); `append_eod` ends
    each document with that id (--append-eod). Returns PREFIX.bin."""
    lengths, data = [], bytearray()
    document_indices = [0]
    for ids in token_documents:
        ids = list(ids) + ([append_eod] if append_eod is not None else [])
        cuts = np.array_split(np.arange(len(ids)), sequences_per_document)
        for cut in cuts:
            piece = np.asarray([ids[i] for i in cut], dtype=dtype)
            lengths.append(len(piece))
            data += piece.tobytes()
        document_indices.append(len(lengths))
    itemsize = np.dtype(dtype).itemsize
    pointers = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) * itemsize
    bin_path = prefix.with_name(prefix.name + ".bin")
    bin_path.write_bytes(bytes(data))
    header = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", MEGATRON_DTYPE_CODES[dtype])
    header += struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(document_indices))
    prefix.with_name(prefix.name + ".idx").write_bytes(
        header + np.asarray(lengths, np.int32).tobytes() + pointers.tobytes()
        + np.asarray(document_indices, np.int64).tobytes())
    return bin_path


def write_every_kind(folder: Path, documents: list[str], tokenizer) -> Path:
    """A folder holding `documents` in order across every kind: a.parquet, b_hf/ (a dataset folder),
    c.bin/c.idx (tokenized by `tokenizer`, eod appended), d.jsonl.gz, e.txt; sorted by name, so read in
    that order."""
    folder.mkdir(parents=True, exist_ok=True)
    parts = np.array_split(np.arange(len(documents)), 5)
    a, b, c, d, e = ([documents[i] for i in part] for part in parts)
    write_parquet(folder / "a.parquet", a)
    write_hf_dataset(folder / "b_hf", b)
    write_megatron(folder / "c", [tokenizer.encode(doc) for doc in c], np.uint16, append_eod=tokenizer.eos_id,
                   sequences_per_document=2)
    write_jsonl_gz(folder / "d.jsonl.gz", d)
    (folder / "e.txt").write_text("".join(e), newline="")
    return folder


def text_form_of_every_kind(folder: Path, documents: list[str]) -> Path:
    """The documents of write_every_kind, as .txt files, one document each, in the same order."""
    parts = np.array_split(np.arange(len(documents)), 5)
    grouped = [documents[i] for part in parts[:4] for i in part] + ["".join(documents[i] for i in parts[4])]
    return write_text_files(folder, grouped)
