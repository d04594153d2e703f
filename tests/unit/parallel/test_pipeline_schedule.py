"""Schedules as data: validity, deadlock freedom under any timing, FSDP marks, bubbles and memory
against the analytic values and against torch.distributed.pipelining's interleaved order."""

import itertools
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

from parallel.errors import ConfigError
from parallel.pipeline import schedule as S
from parallel.pipeline.layers import rank_stages, stage_place
from parallel.pipeline.runtime import PipelineRuntime
from parallel.pipeline.schedule import Action, pipeline_actions, schedule_actions
from parallel.pipeline.simulate import ScheduleError, random_costs, simulate, uniform_costs
from tests import REPO


def _cases():
    """Every schedule on pp 1-5 and 8 (odd pp: the wrap-around link's own channel), 1-4 chunks per rank, and
    microbatch counts from 1 (fewer than pp) up: to 3pp, and past 2pp for pp 8."""
    for pp, vpp in itertools.product((1, 2, 3, 4, 5, 8), (1, 2, 3, 4)):
        for schedule in S.SCHEDULES:
            if (schedule in ("interleaved_1f1b", "zbv")) == (vpp > 1) and (schedule != "zbv" or vpp == 2):
                for m in range(1, (2 * pp + 2 if pp == 8 else 3 * pp) + 1):
                    yield schedule, pp, vpp, m


def test_every_schedule_is_valid_and_never_deadlocks():
    for schedule, pp, vpp, m in _cases():
        programs = pipeline_actions(schedule, pp, vpp, m)
        for rank, program in enumerate(programs):
            computes = [(a.op, a.chunk, a.microbatch) for a in program if a.is_compute]
            ops = "FBW" if S.splits_backward(schedule) else "FB"
            expected = {(op, c, mb) for op in ops for c in range(vpp) for mb in range(m)}
            assert sorted(computes) == sorted(expected), (schedule, pp, vpp, m, rank)  # each exactly once
            for op, c, mb in computes:
                if op in "BW":  # every backward after its own forward, every W after its own B
                    before = "F" if op == "B" else "B"
                    assert computes.index((before, c, mb)) < computes.index((op, c, mb))
            assert all(a.rank == rank for a in program)
        # Timings of every kind: the simulator raises on a deadlock or on a compute without its input.
        v_shape = S.v_shaped(schedule)
        for seed in range(3):
            simulate(programs, pp, vpp, random_costs(seed), v_shape=v_shape)
        simulate(programs, pp, vpp, uniform_costs(1.0, 1.0, 0.5), v_shape=v_shape)


def test_sends_and_receives_pair_up_in_order():
    """Per direction between two ranks, the i-th send carries what the i-th receive expects."""
    for schedule, pp, vpp, m in _cases():
        programs = pipeline_actions(schedule, pp, vpp, m)
        channels: dict[tuple, list] = {}
        for program in programs:
            for a in program:
                if not a.is_compute:
                    sender, receiver = (a.rank, a.peer) if a.op.startswith("SEND") else (a.peer, a.rank)
                    side = "send" if a.op.startswith("SEND") else "recv"
                    channels.setdefault((sender, receiver, side), []).append(
                        S.transfer_key(a, pp, pp * vpp, S.v_shaped(schedule)))
        for (sender, receiver, side), keys in channels.items():
            if side == "send":
                assert keys == channels[(sender, receiver, "recv")], (schedule, pp, vpp, m, sender, receiver)


def test_each_chunks_backwards_start_and_end_with_the_marked_microbatches():
    """The runtime marks `is_first_microbatch` / `is_last_microbatch` from the program: a chunk's first
    backward is its first forward's microbatch (whose flat gradient becomes FSDP's accumulator, and where
    TE overwrites main_grad), its last backward the last forward's (which reduces)."""
    for schedule, pp, vpp, m in _cases():
        for program in pipeline_actions(schedule, pp, vpp, m):
            for chunk in range(vpp):
                forwards = [a.microbatch for a in program if a.op == "F" and a.chunk == chunk]
                backwards = [a.microbatch for a in program if a.op == "B" and a.chunk == chunk]
                assert forwards[0] == backwards[0] == 0 and forwards[-1] == backwards[-1] == m - 1, (
                    schedule, pp, vpp, m)


