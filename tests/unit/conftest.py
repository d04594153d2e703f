"""Fixtures shared by the unit tests."""

import pytest
import torch.distributed as dist


@pytest.fixture(scope="module")
def world():
    """A one-process gloo group (checkpoint I/O and FSDP need one), per test module."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()
