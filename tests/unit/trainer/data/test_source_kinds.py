"""Every source kind packs the same tokens as the same documents in .txt/.jsonl form, bit for bit; what is
not a source, or not whole, is one line."""

import sys
from pathlib import Path

import numpy as np
import pytest

from parallel.errors import ConfigError
from tests.source_kinds import (DOCUMENTS, text_form_of_every_kind, train_small_tokenizer, write_every_kind,
                                write_hf_dataset, write_jsonl, write_megatron, write_parquet, write_text_files)
from trainer.data.prepare import prepare_dataset
from trainer.data.records import RecordFormat
from trainer.data.shards import TOKENS_FILE
from trainer.data.sources import list_source
from trainer.data.tokenizer import load_tokenizer
from trainer.data.tokenizer_spm import SentencePieceTokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> SentencePieceTokenizer:
    return train_small_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def expected(tokenizer, tmp_path_factory) -> bytes:
    """The documents' packed tokens, from their .jsonl form."""
    folder = tmp_path_factory.mktemp("reference")
    return _pack(write_jsonl(folder / "docs.jsonl", DOCUMENTS), tokenizer, folder / "cache")


def _pack(source: Path | str, tokenizer, cache: Path, logs: list[str] | None = None, **fmt) -> bytes:
    _, tokens = prepare_dataset(str(source), str(tokenizer.path), tokenizer.vocab_size, cache, True,
                                (logs if logs is not None else []).append, fmt=RecordFormat(**fmt), workers=1)
    return (tokens.path / TOKENS_FILE).read_bytes()


def test_txt_and_jsonl_forms_agree(tmp_path, tokenizer, expected) -> None:
    assert _pack(write_text_files(tmp_path / "texts", DOCUMENTS), tokenizer, tmp_path / "cache") == expected


def test_parquet_packs_the_text_key_column(tmp_path, tokenizer, expected) -> None:
    assert _pack(write_parquet(tmp_path / "docs.parquet", DOCUMENTS), tokenizer, tmp_path / "c") == expected
    # Its kind is its content: a Parquet file under another name is read as one.
    renamed = write_parquet(tmp_path / "docs.data", DOCUMENTS, key="content")
    assert _pack(renamed, tokenizer, tmp_path / "c", text_key="content") == expected
    with pytest.raises(ConfigError, match=r'docs\.data has no "text" column \(its columns: id, content\); set '
                                          r"data\.text_key"):
        _pack(renamed, tokenizer, tmp_path / "c")
    ints = write_parquet(tmp_path / "ints.parquet", list(range(5)))
    with pytest.raises(ConfigError, match=r'ints\.parquet: its "text" column holds int64, not strings'):
        _pack(ints, tokenizer, tmp_path / "c")


def test_a_dictionary_encoded_text_column_is_read_as_strings(tmp_path, tokenizer, expected) -> None:
    """pandas writes a categorical text column dictionary-encoded: its values are strings all the same."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": pa.array(DOCUMENTS).dictionary_encode()}), tmp_path / "dict.parquet")
    assert _pack(tmp_path / "dict.parquet", tokenizer, tmp_path / "c") == expected


def test_a_parquet_row_that_is_not_utf8_is_a_bad_record_named_by_its_row(tmp_path, tokenizer) -> None:
    """A writer that does not validate can leave bytes that are not UTF-8 in a string column: one bad record
    (named, skippable), where converting the batch whole failed with a decoding traceback naming nothing."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    values = [d.encode() for d in DOCUMENTS[:7]] + [b"bad \xff text"] + [d.encode() for d in DOCUMENTS[7:]]
    offsets = np.cumsum([0] + [len(v) for v in values]).astype(np.int32)
    column = pa.Array.from_buffers(pa.string(), len(values), [None, pa.py_buffer(offsets.tobytes()),
                                                              pa.py_buffer(b"".join(values))])
    pq.write_table(pa.table({"text": column}), tmp_path / "bytes.parquet")
    with pytest.raises(ConfigError, match=r'bytes\.parquet row 7: its "text" is not UTF-8 text \(invalid start '
                                          r"byte 0xff at byte 4\)$"):
        _pack(tmp_path / "bytes.parquet", tokenizer, tmp_path / "c")
    logs: list[str] = []
    skipped = _pack(tmp_path / "bytes.parquet", tokenizer, tmp_path / "c", logs, bad_records="skip",
                    max_bad_fraction=0.05)
    assert skipped == _pack(write_parquet(tmp_path / "good.parquet", DOCUMENTS), tokenizer, tmp_path / "c")
    assert any("skipped 1 bad record(s) of 42" in line and "row 7" in line for line in logs), logs


