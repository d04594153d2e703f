"""The test suite: unit (one process), distributed (gloo ranks), e2e (torchrun train.py), gpu (CUDA only).

REPO is the repository root, wherever a test file sits in the tree."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
