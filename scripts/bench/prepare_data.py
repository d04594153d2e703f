"""Data preparation throughput: MB/s of text packed into tokens, one process vs worker processes, for the
sentencepiece and tokenizer.json kinds, next to the `tokenizers` library's own batch encoding of the same
text (in memory: no reading, no packing), side by side in one run.

    python scripts/bench/prepare_data.py [--mb 200] [--default-mb 0] [--vocab 8192] [--workers N] [--repeats R]
                                         [--quick]

Two corpora: the default one (the standard library's source; --default-mb caps it, 0: whole) and one of
--mb MB generated from it (documents of its lines drawn at random with a fixed seed, as .jsonl files).
Each row packs the corpus with write_packed_tokens three ways: one process with one tokenizer thread, one
process with the tokenizer's own threads (every core), and --workers processes (default: every usable
core); the three must write the same bytes (the script says where not). With --repeats R, the three ways
take turns R times and each keeps its best rate, so a load that comes and goes weighs on all three alike.
The tokenizer.json is a byte-level BPE learned from the corpus (Llama 3's kind); the sentencepiece model
is a BPE trained on it.
"""

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.llama3_folder import learned_ranks, write_tiktoken  # noqa: E402
from trainer.data.prepare import usable_cores  # noqa: E402
from trainer.data.records import iter_documents  # noqa: E402
from trainer.data.shards import TOKENS_FILE, write_packed_tokens  # noqa: E402
from trainer.data.sources import default_corpus_files, sources_fingerprint  # noqa: E402
from trainer.data.tokenizer import load_tokenizer  # noqa: E402
from trainer.data.tokenizer_spm import SentencePieceTokenizer, train_tokenizer  # noqa: E402
from trainer.data.tokenizer_tiktoken import write_hf_files  # noqa: E402

DOCUMENT_BYTES = 4096  # a generated document's size, about a source file's
FILES = 16  # the generated corpus' .jsonl files


def default_corpus(megabytes: float) -> list[Path]:
    """The default corpus' files, the first `megabytes` of them (0: all)."""
    files, size = [], 0
    for path in default_corpus_files():
        files.append(path)
        size += path.stat().st_size
        if megabytes and size >= megabytes * 1e6:
            break
    return files