def test_a_null_parquet_row_is_a_bad_record_named_by_its_row(tmp_path, tokenizer) -> None:
    documents = DOCUMENTS[:20] + [None] + DOCUMENTS[20:]
    source = write_parquet(tmp_path / "nulls.parquet", documents)
    with pytest.raises(ConfigError, match=r'nulls\.parquet row 20: its "text" is null$'):
        _pack(source, tokenizer, tmp_path / "c")
    logs: list[str] = []
    skipped = _pack(source, tokenizer, tmp_path / "c", logs, bad_records="skip", max_bad_fraction=0.05)
    assert skipped == _pack(write_parquet(tmp_path / "good.parquet", DOCUMENTS), tokenizer, tmp_path / "c")
    assert any("skipped 1 bad record(s) of 42" in line and "row 20" in line for line in logs), logs


def test_a_hugging_face_dataset_folder_packs_its_text_key(tmp_path, tokenizer, expected) -> None:
    assert _pack(write_hf_dataset(tmp_path / "ds", DOCUMENTS), tokenizer, tmp_path / "c") == expected
    with pytest.raises(ConfigError, match=r'ds has no "body" column \(its columns: id, text\)'):
        _pack(tmp_path / "ds", tokenizer, tmp_path / "c", text_key="body")


def test_a_dataset_dict_names_its_splits_and_one_split_is_read(tmp_path, tokenizer, expected) -> None:
    import datasets

    folder = tmp_path / "dd"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": DOCUMENTS}),
                          "test": datasets.Dataset.from_dict({"text": DOCUMENTS[:2]})}).save_to_disk(str(folder))
    with pytest.raises(ConfigError, match=rf"data\.source={folder} is a Hugging Face DatasetDict \(splits: test, "
                                          rf"train\), whose held-out splits would be trained on; name one split's "
                                          rf"folder, e.g\. data\.source={folder}/train$"):
        list_source(str(folder))
    assert _pack(folder / "train", tokenizer, tmp_path / "c") == expected
    # Inside a searched folder too: walked into, its test split would have been packed first.
    (tmp_path / "notes.txt").write_text("some text")
    with pytest.raises(ConfigError, match=rf"data\.source={tmp_path} holds {folder}, a Hugging Face DatasetDict "
                                          rf"\(splits: test, train\)"):
        list_source(str(tmp_path))


@pytest.mark.parametrize("dtype, eod, sequences", [(np.uint16, True, 1), (np.uint16, False, 3),
                                                   (np.int32, False, 1), (np.int32, True, 2)])
def test_a_megatron_pair_packs_its_documents_tokens(tmp_path, tokenizer, expected, dtype, eod, sequences) -> None:
    """Both dtypes preprocess_data.py writes, with and without --append-eod, documents of one sequence or
    several; named by PREFIX.bin, PREFIX.idx or PREFIX."""
    ids = [tokenizer.encode(doc) for doc in DOCUMENTS]
    bin_path = write_megatron(tmp_path / "corpus_text_document", ids, dtype,
                              tokenizer.eos_id if eod else None, sequences)
    for name in (bin_path, bin_path.with_suffix(".idx"), bin_path.with_suffix("")):
        assert _pack(name, tokenizer, tmp_path / "c") == expected


def test_megatron_pairs_are_checked_in_one_line(tmp_path, tokenizer) -> None:
    lone = tmp_path / "lone.bin"
    lone.write_bytes(b"\x00" * 8)
    with pytest.raises(ConfigError, match=r"data\.source=.*lone\.bin has no lone\.idx beside it: a Megatron"):
        list_source(str(lone))
    folder = tmp_path / "pairs"
    folder.mkdir()
    write_megatron(folder / "a", [[5, 6, 7]], np.uint16)
    (folder / "b.bin").write_bytes(b"\x00" * 8)
    with pytest.raises(ConfigError, match=r"b\.bin has no b\.idx beside it"):
        list_source(str(folder))
    wide = write_megatron(tmp_path / "wide", [[5, 6, 70_000]], np.int32)
    with pytest.raises(ConfigError, match=r"wide\.bin holds token id 70000, outside data\.tokenizer's 400 ids"):
        _pack(wide, tokenizer, tmp_path / "c")
    with pytest.raises(ConfigError, match=r"wide\.bin is a Megatron indexed dataset, already tokenized: set "
                                          r"data\.tokenizer"):
        prepare_dataset(str(wide), None, 512, tmp_path / "c", True, print)
    wide.with_suffix(".idx").write_bytes(wide.with_suffix(".idx").read_bytes()[:-8])
    with pytest.raises(ConfigError, match=r"wide\.idx is 54 bytes, but its header \(1 sequences, 2 document "
                                          r"indices\) makes it 62$"):
        _pack(wide, tokenizer, tmp_path / "c")
    wide.with_suffix(".idx").write_bytes(b"not an index at all")
    with pytest.raises(ConfigError, match=r"wide\.idx is not a Megatron index"):
        _pack(wide, tokenizer, tmp_path / "c")


