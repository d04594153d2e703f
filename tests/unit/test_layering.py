"""The tree's layering, read from the imports themselves (function-level imports included):
`parallel/` knows nothing above it, `model/` nothing of `trainer/`, the data path runs one way, and no
source file outgrows one concept."""

import ast
from pathlib import Path

import pytest

from tests import REPO

# trainer/data's modules in the order data flows; each may import only those before it.
DATA_ORDER = ("temp_dirs", "heartbeat", "compression", "megatron_indexed", "tables", "sources", "records", "tokenizer_spm",
              "tokenizer_hf", "tokenizer_tiktoken", "tokenizer", "encode_pool", "progress", "shards", "cache", "prepare", "shuffle", "blend", "sampler", "loader", "build")
# What trainer/data may use of the rest of the trainer: the config it is given and the output names.
DATA_MAY_IMPORT = ("trainer.data", "trainer.config", "trainer.outputs")
MAX_LINES = 400


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports, anywhere in the file (`from a.b import c` counts as a.b and a.b.c)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def sources(folder: str) -> list[Path]:
    return sorted((REPO / folder).rglob("*.py"))


def top_packages(path: Path) -> set[str]:
    return {name.split(".")[0] for name in imported_modules(path)}


@pytest.mark.parametrize("folder, forbidden", [("parallel", {"model", "trainer", "planner"}),
                                               ("model", {"trainer", "planner"}), ("trainer", {"planner"})])
def test_a_lower_layer_imports_nothing_above_it(folder, forbidden):
    offenders = {str(p.relative_to(REPO)): sorted(top_packages(p) & forbidden) for p in sources(folder)}
    assert not {k: v for k, v in offenders.items() if v}


def test_the_data_path_runs_one_way():
    modules = {p.stem for p in (REPO / "trainer" / "data").glob("*.py")} - {"__init__"}
    assert modules == set(DATA_ORDER), "a new data module needs its place in DATA_ORDER"
    for stage in DATA_ORDER:
        imports = imported_modules(REPO / "trainer" / "data" / f"{stage}.py")
        later = [name for name in DATA_ORDER[DATA_ORDER.index(stage):] if f"trainer.data.{name}" in imports]
        assert not later, f"trainer/data/{stage}.py imports {later}, which come at or after it"
        outside = [name for name in imports if name.startswith("trainer") and not name.startswith(DATA_MAY_IMPORT)]
        assert not outside, f"trainer/data/{stage}.py reaches outside the data path: {outside}"


def test_no_source_file_outgrows_one_concept():
    files = [p for folder in ("parallel", "model", "trainer", "planner", "scripts") for p in sources(folder)]
    long = {str(p.relative_to(REPO)): n for p in files if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long
