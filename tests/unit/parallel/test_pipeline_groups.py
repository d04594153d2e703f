"""The interleaved order's microbatch group size: searched over pp..M, fastest at unit costs among the
sizes whose activations stay within 1F1B's plus vpp microbatches (or Megatron's group of pp); against
plain 1F1B; and the one-line summary the trainer logs."""

import itertools
import time

from parallel.pipeline import schedule as S
from parallel.pipeline.simulate import simulate
from parallel.pipeline.summary import schedule_summary


def _one_f_one_b_makespan(pp: int, m: int) -> int:
    orders = [S.compute_order("1f1b", pp, 1, m, r) for r in range(pp)]
    return max(S._list_schedule(orders, pp, 1, "1f1b", m)[1].values())


def _bubble(schedule: str, pp: int, vpp: int, m: int) -> float:
    return simulate(S.pipeline_actions(schedule, pp, vpp, m), pp, vpp, sends_block=False).bubble_fraction


def _sampled_counts(pp: int):
    """M over 1..8pp, sampled (the whole grid takes ~100 s of CPU): around pp and 2pp, and counts that
    leave remainders of several kinds."""
    return sorted({1, pp - 1, pp, pp + 1, pp + 3, 2 * pp, 3 * pp + 2, 5 * pp + 3, 8 * pp} - {0})


def test_the_group_is_the_fastest_within_the_memory_bound_and_never_slower_than_1f1b_but_with_a_remainder():
    """The group: the fastest size within the bound, its peak the simulator's, and the search's clock
    the simulator's (NCCL runtime mode, unit costs). Against plain 1F1B, by the simulator's measure:
    never slower, but with vpp 2-3, pp >= 4 and M not a multiple of pp (a short last group idles the
    ranks, and larger groups exceed the memory bound), by under 5% of the step; the start line then
    says plain 1F1B would be faster, and names a group beyond the bound."""
    losses = []
    for pp, vpp in itertools.product(range(2, 9), range(2, 5)):
        for m in _sampled_counts(pp):
            group = S.interleaved_group(pp, vpp, m)
            sizes = range(min(pp, m), m + 1)
            # 1F1B's min(pp, M) + vpp microbatches, or Megatron's group of pp where it holds more.
            limit = max((min(pp, m) + vpp) * vpp, S.interleaved_peak(pp, vpp, m, min(pp, m)))
            spans = {g: S._interleaved_makespan(pp, vpp, m, g) for g in sizes
                     if S.interleaved_peak(pp, vpp, m, g) <= limit}
            valid = {g: span for g, span in spans.items() if span is not None}
            timeline = simulate(S.pipeline_actions("interleaved_1f1b", pp, vpp, m), pp, vpp, sends_block=False)
            assert max(timeline.peak_in_flight) == S.interleaved_peak(pp, vpp, m, group), (pp, vpp, m)
            assert timeline.makespan == valid.get(group, S._interleaved_makespan(pp, vpp, m, group))
            plain = _bubble("1f1b", pp, 1, m)
            slower = timeline.bubble_fraction > plain + 1e-9
            if valid:  # within the bound, and no size there finishes first
                assert group in valid and valid[group] == min(valid.values()), (pp, vpp, m, group, valid)
            else:  # nothing within the bound schedules: the smallest size that does
                assert all(S._interleaved_makespan(pp, vpp, m, g) is None for g in range(sizes[0], group))
            if slower:
                losses.append((pp, vpp, m))
                assert m % pp and m > pp and vpp <= 3 and pp >= 4, (pp, vpp, m)
                assert (1 - plain) / (1 - timeline.bubble_fraction) < 1.05, (pp, vpp, m)  # makespan ratio
            if slower or not valid or m == pp + 1:
                line = schedule_summary("1f1b", pp, vpp, m)
                assert line.endswith("would be faster" if slower else "would be no faster"), (pp, vpp, m)
                assert ("holds more than the memory bound" in line) == (not valid), (pp, vpp, m)
    assert losses  # the sample holds such cases (e.g. pp=5 vpp=2 M=8: groups 5 + 3)


def test_the_cases_one_group_of_all_microbatches_used_to_get():
    # pp=8 vpp=2 M=61 held 38 microbatches on rank 0 as one group of 61.
    assert S.interleaved_group(8, 2, 61) == 9 and S.interleaved_peak(8, 2, 61, 9) / 2 == 12
    assert S._interleaved_makespan(8, 2, 61, 9) / 2 < _one_f_one_b_makespan(8, 61)
    assert _bubble("interleaved_1f1b", 4, 2, 9) <= _bubble("1f1b", 4, 1, 9)
    peak = max(simulate(S.pipeline_actions("interleaved_1f1b", 4, 3, 29), 4, 3).peak_microbatches)
    assert peak <= 6 and _bubble("interleaved_1f1b", 4, 3, 29) <= _bubble("1f1b", 4, 1, 29)  # was 21.7


def test_the_search_stays_fast_for_hundreds_of_microbatches():
    for pp, vpp, m in ((8, 4, 300), (8, 2, 301)):
        S.interleaved_group.cache_clear()
        start = time.perf_counter()
        S.interleaved_group(pp, vpp, m)
        assert time.perf_counter() - start < 2.0, (pp, vpp, m)  # ~0.5 s alone; the box is shared


def test_the_summary_names_group_bubble_peak_and_the_1f1b_comparison():
    line = schedule_summary("1f1b", 4, 3, 29)
    assert line.startswith("pipeline schedule interleaved_1f1b: pp=4 vpp=3 microbatches=29 group=5, simulated bubble")
    assert "peak 5.67 microbatches held" in line and line.endswith("would be no faster")
    assert schedule_summary("1f1b", 5, 2, 8).endswith("would be faster")  # groups 5 + 3: the 3 idle the ranks
    assert "group" not in schedule_summary("1f1b", 4, 1, 8) and "\n" not in line
