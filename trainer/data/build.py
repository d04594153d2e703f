"""The data path's one entry: the run's config in; the tokenizer, the training and held-out loaders and the
fingerprint of the packed tokens out. Nothing above this module reaches into the stages behind it."""

from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from parallel import comm
from parallel.errors import ConfigError
from trainer.config.schema import TrainConfig
from trainer.config.vocab import vocab_padding
from trainer.data.loader import BatchLoader
from trainer.data.prepare import prepare_dataset
from trainer.data.records import RecordFormat
from trainer.data.sampler import GlobalBatchSampler, HeldOutSampler, split_windows
from trainer.data.tokenizer import Tokenizer, choose_tokenizer


class Data(NamedTuple):
    tokenizer: Tokenizer
    loader: BatchLoader  # the training batches
    eval_loader: BatchLoader | None  # the held-out batches (eval.freq > 0)
    fingerprint: dict[str, str]  # what a checkpoint records of the packed tokens


def build_data(cfg: TrainConfig, dp_rank: int, dp_size: int, rank: int, log: Callable[[str], None],
               resumed: Path | None, agree: Callable[[str], None] | None = None) -> Data:
    """This data-parallel rank's data. `rank`: the global rank (rank 0 prepares the cache); `resumed`: the
    checkpoint the run continues, whose copy of the tokenizer it keeps (None: a fresh start); `agree`: how
    the ranks check that they read the same data (None: same_data_on_every_rank, a collective; a process
    alone, scripts/inspect_data.py, has no peer to ask)."""
    choice = choose_tokenizer(cfg.data.tokenizer, cfg.checkpoint.init_from_hf, resumed)
    if choice.note:
        log(choice.note)
    tokenizer, tokens = prepare_dataset(
        cfg.data.source, choice.path, cfg.model.vocab_size, Path(cfg.data.cache_dir).expanduser(),
        is_main_rank=rank == 0, log=log, timeout_s=cfg.data.prepare_timeout_s, agree=agree or same_data_on_every_rank,
        tokenizer_key=choice.key, padding=vocab_padding(cfg),
        fmt=RecordFormat(cfg.data.text_key, cfg.data.bad_records, cfg.data.max_bad_fraction),
        workers=cfg.data.prepare_workers,
    )
    global_batch = cfg.batch_size * dp_size
    tokens.num_sequences(cfg.seq_len)  # refuses data shorter than one sequence in a line naming seq_len
    train_windows, held_out = split_windows(tokens.num_tokens, cfg.seq_len, cfg.data.held_out_fraction)
    sampler = GlobalBatchSampler(train_windows, global_batch, cfg.seed, cfg.data.held_out_fraction)
    log(sampler.epochs_line(cfg.steps))

    def loader(batches: GlobalBatchSampler | HeldOutSampler) -> BatchLoader:
        return BatchLoader(tokens, batches, cfg.seq_len, dp_rank, dp_size, cfg.microbatch_size, tokenizer.bos_id)

    if not cfg.eval.freq:
        return Data(tokenizer, loader(sampler), None, tokens.fingerprint())
    eval_sampler = HeldOutSampler(held_out, global_batch)
    if eval_sampler.num_batches < cfg.eval.steps:
        raise ConfigError(
            f"eval.steps={cfg.eval.steps} global batches of {global_batch} sequences need "
            f"{cfg.eval.steps * global_batch} held-out sequences, but data.held_out_fraction="
            f"{cfg.data.held_out_fraction} holds {len(held_out)}; lower eval.steps or raise the fraction"
        )
    return Data(tokenizer, loader(sampler), loader(eval_sampler), tokens.fingerprint())


def same_data_on_every_rank(cache_key: str) -> None:
    """The data cache key (source paths, sizes and mtimes, vocabulary, tokenizer) is every rank's."""
    keys = comm.all_gather_object(cache_key, comm.world())
    differing = [rank for rank, key in enumerate(keys) if key != keys[0]]
    if differing:
        raise ConfigError(
            f"data.source: rank {differing[0]} sees other source files or tokenizer than rank 0 (path, size or "
            f"modification time differ); every node needs the same files, with data.cache_dir shared")
