"""The exported tokenizer of a sentencepiece model given in data.tokenizer that numbers and names its
special tokens otherwise than ours (bos 3 named <bos>, pad 1) and adds sentencepiece's dummy prefix
space: transformers reads it to the training's ids, and config.json carries those ids. Tokenizers
transformers would read otherwise are named; special tokens' text inside a document ("</s>" in code)
stays ordinary text for both."""

import json
import random

import sentencepiece as spm
import transformers

from model.args import ModelArgs
from model.hf import hf_config
from scripts.export_hf import NORMALIZATION_PROBES, tokenization_difference, write_tokenizer
from trainer.data.tokenizer_spm import SentencePieceTokenizer

TEXT = "the pipeline shards the gradient\n" * 40 + "tokens per rank and per step\n" * 40
_WORDS = "the pipeline shards gradient tokens per rank step reduce scatter gather unit optimizer checkpoint".split()
# Lines of random words: enough choice for a unigram model's segmentation to differ from BPE's.
MIXED_TEXT = "".join(" ".join(random.Random(i).choices(_WORDS, k=10)) + "\n" for i in range(400))


def test_custom_special_tokens_reach_transformers(tmp_path):
    (tmp_path / "corpus.txt").write_text(TEXT)
    spm.SentencePieceTrainer.Train(
        input=str(tmp_path / "corpus.txt"), model_prefix=str(tmp_path / "custom"), vocab_size=60, model_type="bpe",
        unk_id=0, pad_id=1, eos_id=2, bos_id=3, bos_piece="<bos>", minloglevel=2,
        normalization_rule_name="identity", remove_extra_whitespaces=False)  # as Llama 2's tokenizer
    tokenizer = SentencePieceTokenizer(tmp_path / "custom.model")
    assert (tokenizer.bos_id, tokenizer.piece(tokenizer.bos_id)) == (3, "<bos>")
    out = tmp_path / "hf"
    out.mkdir()
    write_tokenizer(tokenizer, out)
    hf = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer.adds_prefix_space  # sentencepiece's default, as in Llama 2's tokenizer
    for text in ("the gradient per rank", "pipeline", "tokens  per step"):
        assert hf(text).input_ids == [3, *tokenizer.encode(text)], text
    config = hf_config(ModelArgs(), "float32", tokenizer.bos_id, tokenizer.eos_id)
    assert (config["bos_token_id"], config["eos_token_id"]) == (3, 2)
    assert json.loads((out / "tokenizer_config.json").read_text())["bos_token"] == "<bos>"


def test_a_tokenizer_transformers_would_read_otherwise_is_not_exported(tmp_path):
    """sentencepiece's default normalization (NFKC, runs of whitespace collapsed) is not what transformers'
    Llama tokenizer applies, without byte fallback transformers drops what training sees as <unk>, and
    a unigram model (sentencepiece's default type) it segments as BPE: each is named, where the BPE
    with identity normalization and byte fallback (ours) agrees on every probe."""
    (tmp_path / "corpus.txt").write_text(MIXED_TEXT)
    identity = {"normalization_rule_name": "identity", "remove_extra_whitespaces": False}
    agree = {}
    fallback = {"byte_fallback": True, "vocab_size": 300}  # 256 byte pieces and the corpus's own
    cases = (("ours", identity | fallback), ("nfkc", fallback), ("no_fallback", identity | {"vocab_size": 60}),
             ("unigram", identity | fallback | {"model_type": "unigram", "hard_vocab_limit": False}))
    for name, options in cases:
        spm.SentencePieceTrainer.Train(input=str(tmp_path / "corpus.txt"), model_prefix=str(tmp_path / name),
                                       **({"model_type": "bpe", "minloglevel": 2} | options))
        tokenizer = SentencePieceTokenizer(tmp_path / f"{name}.model")
        (tmp_path / name).mkdir()
        write_tokenizer(tokenizer, tmp_path / name)
        hf = transformers.AutoTokenizer.from_pretrained(tmp_path / name)
        agree[name] = all(hf(text).input_ids[1:] == tokenizer.encode(text)
                          for text in (*NORMALIZATION_PROBES, "\u2603 \u20ac", *MIXED_TEXT.splitlines()[:5],
                                       "a<s>b</s>c<unk>d", "print('</s>')"))
        difference = tokenization_difference(tokenizer)
        assert (difference is None) == agree[name], (name, difference)
    assert agree == {"ours": True, "nfkc": False, "no_fallback": False, "unigram": False}
