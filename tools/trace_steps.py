"""One step of a torch.profiler chrome trace, kernel by kernel: where a CUDA-graph replay spends its time in order,
which the grouped table of kernel_table.py cannot say (a verify step's target, its rejection sampling, each draft
step of the proposer). Steps are the runs of device events separated by idle gaps; --split cuts the chosen step into
sections at kernels whose names match a regex, with each section's span. Example (a k = 4 EAGLE verify step):
python tools/trace_steps.py trace.json --split "_post_update_spec|_observe_index|_advance_draft"
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernel_table import KernelEvent, events_from_chrome_trace


@dataclass(frozen=True)
class Section:
    first: str        # the name of the kernel that opens it
    start_us: float   # from the step's start
    span_us: float    # to the next section's start (the last: to the step's end)
    busy_us: float    # the sum of its events' durations (overlapping events with PDL counted in full)
    events: int


def split_steps(events: Sequence[KernelEvent], gap_us: float) -> list[list[KernelEvent]]:
    """Events in start order, cut wherever the device idles longer than gap_us."""
    ordered = sorted(events, key=lambda e: e.start_us)
    steps: list[list[KernelEvent]] = []
    end = float("-inf")
    for e in ordered:
        if not steps or e.start_us - end > gap_us:
            steps.append([])
        steps[-1].append(e)
        end = max(end, e.start_us + e.dur_us)
    return steps


def step_span(step: Sequence[KernelEvent]) -> float:
    return max(e.start_us + e.dur_us for e in step) - step[0].start_us


def sections(step: Sequence[KernelEvent], split: re.Pattern[str] | None) -> list[Section]:
    """The step cut before each event whose name matches `split` (the first section starts at the step's start)."""
    t0, end = step[0].start_us, step[0].start_us + step_span(step)
    cuts = [0] + [i for i, e in enumerate(step) if i and split is not None and split.search(e.name)]
    out = []
    for a, b in zip(cuts, [*cuts[1:], len(step)]):
        part = step[a:b]
        stop = step[b].start_us if b < len(step) else end
        out.append(Section(part[0].name, part[0].start_us - t0, stop - part[0].start_us,
                           sum(e.dur_us for e in part), len(part)))
    return out


def short(name: str, width: int = 70) -> str:
    """A kernel's name without its C++ template and argument lists."""
    return re.sub(r"[<(].*", "", name).strip()[:width] or name[:width]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", type=Path)
    ap.add_argument("--step", type=int, default=-2, help="which step (index into the list; -2: the last full one)")
    ap.add_argument("--gap-us", type=float, default=50.0, help="an idle gap this long ends a step")
    ap.add_argument("--min-events", type=int, default=20, help="steps with fewer events are not listed as steps")
    ap.add_argument("--split", default=None, help="regex: a section starts at each kernel whose name matches")
    ap.add_argument("--kernels", action="store_true", help="also list the step's kernels one by one")
    args = ap.parse_args()
    try:
        events = events_from_chrome_trace(args.trace)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        sys.exit(f"cannot read a chrome trace from {args.trace}: {exc}")
    steps = [s for s in split_steps(events, args.gap_us) if len(s) >= args.min_events]
    if not steps:
        sys.exit(f"no step of {args.min_events} or more device events in {args.trace}")
    print("steps (events, µs):", ", ".join(f"{len(s)}/{step_span(s):.1f}" for s in steps))
    step = steps[args.step if -len(steps) <= args.step < len(steps) else -1]
    print(f"step {args.step}: {len(step)} events, {step_span(step):.1f} µs")
    if args.kernels:
        t0, prev_end = step[0].start_us, step[0].start_us
        for e in step:
            print(f"{e.start_us - t0:9.1f} {e.dur_us:7.1f}  gap {e.start_us - prev_end:5.1f}  {short(e.name)}")
            prev_end = e.start_us + e.dur_us
    split = re.compile(args.split) if args.split else None
    print(f"{'from (µs)':>10} {'span':>8} {'busy':>8} {'events':>6}  opened by")
    for s in sections(step, split):
        print(f"{s.start_us:10.1f} {s.span_us:8.1f} {s.busy_us:8.1f} {s.events:6d}  {short(s.first)}")


if __name__ == "__main__":
    main()
