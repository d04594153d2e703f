"""The interleaved order's microbatch groups: the warm-up group searched over pp..M with a few group
partitions each, fastest at unit costs among the orders whose activations stay within 1F1B's plus vpp
microbatches (or Megatron's group of pp), never slower than plain 1F1B; and the one-line summary the
trainer logs."""

import itertools

from parallel.pipeline import schedule as S, summary
from parallel.pipeline.simulate import simulate
from parallel.pipeline.summary import group_sizes, schedule_summary


def _one_f_one_b_makespan(pp: int, m: int) -> int:
    orders = [S.compute_order("1f1b", pp, 1, m, r) for r in range(pp)]
    return max(S._list_schedule(orders, pp, 1, "1f1b", m)[1].values())


def _bubble(schedule: str, pp: int, vpp: int, m: int) -> float:
    return simulate(S.pipeline_actions(schedule, pp, vpp, m), pp, vpp, sends_block=False).bubble_fraction


def _sampled_counts(pp: int):
    """M over 1..8pp, sampled (the whole grid takes minutes of CPU): around pp and 2pp, and counts that
    leave remainders of several kinds."""
    return sorted({1, pp - 1, pp, pp + 1, pp + 3, 2 * pp, 3 * pp + 2, 5 * pp + 3, 8 * pp} - {0})


def _candidates(pp: int, vpp: int, m: int, most: int):
    """(peak, makespan or None, groups, warm-up group) of every order the search may pick that holds at
    most `most` chunk activations."""
    for w in range(min(pp, m), m + 1):
        if S.interleaved_peak(pp, vpp, m, w) > most:
            continue
        for groups in S.interleaved_partitions(m, w):
            assert sum(groups) == m and max(groups) <= w and min(groups) >= 1
            yield S.interleaved_peak(pp, vpp, m, w), S._interleaved_makespan(pp, vpp, groups, w), groups, w


def test_the_order_is_never_slower_than_1f1b_and_the_fastest_within_the_memory_bound():
    """By the simulator (NCCL runtime mode, unit costs): the order's peak is interleaved_peak's, its
    makespan the search's clock, and it is never slower than plain 1F1B. Within the bound it is the
    fastest order, at the smallest peak among the fastest; over it, no order within the bound is as
    fast as plain 1F1B, nothing with a smaller peak is, and the start line says so."""
    overs = 0
    for pp, vpp in itertools.product(range(2, 9), range(2, 5)):
        for m in _sampled_counts(pp):
            groups, w = S.interleaved_groups(pp, vpp, m)
            peak = S.interleaved_peak(pp, vpp, m, w)
            timeline = simulate(S.pipeline_actions("interleaved_1f1b", pp, vpp, m), pp, vpp, sends_block=False)
            assert max(timeline.peak_in_flight) == peak, (pp, vpp, m)
            assert timeline.makespan == S._interleaved_makespan(pp, vpp, groups, w), (pp, vpp, m)
            plain = _one_f_one_b_makespan(pp, m) * vpp  # a chunk costs 1/vpp of a stage
            assert timeline.makespan <= plain and timeline.bubble_fraction <= _bubble("1f1b", pp, 1, m) + 1e-9
            # 1F1B's min(pp, M) + vpp microbatches, or Megatron's group of pp where it holds more.
            limit = max((min(pp, m) + vpp) * vpp, S.interleaved_peak(pp, vpp, m, min(pp, m)))
            candidates = [c for c in _candidates(pp, vpp, m, max(peak, limit)) if c[1] is not None]
            within = [c for c in candidates if c[0] <= limit]
            if peak <= limit:
                fastest = min(span for _, span, _, _ in within)
                assert timeline.makespan == fastest, (pp, vpp, m, groups, w)
                assert peak == min(p for p, span, _, _ in within if span == fastest), (pp, vpp, m)
            else:
                overs += 1
                assert all(span > plain for _, span, _, _ in within), (pp, vpp, m)
                assert all(span > plain for p, span, _, _ in candidates if p < peak), (pp, vpp, m)
            if peak > limit or m == pp + 1:
                line = schedule_summary("1f1b", pp, vpp, m)
                assert f" groups={group_sizes(groups)}" in line and line.endswith("would be no faster")
                assert ("holds more than the memory bound" in line) == (peak > limit), (pp, vpp, m)
    assert overs  # the sample holds such cases (e.g. pp=8 vpp=2 M=13)