def test_a_megatron_bin_with_a_stray_trailing_byte_reads_its_documents(tmp_path) -> None:
    """Nothing points at a trailing byte (a copy padded by some tool): the documents read as before, where
    mapping the whole .bin as tokens failed with numpy's size error naming no file. A pointer that is not
    a multiple of the token size would read shifted bytes as tokens: refused."""
    from trainer.data.megatron_indexed import IndexedDataset

    bin_path = write_megatron(tmp_path / "c", [[5, 6, 7], [8, 9]], np.uint16)
    bin_path.write_bytes(bin_path.read_bytes() + b"\x00")
    assert [ids.tolist() for ids in IndexedDataset(bin_path).documents()] == [[5, 6, 7], [8, 9]]
    index = bytearray(bin_path.with_suffix(".idx").read_bytes())
    second_pointer = 9 + 8 + 1 + 8 + 8 + 2 * 4 + 8  # header, then 2 lengths (int32), then pointers (int64)
    index[second_pointer] += 1
    bin_path.with_suffix(".idx").write_bytes(bytes(index))
    with pytest.raises(ConfigError, match=r"c\.idx has a sequence pointer that is not a multiple of its uint16 "
                                          r"token size: not a Megatron index$"):
        IndexedDataset(bin_path)


def test_an_unknown_kind_is_one_line_naming_the_kinds(tmp_path) -> None:
    source = tmp_path / "weights.safetensors"
    source.write_bytes(b"\x00\x01" * 100)
    with pytest.raises(ConfigError, match=r"is not one of the sources this trainer reads \(\.txt/.*\.parquet "
                                          r"files, Hugging Face dataset folders \(save_to_disk\) or Megatron"):
        list_source(str(source))


def test_a_folder_of_every_kind_packs_as_its_text_form(tmp_path, tokenizer) -> None:
    mixed = write_every_kind(tmp_path / "mixed", DOCUMENTS, tokenizer)
    files, left_out, _ = list_source(str(mixed))
    assert [p.name for p in files] == ["a.parquet", "b_hf", "c.bin", "d.jsonl.gz", "e.txt"]
    assert left_out == []  # c.idx is half of c's pair, not a file left out
    text = text_form_of_every_kind(tmp_path / "texts", DOCUMENTS)
    assert _pack(mixed, tokenizer, tmp_path / "c") == _pack(text, tokenizer, tmp_path / "c")


def test_a_tokenizer_is_trained_on_table_sources(tmp_path) -> None:
    """With no data.tokenizer, the BPE is trained on the text a table holds (the column, not the file)."""
    source = write_parquet(tmp_path / "docs.parquet", DOCUMENTS * 5)
    tokenizer, tokens = prepare_dataset(str(source), None, 320, tmp_path / "c", True, print)
    assert tokenizer.vocab_size == 320
    assert tokenizer.decode(tokenizer.encode(DOCUMENTS[3])) == DOCUMENTS[3]
    assert tokens.meta["num_documents"] == len(DOCUMENTS) * 5


def test_a_missing_reader_package_is_one_line(tmp_path, tokenizer, monkeypatch) -> None:
    source = write_parquet(tmp_path / "docs.parquet", DOCUMENTS)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # as if not installed
    with pytest.raises(ConfigError, match=r"data\.source: reading Parquet files needs the pyarrow package, which is "
                                          r"not installed \(pip install 'llm-trainer\[data\]'\)"):
        _pack(source, tokenizer, tmp_path / "c")


def test_a_vocabulary_above_65536_reads_int32_ids_and_packs_them_wider(tmp_path) -> None:
    """What preprocess_data.py writes for a large vocabulary (int32 ids past uint16's range) packs as
    the same documents' text does, in uint32."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {"<s>": 0, "</s>": 1, "[UNK]": 2} | {f"w{i}": i + 3 for i in range(70_000)}
    backend = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.save(str(tmp_path / "tokenizer.json"))
    tokenizer = load_tokenizer(tmp_path / "tokenizer.json")
    rng = np.random.default_rng(0)
    documents = [" ".join(f"w{i}" for i in rng.integers(0, 70_000, 30)) for _ in range(20)]
    expected = _pack(write_jsonl(tmp_path / "docs.jsonl", documents), tokenizer, tmp_path / "c")
    assert np.frombuffer(expected, np.uint32).max() > 65535
    ids = [tokenizer.encode(doc) for doc in documents]
    bin_path = write_megatron(tmp_path / "big", ids, np.int32, append_eod=tokenizer.eos_id, sequences_per_document=2)
    assert _pack(bin_path, tokenizer, tmp_path / "c") == expected
