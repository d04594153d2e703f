"""Every tokenizer format behind one interface gives the ids transformers' AutoTokenizer gives for the same
files (special-token text kept as text, as training keeps it), is told apart by content, and names what
is wrong with a file in one line."""

import shutil
from pathlib import Path

import pytest

from parallel.errors import ConfigError
from tests.llama3_folder import learned_ranks, write_hf_tokenizer, write_tiktoken
from trainer.data.prepare import prepare_dataset
from trainer.data.tokenizer import load_tokenizer, tokenizer_file
from trainer.data.tokenizer_spm import SentencePieceTokenizer, train_tokenizer
from trainer.data.tokenizer_tiktoken import LLAMA3_SPECIALS, NUM_SPECIAL_TOKENS

TEXT = ("def f(x):\n    return x  # naïve über 数据 🚀\r\n\t<|end_of_text|> <s></s> <|begin_of_text|>\n"
        "  indented   spaces and 12345 digits")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """A Llama-3-style folder (tokenizer.json + original/tokenizer.model), a tiktoken-only folder and a
    sentencepiece folder as the HF export writes it."""
    root = tmp_path_factory.mktemp("tokenizers")
    ranks = learned_ranks()
    llama = root / "llama3"
    write_hf_tokenizer(write_tiktoken(ranks, llama / "original" / "tokenizer.model"), llama)
    tiktoken_only = root / "tiktoken"
    shutil.copytree(llama / "original", tiktoken_only)
    spm = root / "spm"
    corpus = root / "corpus.txt"
    corpus.write_text(TEXT * 20 + "".join(f"line {i} with words\n" for i in range(300)))
    model = train_tokenizer([corpus], 320, spm / "tokenizer.model")
    from scripts.export_hf import write_tokenizer

    write_tokenizer(SentencePieceTokenizer(model), spm)
    return {"huggingface": llama, "tiktoken": tiktoken_only, "sentencepiece": spm}


def auto_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), split_special_tokens=True)


@pytest.mark.parametrize("kind", ["huggingface", "tiktoken", "sentencepiece"])
def test_each_format_gives_transformers_ids(folders, kind):
    ours = load_tokenizer(folders[kind])
    assert ours.kind == kind
    reference = folders["huggingface"] if kind == "tiktoken" else folders[kind]  # converted from the same file
    theirs = auto_tokenizer(reference)
    ids = ours.encode(TEXT)
    assert ids == theirs.encode(TEXT, add_special_tokens=False)
    assert ours.encode_batch([TEXT, "x"]) == ours.encode_batch([TEXT, "x"], num_threads=1) == [ids, ours.encode("x")]
    assert (ours.bos_id, ours.eos_id) == (theirs.bos_token_id, theirs.eos_token_id)
    assert ours.vocab_size == len(theirs)
    assert ours.decode(ids) == TEXT and ours.adds_bos


def test_llama3_special_tokens_follow_the_ranks(folders):
    tiktoken = load_tokenizer(folders["tiktoken"])
    hf = load_tokenizer(folders["huggingface"])
    ranks = tiktoken.vocab_size - NUM_SPECIAL_TOKENS
    assert (tiktoken.bos_id, tiktoken.eos_id) == (hf.bos_id, hf.eos_id) == (ranks, ranks + 1)
    assert tiktoken.decode([ranks + LLAMA3_SPECIALS.index("<|eot_id|>")]) == "<|eot_id|>"
    assert "<|end_of_text|>" in TEXT and tiktoken.eos_id not in tiktoken.encode(TEXT)  # text stays text


def test_the_format_is_read_from_the_content_not_the_name(folders, tmp_path):
    """Llama 3's tiktoken file is named tokenizer.model, as sentencepiece models are; any name works."""
    for kind, folder in folders.items():
        renamed = tmp_path / f"{kind}.bin"
        shutil.copyfile(tokenizer_file(folder), renamed)
        if kind == "huggingface":
            shutil.copyfile(folder / "tokenizer_config.json", tmp_path / "tokenizer_config.json")
        assert load_tokenizer(renamed).kind == kind
    assert tokenizer_file(folders["huggingface"]).name == "tokenizer.json"  # preferred over original/
    assert tokenizer_file(folders["tiktoken"]).name == "tokenizer.model"


def test_what_checkpoints_carry_loads_back_as_the_same_tokenizer(folders, tmp_path):
    for kind, folder in folders.items():
        tokenizer = load_tokenizer(folder)
        copy = tmp_path / kind
        copy.mkdir()
        for name, data in tokenizer.files.items():
            (copy / name).write_bytes(data)
        again = load_tokenizer(copy)
        assert (again.kind, again.sha256, again.encode(TEXT)) == (kind, tokenizer.sha256, tokenizer.encode(TEXT))


def test_bad_tokenizer_files_are_one_line(tmp_path):
    with pytest.raises(ConfigError, match=rf"^data.tokenizer={tmp_path}/nope does not exist$"):
        load_tokenizer(tmp_path / "nope")
    junk = tmp_path / "tokenizer.model"
    junk.write_bytes(b"\x00\x01 not a tokenizer")
    with pytest.raises(ConfigError, match=r"^data.tokenizer=.*/tokenizer.model is none of the formats this trainer "
                                          r"reads \(a sentencepiece model, a Hugging Face tokenizer.json or a "
                                          r"tiktoken BPE file\)$"):
        load_tokenizer(tmp_path)
    broken = tmp_path / "broken.json"
    broken.write_text('{"model": 3}')
    with pytest.raises(ConfigError, match=r"^checkpoint.init_from_hf's tokenizer=.*broken.json is not a Hugging "
                                          r"Face tokenizer.json"):
        load_tokenizer(broken, "checkpoint.init_from_hf's tokenizer")


