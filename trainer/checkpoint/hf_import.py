"""Start training from a Hugging Face Llama folder (`checkpoint.init_from_hf=PATH`): its weights.

The folder holds config.json and safetensors (one `model.safetensors`, or shards listed in
`model.safetensors.index.json`, as published Llama-3 models ship); hf_folder.py has checked that it
describes the configured model. Each rank reads, through safetensors' lazy slices, only the boxes of
the full parameters its FSDP shards hold (parallel/fsdp/state_dict.py), so any layout imports without
a rank ever holding a whole model.
"""

from collections.abc import Callable
from pathlib import Path

import torch

from model.args import ModelArgs
from model.hf import hf_names
from model.transformer import VOCAB_PARAMETERS
from parallel.errors import ConfigError
from parallel.fsdp import FSDPRoot
from parallel.fsdp.state_dict import Box, full_shape, shard_boxes
from parallel.fsdp.tied import aliases
from parallel.fsdp.unit import FSDPUnit
from trainer.checkpoint.hf_folder import (KEY, check_architecture, context_note, open_safetensors, read_hf_config,
                                          tensor_files)


class HFReader:
    """HF tensors, whole or sliced, each file opened once."""

    def __init__(self, folder: Path):
        self.folder, self.files = folder, tensor_files(folder)
        self._open: dict[Path, object] = {}

    def slice(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        return self._file(name).get_slice(name)[index]

    def tensor(self, name: str) -> torch.Tensor:
        return self._file(name).get_tensor(name)

    def _file(self, name: str) -> object:
        """The open file that holds `name`."""
        if name not in self.files:
            raise ConfigError(f"{KEY}={self.folder}: tensor {name} is missing")
        path = self.files[name]
        if path not in self._open:
            self._open[path] = open_safetensors(self.folder, path)
        return self._open[path]


def _fill_box(reader: HFReader, name: str, parts: tuple[int, ...], box: Box, view: torch.Tensor) -> None:
    """Copy a box of our full parameter from its HF part(s), stacked along dim 0."""
    start = 0
    for hf_name, size in zip(hf_names(name), parts):
        lo, hi = max(box.offsets[0], start), min(box.offsets[0] + box.sizes[0], start + size)
        if lo < hi:
            rest = tuple(slice(o, o + s) for o, s in zip(box.offsets[1:], box.sizes[1:]))
            piece = reader.slice(hf_name, (slice(lo - start, hi - start), *rest))
            view[lo - box.offsets[0] : hi - box.offsets[0]].copy_(piece)
        start += size


def _import_unit(reader: HFReader, unit: FSDPUnit, folder_vocab: int) -> None:
    """`folder_vocab`: the folder's vocabulary rows, the first of the model's (whose further rows, padding,
    stay as initialized: zero)."""
    local = unit.flat_param.detach()
    boxes = shard_boxes(unit.spec, unit.rank, unit.tp_splits, unit.tp.rank, unit.tp.size)
    names = aliases(unit)  # a tied head's copy reads the embedding
    for param, shape, split in zip(unit.spec.names, unit.spec.shapes, unit.tp_splits):
        name = f"{unit.name}.{param}"
        parts = split.parts or (full_shape(tuple(shape), split, unit.tp.size)[0],)
        if name in VOCAB_PARAMETERS:
            parts = (folder_vocab,)
        for box in boxes.get(param, []):
            view = local[box.start : box.start + box.numel].view(box.sizes)
            _fill_box(reader, names.get(param, name), parts, box, view)


def import_hf(folder: Path, roots: list[FSDPRoot], args: ModelArgs, log: Callable[[str], None]) -> None:
    """Overwrite this rank's shards with the folder's weights (optimizer state stays fresh), and log it. A
    tied folder (tie_word_embeddings) imports only into a tied model (check_architecture), its embedding
    as the one weight of both."""
    config = read_hf_config(folder)
    check_architecture(config, args, folder)
    reader = HFReader(folder)
    with torch.no_grad():
        for root in roots:
            for unit in root.units:
                _import_unit(reader, unit, config["vocab_size"])
    log(f"initialized the weights from {folder}")
    note = context_note(config, args, folder)
    if note:
        log(note)
