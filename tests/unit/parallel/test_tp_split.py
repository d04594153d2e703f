"""Tensor-parallel modules take only dimensions that split evenly over TP: a remainder (the last
vocabulary rows, features) would belong to no rank and come out as zeros."""

import pytest

from parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, TPContext, VocabParallelEmbedding


def test_a_dimension_that_does_not_split_over_tp_is_refused() -> None:
    tp = TPContext(size=2, rank=1)  # offline: a size and rank, no group
    assert VocabParallelEmbedding(512, 16, tp).vocab_start == 256
    assert ColumnParallelLinear(16, (32, 8, 8), tp).local_sizes == [16, 4, 4]
    assert RowParallelLinear(32, 16, tp).weight.shape == (16, 16)
    with pytest.raises(ValueError, match="vocab_size=511 does not split over tensor parallelism of size 2"):
        VocabParallelEmbedding(511, 16, tp)
    with pytest.raises(ValueError, match="out_features=9 does not split"):
        ColumnParallelLinear(16, (32, 9, 9), tp)
    with pytest.raises(ValueError, match="in_features=33 does not split"):
        RowParallelLinear(33, 16, tp)