def test_the_runtime_refuses_a_program_whose_first_backward_is_not_the_first_microbatch():
    program = list(pipeline_actions("gpipe", 1, 1, 3)[0])
    b0, b1 = (i for i, a in enumerate(program) if a.op == "B" and a.microbatch in (0, 1))
    program[b0], program[b1] = program[b1], program[b0]
    with pytest.raises(ValueError, match="first backward must be of the microbatch it runs forward first"):
        PipelineRuntime(program, 1, [], [], None, (1, 1, 1), torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("costs", [(1.0, 2.0), (1.0, 1.0), (2.0, 3.0)])
def test_gpipe_and_1f1b_bubbles_are_analytic(costs):
    for schedule, pp, vpp, m in _cases():
        if schedule not in ("gpipe", "1f1b"):
            continue
        timeline = simulate(pipeline_actions(schedule, pp, vpp, m), pp, vpp, uniform_costs(*costs))
        assert timeline.bubble_fraction == pytest.approx((pp - 1) / (m + pp - 1), abs=1e-12), (schedule, pp, m)
        peak = max(timeline.peak_microbatches)
        assert peak == (m if schedule == "gpipe" else min(pp, m)), (schedule, pp, m, peak)


def _torch_interleaved_orders(pp: int, vpp: int, m: int) -> list[list[Action]]:
    """torch.distributed.pipelining's ScheduleInterleaved1F1B compute order, read from its action lists."""
    sched = object.__new__(ScheduleInterleaved1F1B)  # its __init__ wants real stages; the order does not
    sched.pp_group_size, sched.n_local_stages, sched._n_microbatches = pp, vpp, m
    sched.number_of_rounds = max(1, m // pp)
    sched.microbatches_per_round = m // sched.number_of_rounds
    orders = []
    for rank in range(pp):
        ops = [a for a in sched._calculate_single_rank_operations(rank) if a is not None]
        orders.append([
            Action(rank, "F" if a.computation_type == _ComputationType.FORWARD else "B", a.stage_index // pp,
                   a.microbatch_index)
            for a in ops
        ])
    return orders


def _bubble_of_orders(orders, pp: int, vpp: int, m: int, costs) -> float:
    original = S.compute_order
    S.compute_order = lambda schedule, pp_, vpp_, m_, rank: orders[rank]
    S.pipeline_actions.cache_clear()
    try:
        return simulate(S.pipeline_actions("interleaved_1f1b", pp, vpp, m), pp, vpp, uniform_costs(*costs)).bubble_fraction
    finally:
        S.compute_order = original
        S.pipeline_actions.cache_clear()


def test_interleaved_bubble_against_analytic_and_torch():
    for pp, vpp in ((2, 2), (2, 3), (4, 2), (4, 3)):
        for m in range(1, 3 * pp + 1):
            ours = simulate(pipeline_actions("interleaved_1f1b", pp, vpp, m), pp, vpp, uniform_costs(1.0, 2.0))
            analytic = (pp - 1) / (vpp * m + pp - 1)
            assert ours.bubble_fraction >= analytic - 1e-12
            if pp == 4 and m % pp == 0:  # Megatron's order reaches the analytic bubble here
                assert ours.bubble_fraction == pytest.approx(analytic, abs=1e-12), (pp, vpp, m)
            torch_group = m // max(1, m // pp)
            within = S.interleaved_peak(pp, vpp, m, torch_group) <= (min(pp, m) + vpp) * vpp
            if m % max(1, m // pp) == 0 and within:  # every count torch accepts, where its memory is in our bound
                theirs = _bubble_of_orders(_torch_interleaved_orders(pp, vpp, m), pp, vpp, m, (1.0, 2.0))
                assert ours.bubble_fraction <= theirs + 1e-12, (pp, vpp, m, ours.bubble_fraction, theirs)


def test_simulator_catches_deadlock_and_missing_input():
    f0, b0, f1, b1 = Action(0, "F", 0, 0), Action(0, "B", 0, 0), Action(1, "F", 0, 0), Action(1, "B", 0, 0)
    recv_grad, send_grad = Action(0, "RECV_B", 0, 0, peer=1), Action(1, "SEND_B", 0, 0, peer=0)
    with pytest.raises(ScheduleError, match="deadlock"):  # rank 0 never sends its activation
        simulate([[f0, recv_grad, b0], [Action(1, "RECV_F", 0, 0, peer=0), f1, b1, send_grad]], 2, 1)
    with pytest.raises(ScheduleError, match="before its input"):  # rank 1 computes without receiving
        simulate([[f0, Action(0, "SEND_F", 0, 0, peer=1), recv_grad, b0], [f1, b1, send_grad]], 2, 1)


def test_actions_print_as_short_strings():
    program = [str(a) for a in schedule_actions("1f1b", 2, 1, 2, 1)]
    assert program[:2] == ["r1 RECV_F c0 m0 <- r0", "r1 F c0 m0"]
    assert "r1 SEND_B c0 m0 -> r0" in program


def test_1f1b_with_virtual_stages_is_the_interleaved_schedule():
    """Megatron's reading: num_layers_per_virtual_pipeline_stage alone turns interleaving on."""
    for pp, vpp, m in [(2, 2, 4), (4, 2, 6), (2, 3, 5)]:
        assert pipeline_actions("1f1b", pp, vpp, m) == pipeline_actions("interleaved_1f1b", pp, vpp, m)


@pytest.mark.parametrize("schedule, pp, vpp, m, message", [
    ("interleaved_1f1b", 2, 1, 4, "needs at least 2 virtual stages"),
    ("gpipe", 2, 2, 4, "runs one chunk per rank"),
    ("zb_h1", 2, 2, 4, "pipeline_schedule=zb_h1 runs one chunk per rank"),
    ("zbv", 2, 1, 4, "pipeline_schedule=zbv runs exactly 2 chunks per rank, got 1"),
    ("zbv", 2, 3, 4, "pipeline_schedule=zbv runs exactly 2 chunks per rank, got 3"),
    ("zero_bubble", 2, 1, 4, "pipeline_schedule=zero_bubble is not one of"),
    ("1f1b", 2, 1, 0, "must be >= 1"),
])
def test_bad_layouts_are_one_line(schedule, pp, vpp, m, message):
    with pytest.raises(ConfigError, match=message) as err:
        schedule_actions(schedule, pp, vpp, m, 0)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("layout", [["vpp=2", "schedule=interleaved_1f1b"], ["schedule=zb_h1", "weight=1"],
                                    ["vpp=2", "schedule=zbv", "weight=1"]])
def test_visualize_schedule_draws_a_png(tmp_path, layout):
    out = tmp_path / "schedule.png"
    proc = subprocess.run(
        [sys.executable, "scripts/visualize_schedule.py", "pp=4", "microbatches=8", *layout, str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert "bubble" in proc.stdout


def test_sends_that_do_not_block_never_lengthen_a_schedule_and_stay_deadlock_free():
    """sends_block=False times what the runtime does (a batch's receives waited alone, its sends at the
    next batch; receives_ahead: gloo's receives posted a batch ahead): never longer than the strict
    model, the receives ahead never longer than without, and every program completes under any timing."""
    for schedule, pp, vpp in (("1f1b", 2, 1), ("1f1b", 4, 1), ("interleaved_1f1b", 2, 2), ("interleaved_1f1b", 4, 2)):
        for m in (1, 3, 4, 8):
            programs = pipeline_actions(schedule, pp, vpp, m)
            strict = simulate(programs, pp, vpp)
            relaxed = simulate(programs, pp, vpp, sends_block=False)
            ahead = simulate(programs, pp, vpp, sends_block=False, receives_ahead=True)
            assert ahead.makespan <= relaxed.makespan <= strict.makespan, (schedule, pp, vpp, m)
            for seed, receives_ahead in itertools.product(range(3), (False, True)):
                simulate(programs, pp, vpp, random_costs(seed), sends_block=False, receives_ahead=receives_ahead)
    relaxed = simulate(pipeline_actions("interleaved_1f1b", 2, 2, 4), 2, 2, sends_block=False)
    assert relaxed.makespan == 27  # the compute order's (analytic 1/9), vs 31 strict


def test_receives_that_never_wait_for_sends_reach_the_compute_orders_makespan():
    """The runtime waits a batch's receives alone (posted in calls without sends, one per channel: on
    NCCL one work each): the interleaved programs then take exactly as long as their compute orders
    list-scheduled with free transfers, with receives posted ahead or not."""
    for pp, vpp in itertools.product((2, 4, 8), (2, 4)):
        for m in (pp, 2 * pp, 8 * pp):
            orders = [S.compute_order("interleaved_1f1b", pp, vpp, m, r) for r in range(pp)]
            _, end = S._list_schedule(orders, pp, vpp, "interleaved_1f1b", m)
            programs = pipeline_actions("interleaved_1f1b", pp, vpp, m)
            for receives_ahead in (False, True):
                timeline = simulate(programs, pp, vpp, sends_block=False, receives_ahead=receives_ahead)
                assert timeline.makespan == max(end.values()), (pp, vpp, m, receives_ahead)
    # pp=8 vpp=2 M=64 at the analytic (pp-1)/(vpp M + pp-1); a receive waiting for its batch's sends gave
    # 9.9%, as 1F1B.
    runtime = simulate(pipeline_actions("interleaved_1f1b", 8, 2, 64), 8, 2, sends_block=False)
    assert abs(runtime.bubble_fraction - 7 / (2 * 64 + 7)) < 1e-9


def test_a_receive_posted_a_batch_ahead_moves_its_data_while_the_rank_computes():
    """Two forwards through two ranks, forward and transfer 1 each. Receiving ahead (gloo), rank 1 posts
    the receive of m1 at its first batch (t=0), so m1's data moves as soon as rank 0 sends it (t=2 -> 3)
    and F m1 runs at 3..4; posted at its own batch (t=3, after F m0), it arrives at 4 and the program
    ends at 5, as the strict model's does."""
    rank_0 = [Action(0, "F", 0, 0), Action(0, "SEND_F", 0, 0, peer=1), Action(0, "F", 0, 1),
              Action(0, "SEND_F", 0, 1, peer=1)]
    rank_1 = [Action(1, "RECV_F", 0, 0, peer=0), Action(1, "F", 0, 0), Action(1, "RECV_F", 0, 1, peer=0),
              Action(1, "F", 0, 1)]
    costs = uniform_costs(forward=1.0, p2p=1.0)
    assert simulate([rank_0, rank_1], 2, 1, costs, sends_block=False, receives_ahead=True).makespan == 4
    assert simulate([rank_0, rank_1], 2, 1, costs, sends_block=False).makespan == 5
    assert simulate([rank_0, rank_1], 2, 1, costs).makespan == 5


def test_interleaved_compute_order_alone_reaches_the_analytic_bubble_at_pp2():
    """At unit costs with free, instant transfers (list scheduling), the P = 2 order has no excess
    bubble: what the simulator adds there comes from the transfer model."""
    for m in (4, 8):
        orders = [S.compute_order("interleaved_1f1b", 2, 2, m, r) for r in range(2)]
        _, end = S._list_schedule(orders, 2, 2, "interleaved_1f1b", m)
        work = 2 * m * 3  # chunks x microbatches x (forward 1 + backward 2)
        assert max(end.values()) == work + 3  # the analytic bubble: (pp - 1) x (forward + backward) of a chunk


def test_simulator_refuses_a_send_that_is_never_received():
    rank_0 = [Action(0, "F", 0, 0), Action(0, "SEND_F", 0, 0, peer=1)]
    with pytest.raises(ScheduleError, match="never received"):  # rank 1's program forgot its receive
        simulate([rank_0, []], 2, 1, sends_block=False)


@pytest.mark.parametrize("pp", [2, 4, 8])
def test_zero_bubble_h1_halves_1f1bs_bubble_at_equal_costs_and_holds_as_much(pp):
    """Forward, input gradient (B) and weight gradient (W) at one unit each: for M >= 2pp ZB-H1's bubble
    is (pp - 1) / (3M + pp - 1), a third of 1F1B's, strictly and with the runtime's sends; its peak
    activations (held from F to W) are 1F1B's."""
    costs = uniform_costs(forward=1.0, backward=2.0, weight=1.0)
    for m in range(2 * pp, 4 * pp + 1):
        zero_bubble, plain = (pipeline_actions(s, pp, 1, m) for s in ("zb_h1", "1f1b"))
        for sends_block in (True, False):
            zb = simulate(zero_bubble, pp, 1, costs, sends_block=sends_block)
            one_f_one_b = simulate(plain, pp, 1, costs, sends_block=sends_block)
            assert zb.bubble_fraction <= one_f_one_b.bubble_fraction / 2, (pp, m, sends_block)
            assert zb.bubble_fraction == pytest.approx((pp - 1) / (3 * m + pp - 1), abs=1e-12), (pp, m)
            assert max(zb.peak_microbatches) == max(one_f_one_b.peak_microbatches) == pp, (pp, m)


def test_zero_bubble_h1_runs_ws_in_backward_order_with_the_last_one_last():
    """W of a microbatch after its B, Ws in B order: the chunk's last W is its last B's, which reduces."""
    for pp, m in itertools.product((1, 2, 4), (1, 3, 4, 8)):
        for program in pipeline_actions("zb_h1", pp, 1, m):
            assert [a.microbatch for a in program if a.op == "W"] == list(range(m)), (pp, m)
            assert str(next(a for a in program if a.op == "W")).startswith(f"r{program[0].rank} W c0 m0")


def test_the_runtime_refuses_a_program_whose_last_w_is_not_its_last_backwards():
    program = list(pipeline_actions("zb_h1", 1, 1, 2)[0])
    w0, w1 = (i for i, a in enumerate(program) if a.op == "W")
    program[w0], program[w1] = program[w1], program[w0]
    with pytest.raises(ValueError, match="last W must be of its last backward's microbatch"):
        PipelineRuntime(program, 1, [], [], None, (1, 1, 1), torch.float32, torch.device("cpu"))


def test_zero_bubble_v_places_stages_in_a_v_and_runs_torchs_order():
    """Rank r runs stages r and 2pp - 1 - r: rank 0 the first and the last, every transfer between
    neighbours, the V's turn on rank pp - 1 without the network. The compute order is that of
    torch.distributed.pipelining's ScheduleZBVZeroBubble, for every pp up to 8 and M up to 4pp + 2."""
    from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble

    names = {_ComputationType.FORWARD: "F", _ComputationType.BACKWARD_INPUT: "B", _ComputationType.BACKWARD_WEIGHT: "W"}
    for pp in range(1, 9):
        stages = [rank_stages(pp, 2, r, v_shape=True) for r in range(pp)]
        assert stages[0] == [0, 2 * pp - 1] and stages[-1] == [pp - 1, pp]
        assert all(stage_place(s, pp, v_shape=True) == (r, c) for r in range(pp) for c, s in enumerate(stages[r]))
        for m in range(1, 4 * pp + 3):
            programs = pipeline_actions("zbv", pp, 2, m)
            assert all(abs(a.peer - a.rank) == 1 for program in programs for a in program if not a.is_compute), (pp, m)
            for rank, program in enumerate(programs):
                ours = [(a.op, a.chunk, a.microbatch) for a in program if a.is_compute]
                state = SimpleNamespace(pp_group_size=pp, _n_microbatches=m, num_stages=2 * pp)
                theirs = [(names[a.computation_type], stages[rank].index(a.stage_index), a.microbatch_index)
                          for a in ScheduleZBVZeroBubble._calculate_single_rank_operations(state, rank) if a is not None]
                assert ours == theirs, (pp, m, rank)


@pytest.mark.parametrize("pp", [2, 4, 8])
def test_zero_bubble_v_halves_zb_h1s_bubble_at_equal_costs_and_holds_as_much(pp):
    """F, B and W of a chunk (half a stage) at one unit each, against ZB-H1's at two, so both ranks work
    6M units: from 2pp - 1 microbatches ZB-V's bubble is (pp - 1) / (6M + pp - 1); from 2pp its idle
    time is half of ZB-H1's (pp - 1 units against 2(pp - 1)), strictly and with the runtime's sends. It
    holds 1F1B's pp microbatches of activations."""
    stage, chunk = uniform_costs(forward=2.0, backward=4.0, weight=2.0), uniform_costs(forward=1.0, backward=2.0, weight=1.0)
    for m in range(2 * pp - 1, 4 * pp + 1):
        for sends_block in (True, False):
            zbv = simulate(pipeline_actions("zbv", pp, 2, m), pp, 2, chunk, sends_block=sends_block, v_shape=True)
            zb_h1 = simulate(pipeline_actions("zb_h1", pp, 1, m), pp, 1, stage, sends_block=sends_block)
            assert zbv.bubble_fraction == pytest.approx((pp - 1) / (6 * m + pp - 1), abs=1e-12), (pp, m, sends_block)
            if m >= 2 * pp:
                assert zbv.makespan - 6 * m == (zb_h1.makespan - 6 * m) / 2 == pp - 1, (pp, m, sends_block)
            assert max(zbv.peak_microbatches) == pp, (pp, m)


def test_zero_bubble_v_runs_each_chunks_ws_in_backward_order():
    """Per chunk, Ws in B order, each after its B: the chunk's last W is its last B's, which reduces."""
    for pp, m in itertools.product((1, 2, 3, 4), (1, 3, 4, 8)):
        for program in pipeline_actions("zbv", pp, 2, m):
            for chunk in (0, 1):
                ops = [(a.op, a.microbatch) for a in program if a.chunk == chunk and a.op in "BW"]
                assert [mb for op, mb in ops if op == "W"] == [mb for op, mb in ops if op == "B"] == list(range(m))
                assert all(ops.index(("B", mb)) < ops.index(("W", mb)) for mb in range(m)), (pp, m, chunk)
