"""The interleaved order's microbatch group size: searched over pp..M, fastest at unit costs among the
sizes whose activations stay within 1F1B's plus vpp microbatches; and the one-line summary the trainer logs."""

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
    return sorted({1, pp - 1, pp, pp + 1, 2 * pp - 1, 3 * pp + 2, 5 * pp + 3, 8 * pp})


def test_the_group_is_the_fastest_within_the_memory_bound_and_its_peak_is_the_simulators():
    for pp in range(2, 9):
        for vpp in range(2, 5):
            for m in _sampled_counts(pp):
                group = S.interleaved_group(pp, vpp, m)
                sizes = range(min(pp, m), m + 1)
                limit = (min(pp, m) + vpp) * vpp
                spans = {g: S._interleaved_makespan(pp, vpp, m, g) for g in sizes
                         if S.interleaved_peak(pp, vpp, m, g) <= limit}
                valid = {g: span for g, span in spans.items() if span is not None}
                timeline = simulate(S.pipeline_actions("interleaved_1f1b", pp, vpp, m), pp, vpp)
                assert max(timeline.peak_in_flight) == S.interleaved_peak(pp, vpp, m, group), (pp, vpp, m)
                if valid:  # within the bound, and no size there finishes first
                    assert group in valid and valid[group] == min(valid.values()), (pp, vpp, m, group, valid)
                else:  # nothing within the bound schedules: the smallest size that does
                    assert all(S._interleaved_makespan(pp, vpp, m, g) is None for g in range(sizes[0], group))


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
    assert schedule_summary("1f1b", 8, 2, 61).endswith("would be faster")  # the simulator's transfers cost more
    assert "group" not in schedule_summary("1f1b", 4, 1, 8) and "\n" not in line
