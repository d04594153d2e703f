"""The documentation ships with the project and keeps up with it: every config key is in the reference,
and nothing in the repository points outside it."""

import re
import subprocess

import yaml

from tests import REPO

GROUPS = {"model": "model", "data": "data", "optim": "optim", "checkpoint": "checkpoint"}


def _flat(prefix: str, node: dict) -> list[str]:
    keys = []
    for key, value in node.items():
        name = f"{prefix}{key}"
        keys += _flat(f"{name}.", value) if isinstance(value, dict) else [name]
    return keys


def config_keys() -> set[str]:
    top = yaml.safe_load((REPO / "conf" / "config.yaml").read_text())
    keys = set(_flat("", {k: v for k, v in top.items() if k not in ("defaults", "hydra")}))
    for folder, prefix in GROUPS.items():
        for file in (REPO / "conf" / folder).glob("*.yaml"):
            keys |= set(_flat(f"{prefix}.", yaml.safe_load(file.read_text())))
    return keys


def test_every_config_key_is_in_the_reference():
    reference = (REPO / "docs" / "config.md").read_text()
    missing = sorted(key for key in config_keys() if f"`{key}`" not in reference)
    assert not missing, f"docs/config.md lacks {missing}"


def test_nothing_points_outside_the_repository():
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    outside = re.compile(r"\.\./shared|shared/DESIGN|DESIGN\.md")
    for name in files:
        path = REPO / name
        if path.suffix not in (".py", ".md", ".sh", ".yaml", ".toml", ".sbatch", ".txt", "") or not path.is_file():
            continue
        text = path.read_text(errors="ignore")
        if name == "tests/unit/test_docs.py":
            continue
        assert not outside.search(text), f"{name} refers to a file outside the repository"
        if path.suffix == ".md":  # relative links must resolve inside the repository
            for target in re.findall(r"\]\(([^)#:]+)\)", text):
                resolved = (path.parent / target).resolve()
                assert resolved.is_relative_to(REPO) and resolved.exists(), f"{name} links to {target}"


def _heading_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives a page's headings: lowercased, punctuation but hyphens dropped, spaces to hyphens."""
    headings = re.findall(r"^#+ (.*)$", markdown, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.replace("`", "").strip().lower()).replace(" ", "-") for h in headings}


def test_every_link_anchor_names_a_heading_of_its_page():
    """A heading renamed (a model added to its title) leaves links to the old anchor landing at the page top."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        text = page.read_text()
        for target, anchor in re.findall(r"\]\(([^)#:\s]*)#([^)\s]+)\)", text):
            linked = (page.parent / target).resolve() if target else page
            if linked.suffix == ".md" and anchor not in _heading_anchors(linked.read_text()):
                broken.append(f"{page.relative_to(REPO)} -> {target}#{anchor}")
    assert not broken, broken
