"""Each pipeline rank's FSDP units and their flat-parameter sizes, from the model built on the meta device.

A rank's chunks are those trainer.parallelize builds (the same layer split); each unit's size is its
FlatParamSpec's, the layout FSDP flattens and shards (parallel/fsdp/flat_param.py). Block units all hold
the same TP-local parameters, so one meta block gives every block's size.
"""

from dataclasses import dataclass
from functools import lru_cache

import torch

from model.transformer import Transformer
from parallel.fsdp.flat_param import FlatParamSpec
from parallel.pipeline.layers import chunk_layers, rank_stages
from parallel.tensor_parallel import TPContext
from trainer.config.schema import ModelConfig, TrainConfig


@dataclass(frozen=True)
class UnitSizes:
    """TP-local parameter counts of one FSDP unit of each kind."""

    embedding: int
    block: int
    head: int  # the output head unit; with tied embeddings in one chunk, its norm only


@lru_cache(maxsize=256)
def unit_sizes(model: ModelConfig, tp: int, embedding_and_head_together: bool) -> UnitSizes:
    context = TPContext(size=tp, rank=0)
    with torch.device("meta"):
        first = Transformer(model, context, range(1), embedding=True, head=embedding_and_head_together)
        last = first if embedding_and_head_together else Transformer(model, context, range(0), embedding=False,
                                                                     head=True)
    numel = {name: FlatParamSpec.of_module(module.get_submodule(name), 1).total
             for module, name in ((first, "tok_embeddings"), (first, "layers.0"), (last, "head"))}
    return UnitSizes(numel["tok_embeddings"], numel["layers.0"], numel["head"])


@dataclass(frozen=True)
class Chunk:
    """One model chunk of a rank: its blocks and whether it holds the embedding or the head."""

    blocks: int
    embedding: bool
    head: bool

    def unit_numels(self, sizes: UnitSizes) -> list[int]:
        """TP-local parameters of each unit, in forward order."""
        return [*([sizes.embedding] if self.embedding else []), *([sizes.block] * self.blocks),
                *([sizes.head] if self.head else [])]


def rank_chunks(cfg: TrainConfig, pp_rank: int) -> list[Chunk]:
    pp, vpp, v_shape = cfg.pipeline_parallel_size, cfg.virtual_pipeline_stages, cfg.pipeline_v_shape
    ends = cfg.pipeline_first_stage_layers, cfg.pipeline_last_stage_layers
    stages = rank_stages(pp, vpp, pp_rank, v_shape)
    return [Chunk(len(chunk_layers(cfg.model.n_layers, pp, vpp, pp_rank, c, *ends, v_shape=v_shape)),
                  embedding=stage == 0, head=stage == pp * vpp - 1) for c, stage in enumerate(stages)]


def parameter_counts(model: ModelConfig) -> dict[str, int]:
    """The whole model's parameters: total and the embedding table (the head is counted apart from it
    unless tied)."""
    sizes = unit_sizes(model, 1, model.tie_embeddings)
    return {"total": sizes.embedding + model.n_layers * sizes.block + sizes.head, "embedding": sizes.embedding}