def test_a_special_tokens_map_naming_other_tokens_is_refused(folders, tmp_path):
    """transformers lets special_tokens_map.json override tokenizer_config.json's bos and eos: an instruct
    folder whose map says <|eot_id|> would have packed documents with another eos than transformers reads."""
    import json

    folder = tmp_path / "instruct"
    shutil.copytree(folders["huggingface"], folder)
    agreeing = {"bos_token": "<|begin_of_text|>", "eos_token": {"content": "<|end_of_text|>"}}
    (folder / "special_tokens_map.json").write_text(json.dumps(agreeing))
    assert load_tokenizer(folder).eos_id == auto_tokenizer(folder).eos_token_id
    (folder / "special_tokens_map.json").write_text(json.dumps(agreeing | {"eos_token": "<|eot_id|>"}))
    assert auto_tokenizer(folder).eos_token == "<|eot_id|>"
    with pytest.raises(ConfigError, match=r"^data.tokenizer=.*tokenizer.json: its special_tokens_map.json names "
                                          r"eos_token '<\|eot_id\|>', but the eos read here is '<\|end_of_text\|>'"):
        load_tokenizer(folder)


def test_a_tokenizer_json_that_saved_truncation_and_padding_packs_whole_documents(folders, tmp_path):
    """Such a file (a max_length kept by some releases, an embedding tokenizer's padding) cut every
    document to max_length, or padded it with pad ids that depended on how documents fell into batches
    (the package's thread pool pads a batch, one-by-one encoding does not)."""
    from tokenizers import Tokenizer

    folder = tmp_path / "saved_settings"
    shutil.copytree(folders["huggingface"], folder)
    saved = Tokenizer.from_file(str(folder / "tokenizer.json"))
    saved.enable_truncation(max_length=8)
    saved.enable_padding(pad_id=0, pad_token="!")
    saved.save(str(folder / "tokenizer.json"))
    plain, tokenizer = load_tokenizer(folders["huggingface"]), load_tokenizer(folder)
    assert len(plain.encode(TEXT)) > 8 and tokenizer.encode(TEXT) == plain.encode(TEXT)
    texts = ["short", TEXT]
    assert tokenizer.encode_batch(texts, num_threads=2) == tokenizer.encode_batch(texts, num_threads=1) == \
        [plain.encode(t) for t in texts]
    assert tokenizer.encode_reading_special_tokens(TEXT)[:9] == plain.encode_reading_special_tokens(TEXT)[:9]
    assert len(tokenizer.encode_reading_special_tokens(TEXT)) > 8
    source = tmp_path / "doc.txt"
    source.write_text(TEXT)
    _, tokens = prepare_dataset(str(source), str(folder), tokenizer.vocab_size, tmp_path / "cache", True,
                                lambda line: None)
    assert tokens.sequence(0, tokens.num_tokens - 1).tolist() == [tokenizer.bos_id, *plain.encode(TEXT),
                                                                  tokenizer.eos_id]


@pytest.mark.parametrize("kind", ["huggingface", "tiktoken"])
def test_packing_with_a_given_tokenizer_writes_bos_document_eos(folders, kind, tmp_path):
    source = tmp_path / "doc.txt"
    source.write_text(TEXT)
    tokenizer = load_tokenizer(folders[kind])
    tok, tokens = prepare_dataset(str(source), str(folders[kind]), tokenizer.vocab_size, tmp_path / "cache", True,
                                  lambda line: None)
    assert tok.sha256 == tokenizer.sha256 == tokens.meta["tokenizer_sha256"]
    packed = tokens.sequence(0, tokens.num_tokens - 1).tolist()
    assert packed == [tokenizer.bos_id, *tokenizer.encode(TEXT), tokenizer.eos_id]
    with pytest.raises(ConfigError, match=rf"^model.vocab_size=7 is below the tokenizer's vocabulary size "
                                          rf"{tokenizer.vocab_size} \(data.tokenizer=.*\): "):
        prepare_dataset(str(source), str(folders[kind]), 7, tmp_path / "cache", True, lambda line: None)


@pytest.mark.parametrize("kind", ["huggingface", "tiktoken"])
def test_the_export_gives_transformers_the_runs_ids(folders, kind, tmp_path):
    """scripts/export_hf.py writes each tokenizer in its own format; a tiktoken file also as the
    tokenizer.json transformers converts from it, so AutoTokenizer loads the export with the run's ids."""
    from scripts.export_hf import tokenization_difference, write_tokenizer

    ours = load_tokenizer(folders[kind])
    assert tokenization_difference(ours) is None
    write_tokenizer(ours, tmp_path)
    theirs = auto_tokenizer(tmp_path)
    assert theirs.encode(TEXT, add_special_tokens=False) == ours.encode(TEXT)
    assert theirs.encode("x")[0] == ours.bos_id  # a prompt starts with bos, as every packed document does
    assert load_tokenizer(tmp_path).sha256 == ours.sha256 if kind == "huggingface" else \
        (tmp_path / "original" / "tokenizer.model").read_bytes() == ours.model_bytes
