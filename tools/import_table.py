"""The slowest top-level imports in a `python -X importtime` log (stderr), cumulative, so start-up work on
imports goes where the time is: python tools/import_table.py importtime.log [--top 25]."""

from __future__ import annotations

import argparse
from pathlib import Path


def parse(text: str) -> list[tuple[int, int, int, str]]:
    """(cumulative µs, self µs, nesting depth, module) per line of an importtime log."""
    rows = []
    for line in text.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        self_us, cum_us, name = line[len("import time:"):].split("|", 2)
        depth = (len(name) - len(name.lstrip(" ")) - 1) // 2
        rows.append((int(cum_us), int(self_us), depth, name.strip()))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("log", type=Path)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--depth", type=int, default=2, help="deepest nesting level listed (0: top-level imports)")
    args = p.parse_args()
    rows = parse(args.log.read_text(encoding="utf-8", errors="replace"))
    if not rows:
        raise SystemExit(f"{args.log}: no importtime lines")
    total = sum(r[0] for r in rows if r[2] == 0)
    print(f"top-level imports: {total / 1e6:.2f} s in all")
    print(f"{'cumulative s':>12}  {'self s':>7}  module")
    for cum, own, depth, name in sorted((r for r in rows if r[2] <= args.depth), reverse=True)[:args.top]:
        print(f"{cum / 1e6:12.3f}  {own / 1e6:7.3f}  {'  ' * depth}{name}")


if __name__ == "__main__":
    main()
