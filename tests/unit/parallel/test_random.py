"""TP-aware RNG: inside TP regions draws differ per TP rank (reproducibly), outside they are shared,
and a region leaves the shared stream exactly where it was."""

import torch

from parallel.random import RNGStreams

CPU = torch.device("cpu")


def draws(tp_rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    streams = RNGStreams(seed=0, tp_rank=tp_rank, device=CPU)
    before = torch.rand(4)
    with streams.tp_region():
        inside = torch.nn.functional.dropout(torch.ones(16), p=0.5)
    after = torch.rand(4)
    return before, inside, after


def test_tp_regions_differ_per_rank_and_shared_stream_is_untouched():
    r0, r1, r0_again = draws(0), draws(1), draws(0)
    assert torch.equal(r0[0], r1[0]) and torch.equal(r0[2], r1[2])  # shared stream: identical on all ranks
    assert not torch.equal(r0[1], r1[1])  # TP region: different dropout masks per rank
    assert all(torch.equal(a, b) for a, b in zip(r0, r0_again))  # and reproducible
    torch.manual_seed(0)
    no_region = torch.rand(4), torch.rand(4)
    assert torch.equal(r0[2], no_region[1])  # the region consumed nothing from the shared stream


def test_state_round_trip_resumes_both_streams():
    torch.manual_seed(0)
    streams = RNGStreams(seed=0, tp_rank=1, device=CPU)
    with streams.tp_region():
        torch.rand(3)
    saved = streams.state()
    expected_shared = torch.rand(2)
    with streams.tp_region():
        expected_tp = torch.rand(2)
    restored = RNGStreams(seed=99, tp_rank=0, device=CPU)
    restored.load_state(saved)
    assert torch.equal(torch.rand(2), expected_shared)
    with restored.tp_region():
        assert torch.equal(torch.rand(2), expected_tp)


def test_each_layout_of_a_world_keys_its_own_streams():
    """Same world, tp and pp, but another cp or replica count: another layout, whose ranks must not
    inherit these streams on a resume."""
    from parallel.mesh import ParallelDims
    from trainer.checkpoint.state import rng_key

    layouts = [ParallelDims.from_sizes(8, 2, 2, 1, 1), ParallelDims.from_sizes(8, 2, 2, 2, 1),
               ParallelDims.from_sizes(8, 2, 2, 1, 2)]
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert len({rng_key(3, layout, cpu) for layout in layouts}) == 3
    assert rng_key(3, layouts[0], cpu) == "rank3_of_8_tp2_pp2_cp1_dpr1"  # the key CPU checkpoints always had
    assert rng_key(3, layouts[0], cuda) != rng_key(3, layouts[0], cpu)  # other generator states


def test_the_tp_stream_is_seeded_by_seed_and_tp_rank():
    streams = RNGStreams(seed=5, tp_rank=1, device=CPU)
    with streams.tp_region():
        inside = torch.rand(3)
    assert torch.equal(inside, torch.rand(3, generator=torch.Generator().manual_seed(5 + 2718 + 1)))
