"""The schedule a run will use, in one line for its log: what the simulator says of it."""

from parallel.pipeline.schedule import (
    effective_schedule, interleaved_groups, interleaved_peak, interleaved_peak_bound, pipeline_actions, v_shaped,
)
from parallel.pipeline.simulate import simulate


def group_sizes(groups: tuple[int, ...]) -> str:
    """Group sizes as a sum that reads M: runs of one size as size*count, e.g. 1+5*4 for 1, 5, 5, 5, 5."""
    runs: list[list[int]] = []
    for size in groups:
        if runs and runs[-1][0] == size:
            runs[-1][1] += 1
        else:
            runs.append([size, 1])
    return "+".join(f"{size}*{count}" if count > 1 else str(size) for size, count in runs)


def schedule_summary(schedule: str, pp: int, vpp: int, microbatches: int) -> str:
    """Schedule, group sizes, simulated bubble (uniform costs, the runtime's non-blocking sends), peak
    microbatches held, and whether plain 1F1B would finish first by the same measure."""
    schedule = effective_schedule(schedule, vpp)
    timeline = simulate(pipeline_actions(schedule, pp, vpp, microbatches), pp, vpp, sends_block=False,
                        v_shape=v_shaped(schedule))
    text = f"pipeline schedule {schedule}: pp={pp} vpp={vpp} microbatches={microbatches}"
    if schedule == "interleaved_1f1b":
        groups, warmup_group = interleaved_groups(pp, vpp, microbatches)
        text += f" groups={group_sizes(groups)}"
        if warmup_group != max(groups):
            text += f" (warm-up for groups of {warmup_group})"
        if interleaved_peak(pp, vpp, microbatches, warmup_group) > interleaved_peak_bound(pp, vpp, microbatches):
            text += " (it holds more than the memory bound: no order within it is as fast as plain 1f1b)"
    text += (f", simulated bubble {timeline.bubble_fraction:.1%}, "
             f"peak {round(max(timeline.peak_microbatches), 2):g} microbatches held")
    if schedule != "1f1b":
        plain = simulate(pipeline_actions("1f1b", pp, 1, microbatches), pp, 1, sends_block=False)
        # Equal total work: the smaller bubble is the shorter step.
        faster = plain.bubble_fraction < timeline.bubble_fraction - 1e-9
        text += f"; plain 1f1b (bubble {plain.bubble_fraction:.1%}) would be {'faster' if faster else 'no faster'}"
    return text
