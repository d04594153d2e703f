"""Tokenizer throughput: MB/s encoding the default corpus (the standard library's source) for each format the
trainer reads, next to transformers' AutoTokenizer on the same files, side by side in one run.

    python scripts/bench/tokenizer_throughput.py [--mb 8] [--vocab 8192] [--threads 2] [--quick]

The formats share one vocabulary where they can: a byte-level BPE learned from the corpus is written as a
tiktoken ranks file and converted to tokenizer.json by transformers (how Llama 3's files relate); the
sentencepiece model is the one the trainer builds for the corpus. Every pair must give the same ids on
the measured text (the script says where they differ), so the rates compare equal work; the reference
for the sentencepiece model is AutoTokenizer on the folder scripts/export_hf.py writes for it. The
packer encodes documents in batches (encode_batch); so does each measurement here.
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from trainer.data.prepare import prepare_dataset  # noqa: E402
from trainer.data.records import iter_documents  # noqa: E402
from trainer.data.sources import default_corpus_files  # noqa: E402
from trainer.data.tokenizer import load_tokenizer  # noqa: E402
from tests.llama3_folder import learned_ranks, write_tiktoken  # noqa: E402
from trainer.data.tokenizer_tiktoken import write_hf_files  # noqa: E402

CACHE = REPO / ".cache" / "data"


def corpus_documents(megabytes: float) -> list[str]:
    """The first `megabytes` of the default corpus, document by document."""
    documents, size = [], 0
    for path in default_corpus_files():
        for document in iter_documents(path):
            documents.append(document)
            size += len(document.encode())
            if size >= megabytes * 1e6:
                return documents
    return documents


def rate(encode, documents: list[str], repeats: int) -> tuple[float, list[list[int]]]:
    """Best MB/s of `repeats` runs of encode(documents), and the ids."""
    megabytes = sum(len(d.encode()) for d in documents) / 1e6
    best, ids = float("inf"), []
    for _ in range(repeats):
        start = time.perf_counter()
        ids = encode(documents)
        best = min(best, time.perf_counter() - start)
    return megabytes / best, ids


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=8.0, help="megabytes of the corpus to encode")
    parser.add_argument("--vocab", type=int, default=8192, help="the learned BPE's vocabulary")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="0.3 MB, a 1024-token BPE, one repeat")
    opts = parser.parse_args(argv)
    megabytes, vocab, repeats = (0.3, 1024, 1) if opts.quick else (opts.mb, opts.vocab, 3)
    from transformers import AutoTokenizer

    from scripts.export_hf import write_tokenizer

    documents = corpus_documents(megabytes)
    folder = Path(tempfile.mkdtemp(prefix="bench_tokenizers_"))
    write_hf_files(write_tiktoken(learned_ranks(vocab, documents), folder / "tokenizer.model"), folder)
    spm, _ = prepare_dataset(None, None, 512, CACHE, True, lambda line: None)
    (folder / "spm").mkdir()
    write_tokenizer(spm, folder / "spm")
    rows = [("tokenizer.json (tokenizers)", load_tokenizer(folder / "tokenizer.json"), folder),
            ("tiktoken ranks (tiktoken)", load_tokenizer(folder / "tokenizer.model"), folder),
            ("sentencepiece .model", spm, folder / "spm")]
    print(f"{sum(len(d.encode()) for d in documents) / 1e6:.1f} MB in {len(documents)} documents, "
          f"{opts.threads} threads\n\n| format | ours MB/s | AutoTokenizer MB/s | ours / AutoTokenizer | same ids |")
    print("|---|---|---|---|---|")
    for name, tokenizer, reference in rows:
        auto = AutoTokenizer.from_pretrained(str(reference), split_special_tokens=True)
        theirs_rate, theirs_ids = rate(lambda texts: auto(texts, add_special_tokens=False)["input_ids"], documents,
                                       repeats)
        ours_rate, ours_ids = rate(lambda texts: tokenizer.encode_batch(texts, opts.threads), documents, repeats)
        print(f"| {name} | {ours_rate:.2f} | {theirs_rate:.2f} | {ours_rate / theirs_rate:.2f}x | "
              f"{ours_ids == theirs_ids} |")


if __name__ == "__main__":
    main()
