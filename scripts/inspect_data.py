"""Look inside the data a run would train on, with the same hydra overrides as train.py, in one plain process.

    python scripts/inspect_data.py [hydra overrides] [--steps N] [--show K] [--dp D] [--width W]

The config is composed as train.py composes it (conf/, the same override check and rules), and the data is
built as rank 0 builds it: a missing cache is prepared in data.cache_dir, where a later job finds it. The
global batch is batch_size x D, D being the run's data-parallel size (1 by default): every layout with that
global batch trains on the same sequences per step. For the first N global batches it prints each source's
share of tokens and of documents, the documents per sequence, the share of bos and eos tokens, for a blend of
sources each source's shares in every one of those global batches, and K of the sequences decoded, each bos
and eos marked. A bad override or config is one `error:` line, exit code 2.
"""

import sys
from pathlib import Path

# Scripts run from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse  # noqa: E402
from collections import Counter  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402

from parallel.errors import ConfigError  # noqa: E402
from parallel.launch_env import LaunchEnv  # noqa: E402
from trainer.checkpoint.resume import resumed_checkpoint  # noqa: E402
from trainer.config.cli import CONF_DIR, check_overrides, resolved  # noqa: E402
from trainer.config.hf_model import fill_hf_model  # noqa: E402
from trainer.config.rules import validate  # noqa: E402
from trainer.config.schema import TrainConfig, from_dict  # noqa: E402
from trainer.data.build import Data, build_data  # noqa: E402
from trainer.data.loader import document_starts  # noqa: E402
from trainer.data.tokenizer import Tokenizer  # noqa: E402

BOS_MARK, EOS_MARK, NEWLINE_MARK, CLIPPED_MARK = "⟨bos⟩", "⟨eos⟩", "↵", "…"
BOS_OR_EOS_MARK = "⟨bos/eos⟩"  # where they are one token
DEFAULT_WIDTH = 240
MAX_SEQUENCES = 10**6  # inspected sequences, all held at once: about a GB of Python objects at most


@dataclass
class Sequence:
    step: int
    index: int  # the window's index in the packed tokens
    source: str  # the data.source it came from
    ids: np.ndarray  # the seq_len input tokens the model reads


@dataclass
class Stats:
    tokens: Counter = field(default_factory=Counter)  # per source
    documents: Counter = field(default_factory=Counter)  # per source, a document counted where it starts (its bos)
    documents_per_sequence: list[int] = field(default_factory=list)
    bos: int = 0
    eos: int = 0
    bos_or_eos: int = 0  # tokens that are either (once each where bos and eos are one token, GPT-2's)
    one_token: bool = False  # bos and eos are the same id


def compose_config(overrides: list[str], dp: int) -> TrainConfig:
    """The config train.py would run with these overrides on a layout of data-parallel size `dp`."""
    check_overrides(overrides, LaunchEnv.from_torchrun(), hydra_flags=False)  # train.py's error line, exit 2
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        raw = compose(config_name="config", overrides=overrides)
    cfg = from_dict(fill_hf_model(resolved(raw)))
    # The model-parallel sizes come from the config; the world is what makes their product times dp.
    validate(cfg, dp * cfg.model_parallel_size * cfg.pipeline_parallel_size * cfg.context_parallel_size)
    return cfg


def inspected(cfg: TrainConfig, data: Data, steps: int) -> list[Sequence]:
    """The sequences of the first `steps` global batches, in training order, each with its source."""
    sampler, tokens = data.loader.sampler, data.loader.tokens
    return [Sequence(step, int(i), tokens.names[tokens.source_of(int(i))], tokens.sequence(int(i), cfg.seq_len)[:-1])
            for step in range(steps) for i in sampler.global_indices(step)]


def gather(sequences: list[Sequence], bos_id: int, eos_id: int) -> Stats:
    stats = Stats(one_token=bos_id == eos_id)
    for seq in sequences:
        starts = int(document_starts(torch.from_numpy(seq.ids)[None], bos_id, eos_id).sum())
        stats.tokens[seq.source] += len(seq.ids)
        stats.documents[seq.source] += starts
        stats.documents_per_sequence.append(starts)
        stats.bos += int(np.count_nonzero(seq.ids == bos_id))
        stats.eos += int(np.count_nonzero(seq.ids == eos_id))
        stats.bos_or_eos += int(np.count_nonzero((seq.ids == bos_id) | (seq.ids == eos_id)))
    return stats


