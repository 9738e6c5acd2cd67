"""Tests for tools/trace_steps.py (one replay of a profiler trace, kernel by kernel): steps are cut at idle gaps,
sections at the kernels a regex names, and each section's span runs to the next one's start.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from tool_loader import TOOLS, load_tool

ts = load_tool("trace_steps")


def _trace(path: Path) -> Path:
    """Two steps 500 µs apart: a, b, mark (gap 2), c; then x, mark, y. One host event, which is not a kernel."""
    ev = [("a", 0, 10), ("b", 11, 5), ("mark_kernel", 18, 3), ("void at::native::c<float, 4>(int)", 22, 4),
          ("x", 526, 4), ("mark_kernel", 531, 2), ("y", 534, 1)]
    events = [{"ph": "X", "cat": "kernel", "name": n, "ts": t, "dur": d} for n, t, d in ev]
    events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 100, "dur": 5})
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def test_steps_cut_at_idle_gaps_and_sections_at_marks(tmp_path: Path) -> None:
    events = ts.events_from_chrome_trace(_trace(tmp_path / "t.json"))
    steps = ts.split_steps(events, gap_us=50)
    assert [[e.name[:1] for e in s] for s in steps] == [["a", "b", "m", "v"], ["x", "m", "y"]]
    assert [ts.step_span(s) for s in steps] == [26, 9]
    first = ts.sections(steps[0], re.compile("mark"))
    assert [(s.first[:1], s.start_us, s.span_us, s.busy_us, s.events) for s in first] == [
        ("a", 0, 18, 15, 2), ("m", 18, 8, 7, 2)]
    assert [s.span_us for s in ts.sections(steps[0], None)] == [26]  # no regex: the whole step
    assert ts.short("void at::native::c<float, 4>(int)") == "void at::native::c"


def test_command_line_lists_the_chosen_step(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(TOOLS / "trace_steps.py"), str(_trace(tmp_path / "t.json")),
                          "--step", "0", "--min-events", "1", "--split", "mark", "--kernels"],
                         capture_output=True, text=True, check=True).stdout
    assert "steps (events, µs): 4/26.0, 3/9.0" in out and "step 0: 4 events, 26.0 µs" in out
    assert "gap   2.0  mark_kernel" in out


def test_command_line_refuses_what_is_not_a_trace(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("not json")
    for path in (bad, tmp_path / "missing.json"):
        run = subprocess.run([sys.executable, str(TOOLS / "trace_steps.py"), str(path)], check=False,
                             capture_output=True, text=True)
        assert run.returncode == 1 and "cannot read a chrome trace from" in run.stderr
        assert "Traceback" not in run.stderr