def generated_corpus(folder: Path, megabytes: float, lines: list[str]) -> list[Path]:
    """`megabytes` of .jsonl documents, each of lines drawn from `lines` with a fixed seed."""
    rng, folder_files, target = random.Random(0), [], megabytes * 1e6 / FILES
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(FILES):
        path, size = folder / f"part{i:02d}.jsonl", 0
        with open(path, "w") as out:
            while size < target:
                document = "".join(rng.choice(lines) for _ in range(DOCUMENT_BYTES // 40))
                record = json.dumps({"text": document}) + "\n"
                out.write(record)
                size += len(record.encode())
        folder_files.append(path)
    return folder_files


def text_megabytes(files: list[Path]) -> tuple[float, list[str]]:
    documents = [doc for path in files for doc in iter_documents(path)]
    return sum(len(doc.encode()) for doc in documents) / 1e6, documents


def pack_rate(files: list[Path], tokenizer, out: Path, megabytes: float, threads: int,
              workers: int) -> tuple[float, bytes]:
    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    write_packed_tokens(files, tokenizer, out, lambda line: None, threads, sources=sources_fingerprint(files),
                        workers=workers)
    seconds = time.perf_counter() - start
    return megabytes / seconds, (out / TOKENS_FILE).read_bytes()


def reference_rate(backend, documents: list[str], megabytes: float) -> float:
    start = time.perf_counter()
    backend.encode_batch(documents, add_special_tokens=False)
    return megabytes / (time.perf_counter() - start)


def measure(files: list[Path], tokenizer, backend, documents: list[str], megabytes: float, out: Path,
            ways: list[tuple[int, int]], repeats: int) -> tuple[list[float], float, bool]:
    """The best rate of each way (tokenizer threads, worker processes), taking turns `repeats` times; the
    reference's best rate; whether every way wrote the same bytes."""
    best, packed = [0.0] * len(ways), [b""] * len(ways)
    for _ in range(repeats):
        for i, (threads, workers) in enumerate(ways):
            rate, packed[i] = pack_rate(files, tokenizer, out, megabytes, threads, workers)
            best[i] = max(best[i], rate)
    reference = max(reference_rate(backend, documents, megabytes) for _ in range(repeats))
    return best, reference, all(p == packed[0] for p in packed)


def tokenizers_under_test(folder: Path, sample: list[str], vocab: int) -> list[tuple[str, object, object]]:
    """(name, the trainer's tokenizer, the `tokenizers` library's Tokenizer for the same vocabulary)."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    from scripts.export_hf import write_tokenizer

    write_hf_files(write_tiktoken(learned_ranks(vocab, sample), folder / "bpe" / "tokenizer.model"), folder / "bpe")
    (folder / "sample.txt").write_text("".join(sample))
    spm = SentencePieceTokenizer(train_tokenizer([folder / "sample.txt"], vocab, folder / "spm" / "spm.model"))
    write_tokenizer(spm, folder / "spm")
    spm_backend = AutoTokenizer.from_pretrained(str(folder / "spm")).backend_tokenizer
    return [("sentencepiece .model", spm, spm_backend),
            ("tokenizer.json", load_tokenizer(folder / "bpe" / "tokenizer.json"),
             Tokenizer.from_file(str(folder / "bpe" / "tokenizer.json")))]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=200.0, help="size of the generated corpus, MB")
    parser.add_argument("--default-mb", type=float, default=0.0, help="cap on the default corpus, MB (0: whole)")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--workers", type=int, default=usable_cores())
    parser.add_argument("--repeats", type=int, default=1, help="turns of the three ways; the best rate of each")
    parser.add_argument("--quick", action="store_true", help="1 MB of each corpus, a 1024-token vocabulary")
    opts = parser.parse_args(argv)
    mb, default_mb, vocab = (1.0, 1.0, 1024) if opts.quick else (opts.mb, opts.default_mb, opts.vocab)
    folder = Path(tempfile.mkdtemp(prefix="bench_prepare_"))
    try:
        default_files = default_corpus(default_mb)
        default_size, default_docs = text_megabytes(default_files)
        sample = default_docs[: max(1, len(default_docs) // 8)] if not opts.quick else default_docs
        lines = [line for doc in sample for line in doc.splitlines(keepends=True) if line.strip()]
        generated = generated_corpus(folder / "generated", mb, lines)
        generated_size, generated_docs = text_megabytes(generated)
        corpora = [("default", default_files, default_size, default_docs),
                   ("generated", generated, generated_size, generated_docs)]
        rows = tokenizers_under_test(folder, sample, vocab)
        cores = usable_cores()
        print(f"{cores} usable cores; vocabulary {vocab}\n")
        print(f"| corpus | tokenizer | 1 process, 1 thread MB/s | 1 process, {cores} threads MB/s | {opts.workers} "
              "workers MB/s | workers / 1 thread | tokenizers batch MB/s | same bytes |")
        print("|---|---|---|---|---|---|---|---|")
        for corpus, files, size, documents in corpora:
            for name, tokenizer, backend in rows:
                ways = [(1, 1), (cores, 1), (1, opts.workers)]  # (tokenizer threads, worker processes)
                (one, threads, pooled), reference, same = measure(files, tokenizer, backend, documents, size,
                                                                  folder / "out", ways, opts.repeats)
                print(f"| {corpus} ({size:.0f} MB) | {name} | {one:.2f} | {threads:.2f} | {pooled:.2f} | "
                      f"{pooled / one:.2f}x | {reference:.2f} | {same} |", flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