def percent(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "n/a"


def batch_lines(sequences: list[Sequence], sources: list[str], bos_id: int, eos_id: int) -> list[str]:
    """A blend's shares in each global batch: the weights hold in every window of batches, not just overall."""
    lines = []
    for step in sorted({seq.step for seq in sequences}):
        stats = gather([seq for seq in sequences if seq.step == step], bos_id, eos_id)
        tokens, documents = sum(stats.tokens.values()), sum(stats.documents.values())
        shares = [f"{source} {percent(stats.tokens[source], tokens)} of tokens, "
                  f"{percent(stats.documents[source], documents)} of documents" for source in sources]
        lines.append(f"step {step}: " + "; ".join(shares))
    return lines


def stats_lines(stats: Stats) -> list[str]:
    total_tokens, total_documents = sum(stats.tokens.values()), sum(stats.documents.values())
    per_sequence = np.array(stats.documents_per_sequence)
    lines = [f"source {source}: {percent(count, total_tokens)} of tokens, "
             f"{percent(stats.documents[source], total_documents)} of documents"
             for source, count in stats.tokens.most_common()]
    lines.append(f"documents per sequence: mean {per_sequence.mean():.2f}, min {per_sequence.min()}, max "
                 f"{per_sequence.max()} (a document counts in the sequence that holds its bos)")
    split = ("bos and eos are one token" if stats.one_token else
             f"bos {percent(stats.bos, total_tokens)}, eos {percent(stats.eos, total_tokens)}")
    lines.append(f"bos/eos: {percent(stats.bos_or_eos, total_tokens)} of tokens ({split})")
    return lines


def marked_text(ids: np.ndarray, tokenizer: Tokenizer) -> str:
    """The tokens as text, each run between two bos/eos decoded on its own (a decoder drops special
    tokens, which would hide where one document ends and the next begins) and each bos and eos a mark."""
    marks = {tokenizer.bos_id: BOS_MARK, tokenizer.eos_id: EOS_MARK}
    if tokenizer.bos_id == tokenizer.eos_id:
        marks[tokenizer.bos_id] = BOS_OR_EOS_MARK
    parts, run = [], []
    for token in ids.tolist():
        if token in marks:
            parts += [tokenizer.decode(run), marks[token]]
            run = []
        else:
            run.append(token)
    return "".join([*parts, tokenizer.decode(run)])


def one_line(text: str, width: int) -> str:
    """Newlines as a mark so a sequence stays on its line; at most `width` characters."""
    text = text.replace("\n", NEWLINE_MARK)
    return text if len(text) <= width else text[: width - 1] + CLIPPED_MARK


def report(cfg: TrainConfig, data: Data, steps: int, show: int, width: int) -> list[str]:
    sequences = inspected(cfg, data, steps)
    global_batch = data.loader.sampler.global_batch_size
    lines = [f"inspect: steps 0-{steps - 1}, {steps} global batches of {global_batch} sequences x {cfg.seq_len} "
             f"tokens ({len(sequences)} sequences, {len(sequences) * cfg.seq_len} tokens)"]
    bos_id, eos_id = data.tokenizer.bos_id, data.tokenizer.eos_id
    lines += stats_lines(gather(sequences, bos_id, eos_id))
    sources = data.loader.tokens.names
    if len(sources) > 1:
        lines += batch_lines(sequences, sources, bos_id, eos_id)
    lines += [f"sequence {seq.index} (step {seq.step}): {one_line(marked_text(seq.ids, data.tokenizer), width)}"
              for seq in sequences[:show]]
    return lines


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="hydra overrides, as train.py takes them")
    parser.add_argument("--steps", type=int, default=1, metavar="N", help="global batches to inspect, from step 0")
    parser.add_argument("--show", type=int, default=2, metavar="K", help="sequences to print decoded")
    parser.add_argument("--dp", type=int, default=1, metavar="D", help="the run's data-parallel size")
    parser.add_argument("--width", type=int, default=DEFAULT_WIDTH, metavar="W",
                        help="characters of a decoded sequence at most")
    opts = parser.parse_args(argv)
    for name, least in (("steps", 1), ("show", 0), ("dp", 1), ("width", 2)):
        if getattr(opts, name) < least:
            raise ConfigError(f"--{name}={getattr(opts, name)} must be at least {least}")
    return opts


def main(argv: list[str] | None = None) -> int:
    try:
        opts = parse(argv)
        cfg = compose_config(opts.overrides, opts.dp)
        global_batch = cfg.batch_size * opts.dp
        if opts.steps * global_batch > MAX_SEQUENCES:  # 10**8 steps grew memory without end
            raise ConfigError(f"--steps={opts.steps} x {global_batch} sequences per step is more than the "
                              f"{MAX_SEQUENCES:,} sequences inspect_data holds at once")
        # Rank 0 of data-parallel rank 0: it prepares the cache, and the global batch is read whole.
        data = build_data(cfg, 0, opts.dp, 0, print, resumed_checkpoint(cfg), agree=lambda key: None)
        lines = report(cfg, data, opts.steps, opts.show, opts.width)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
