"""The deterministic-training switches: what enable_deterministic sets, and what it leaves to the user."""

import os

import pytest
import torch

from trainer.determinism import enable_deterministic


@pytest.fixture
def restore_torch_flags():
    flags = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
             torch.backends.cudnn.benchmark)
    yield
    torch.use_deterministic_algorithms(flags[0])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = flags[1], flags[2]


@pytest.mark.parametrize("user_algo, algo", [(None, "Ring"), ("Tree", "Tree"), ("Tree,Ring", "Ring"), ("^Tree", "Ring"),
                                             ("CollnetDirect", "CollnetDirect"), ("NVLS", "Ring"), ("nvlstree", "Ring"),
                                             ("PAT", "Ring")])
def test_cuda_switches_fill_in_what_the_environment_leaves_unset(monkeypatch, restore_torch_flags, user_algo, algo):
    """A user's single fixed-order NCCL algorithm is as deterministic as Ring; a list, an exclusion, or
    NVLS (reduced in the NVLink switch) is not."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.delenv("NCCL_ALGO", raising=False)
    monkeypatch.delenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", raising=False)
    if user_algo is not None:
        monkeypatch.setenv("NCCL_ALGO", user_algo)
    enable_deterministic("cuda")
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and os.environ["NCCL_ALGO"] == algo
    assert os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] == "0"
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark


def test_cpu_sets_no_cuda_environment(monkeypatch, restore_torch_flags):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.delenv("NCCL_ALGO", raising=False)
    monkeypatch.delenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", raising=False)
    enable_deterministic("cpu")
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ and "NCCL_ALGO" not in os.environ
    assert "NVTE_ALLOW_NONDETERMINISTIC_ALGO" not in os.environ
    assert torch.are_deterministic_algorithms_enabled()
