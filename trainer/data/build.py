"""The data path's one entry: the run's config in; the tokenizer, the training and held-out loaders and the
fingerprint of the packed tokens out. Nothing above this module reaches into the stages behind it.
A list of sources is prepared source by source (each its own cache) and blended by data.weights."""

from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from parallel import comm
from parallel.errors import ConfigError
from trainer.config.data_sources import DEFAULT_CORPUS
from trainer.config.schema import TrainConfig
from trainer.config.vocab import vocab_padding
from trainer.data.blend import BlendedTokens, BlendOrder, blend_fingerprint, blend_quotas
from trainer.data.loader import BatchLoader
from trainer.data.prepare import prepare_dataset
from trainer.data.records import RecordFormat
from trainer.data.sampler import BlendedBatchSampler, GlobalBatchSampler, HeldOutSampler, split_windows
from trainer.data.sources import check_disjoint
from trainer.data.tokenizer import Tokenizer, choose_tokenizer


class Data(NamedTuple):
    tokenizer: Tokenizer
    loader: BatchLoader  # the training batches
    eval_loader: BatchLoader | None  # the held-out batches (eval.freq > 0)
    fingerprint: dict  # what a checkpoint records of the packed tokens and the blend's weights


def build_data(cfg: TrainConfig, dp_rank: int, dp_size: int, rank: int, log: Callable[[str], None],
               resumed: Path | None, agree: Callable[[str], None] | None = None) -> Data:
    """This data-parallel rank's data. `rank`: the global rank (rank 0 prepares the cache); `resumed`: the
    checkpoint the run continues, whose copy of the tokenizer it keeps (None: a fresh start); `agree`: how
    the ranks check that they read the same data (None: same_data_on_every_rank, a collective; a process
    alone, scripts/inspect_data.py, has no peer to ask)."""
    tokenizer, tokens = prepare_sources(cfg, rank, log, resumed, agree or same_data_on_every_rank)
    global_batch = cfg.batch_size * dp_size
    splits = [split_windows(part.num_tokens, cfg.seq_len, cfg.data.held_out_fraction) for part in tokens.parts]
    weights = cfg.data.weights or [part.num_tokens for part in tokens.parts]
    order = BlendOrder(blend_quotas(weights))
    if len(tokens.parts) == 1:
        sampler = GlobalBatchSampler(splits[0][0], global_batch, cfg.seed, cfg.data.held_out_fraction)
    else:
        sampler = BlendedBatchSampler([train for train, _ in splits], tokens.offsets, order, global_batch, cfg.seed,
                                      tokens.names)
    log(sampler.epochs_line(cfg.steps))
    fingerprint = blend_fingerprint([part.fingerprint() for part in tokens.parts], order.weights)

    def loader(batches: GlobalBatchSampler | HeldOutSampler) -> BatchLoader:
        return BatchLoader(tokens, batches, cfg.seq_len, dp_rank, dp_size, cfg.microbatch_size, tokenizer.bos_id,
                           tokenizer.eos_id)

    if not cfg.eval.freq:
        return Data(tokenizer, loader(sampler), None, fingerprint)
    held_out = [range(int(offset) + held.start, int(offset) + held.stop)
                for offset, (_, held) in zip(tokens.offsets, splits)]
    eval_sampler = HeldOutSampler(held_out, global_batch, order)
    if eval_sampler.num_batches < cfg.eval.steps:
        holds = (f"holds {len(held_out[0])}" if len(held_out) == 1 else
                 f"holds {', '.join(str(len(h)) for h in held_out)} of the sources (blended by their weights, "
                 f"{eval_sampler.num_windows} before one runs out)")
        raise ConfigError(
            f"eval.steps={cfg.eval.steps} global batches of {global_batch} sequences need "
            f"{cfg.eval.steps * global_batch} held-out sequences, but data.held_out_fraction="
            f"{cfg.data.held_out_fraction} {holds}; lower eval.steps or raise the fraction"
        )
    return Data(tokenizer, loader(sampler), loader(eval_sampler), fingerprint)


def prepare_sources(cfg: TrainConfig, rank: int, log: Callable[[str], None], resumed: Path | None,
                     agree: Callable[[str], None]) -> tuple[Tokenizer, BlendedTokens]:
    """Each source's packed tokens, prepared (and cached) on its own, all with one tokenizer: the one
    chosen, or else the one trained on the first source. What a job prepares before it trains."""
    choice = choose_tokenizer(cfg.data.tokenizer, cfg.checkpoint.init_from_hf, resumed)
    if choice.note:
        log(choice.note)
    path, key, origin = choice.path, choice.key, choice.origin
    names = [source or DEFAULT_CORPUS for source in cfg.data.sources]
    if len(names) > 1:
        check_disjoint(cfg.data.sources)
    parts = []
    for i, source in enumerate(cfg.data.sources):
        tokenizer, tokens = prepare_dataset(
            source, path, cfg.model.vocab_size, Path(cfg.data.cache_dir).expanduser(), is_main_rank=rank == 0,
            log=log, timeout_s=cfg.data.prepare_timeout_s, agree=agree, tokenizer_key=key, tokenizer_origin=origin,
            padding=vocab_padding(cfg), workers=cfg.data.prepare_workers,
            fmt=RecordFormat(cfg.data.text_key, cfg.data.bad_records, cfg.data.max_bad_fraction),
        )
        parts.append(tokens)
        if path is None and len(names) > 1:
            path, key = str(tokenizer.path), f"the tokenizer trained on data.source[{i}]={names[i]}"
            origin = key
            log(f"data: every source of the blend is tokenized with {key}")
    # BlendedTokens refuses data shorter than one sequence in a line naming seq_len (and the source).
    return tokenizer, BlendedTokens(names, parts, cfg.seq_len)


def same_data_on_every_rank(cache_key: str) -> None:
    """The data cache key (source paths, sizes and mtimes, vocabulary, tokenizer) is every rank's."""
    keys = comm.all_gather_object(cache_key, comm.world())
    differing = [rank for rank, key in enumerate(keys) if key != keys[0]]
    if differing:
        raise ConfigError(
            f"data.source: rank {differing[0]} sees other source files or tokenizer than rank 0 (path, size or "
            f"modification time differ); every node needs the same files, with data.cache_dir shared")