def test_partitions_other_than_megatrons_win_where_m_is_no_multiple_of_pp():
    # Megatron's groups of 5 + 3 idle the ranks; 3 + 5, the short group first, does not.
    assert S._interleaved_makespan(5, 2, (5, 3), 5) > 2 * _one_f_one_b_makespan(5, 8)
    assert S.interleaved_groups(5, 2, 8) == ((3, 5), 5)
    assert S._interleaved_makespan(5, 2, (3, 5), 5) <= 2 * _one_f_one_b_makespan(5, 8)
    assert S.interleaved_partitions(21, 8) == [(8, 8, 5), (5, 8, 8), (7, 7, 7)]
    assert S.interleaved_partitions(16, 8) == [(8, 8)] and S.interleaved_partitions(13, 4) == [
        (4, 4, 4, 1), (1, 4, 4, 4), (3, 3, 3, 4)]
    assert group_sizes((1, 5, 5, 5)) == "1+5*3" and group_sizes((5, 5, 4)) == "5*2+4"


def test_the_cases_one_group_of_all_microbatches_used_to_get():
    # pp=8 vpp=2 M=61 held 38 microbatches on rank 0 as one group of 61.
    groups, w = S.interleaved_groups(8, 2, 61)
    assert S.interleaved_peak(8, 2, 61, w) / 2 == 12
    assert S._interleaved_makespan(8, 2, groups, w) / 2 < _one_f_one_b_makespan(8, 61)
    assert _bubble("interleaved_1f1b", 4, 2, 9) <= _bubble("1f1b", 4, 1, 9)
    peak = max(simulate(S.pipeline_actions("interleaved_1f1b", 4, 3, 29), 4, 3).peak_microbatches)
    assert peak <= 6 and _bubble("interleaved_1f1b", 4, 3, 29) <= _bubble("1f1b", 4, 1, 29)  # was 21.7


def test_the_search_stays_short_for_hundreds_of_microbatches(monkeypatch):
    """Counted in list schedules, not seconds (one is ~0.1 s at M=300 and pp=8)."""
    evaluated = []
    makespan = S._interleaved_makespan
    monkeypatch.setattr(S, "_interleaved_makespan", lambda *args: evaluated.append(args) or makespan(*args))
    for pp, vpp, m, most in ((8, 4, 296, 1), (8, 4, 300, 8), (8, 2, 301, 8)):
        S.interleaved_groups.cache_clear()
        evaluated.clear()
        S.interleaved_groups(pp, vpp, m)
        assert 1 <= len(evaluated) <= most, (pp, vpp, m, len(evaluated))
    S.interleaved_groups.cache_clear()


def test_the_summary_names_groups_bubble_peak_and_the_1f1b_comparison(monkeypatch):
    line = schedule_summary("1f1b", 4, 3, 29)
    assert line.startswith("pipeline schedule interleaved_1f1b: pp=4 vpp=3 microbatches=29 groups=5*5+4, "
                           "simulated bubble")
    assert "peak 5.67 microbatches held" in line and line.endswith("would be no faster")
    assert " (it holds more than the memory bound" in schedule_summary("1f1b", 8, 2, 13)
    assert "group" not in schedule_summary("1f1b", 4, 1, 8) and "\n" not in line
    assert "peak 1234 microbatches held" in schedule_summary("gpipe", 2, 1, 1234)  # not 1.23e+03
    # An order slower than 1F1B (Megatron's groups of 5 + 3) is reported as such.
    megatrons = lambda pp, vpp, m: ((5, 3), 5)  # noqa: E731
    monkeypatch.setattr(S, "interleaved_groups", megatrons)
    monkeypatch.setattr(summary, "interleaved_groups", megatrons)
    S.pipeline_actions.cache_clear()
    try:
        line = schedule_summary("1f1b", 5, 2, 8)
    finally:
        S.pipeline_actions.cache_clear()
    assert " groups=5+3, " in line and line.endswith("would be faster")
