"""Fixtures shared by the unit tests."""

import json
import random
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.distributed.pipeline_cases import forget_meshes

WORDS = ["def", "return", "self", "value", "import", "class", "for", "in", "über", "naïve", "数据", "x", "y"]


@pytest.fixture(scope="module")
def world():
    """A one-process gloo group (checkpoint I/O and FSDP need one), per test module."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    forget_meshes()
    dist.destroy_process_group()


def write_corpus(folder: Path) -> Path:
    """A tiny deterministic corpus in every supported format, plus a file that must be ignored."""
    rng = random.Random(0)

    def text(lines: int) -> str:
        return "\n".join(" ".join(rng.choice(WORDS) for _ in range(8)) for _ in range(lines)) + "\n"

    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text(text(60))
    (folder / "sub" / "b.py").write_text("def f(x):\n    return x + 1\n" + text(40))
    (folder / "c.md").write_text("# Title\n\n" + text(30))
    docs = [{"text": text(5)}, {"text": "short doc"}, {"text": text(3)}]
    (folder / "d.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    (folder / "ignored.bin").write_bytes(b"\x00\x01")
    return folder


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus"))
