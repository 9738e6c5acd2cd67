"""Undo the empty-split change (forty-first session) in a copy of the tree, for gpu_checks.sh ab41's base: the split
programs store every partial output again and the merges read every one. Each edit must match exactly once, so a
later change to these lines stops the A/B instead of measuring something else. Usage: ab41_base.py TREE_COPY
"""

from __future__ import annotations

import sys
from pathlib import Path

EDITS = {
    "graphrunner/attention/triton_attention.py": [(
        ("            if lo < hi:  # an empty slice's acc is zeros the merge never reads (its m is -inf): no store\n"
         "                tl.store(part_acc_ptr + row[:, None].to(tl.int64) * D_PAD + d[None, :], acc, "
         "mask=row_ok[:, None])\n"),
        ("            tl.store(part_acc_ptr + row[:, None].to(tl.int64) * D_PAD + d[None, :], acc, "
         "mask=row_ok[:, None])\n"),
    )],
    "graphrunner/attention/split_merge.py": [
        ('mask=(row_ok & (m_s != float("-inf")))[:, None], other=0.0', "mask=row_ok[:, None], other=0.0"),
        ('acc += tl.load(part_acc_ptr + row.to(tl.int64) * D_PAD + d, mask=m_s != float("-inf"), other=0.0) * w',
         "acc += tl.load(part_acc_ptr + row.to(tl.int64) * D_PAD + d) * w"),
    ],
}


def main(root: Path) -> None:
    for rel, edits in EDITS.items():
        path = root / rel
        text = path.read_text()
        for old, new in edits:
            if text.count(old) != 1:
                sys.exit(f"{rel}: expected one match of {old.strip()[:60]!r}, found {text.count(old)}")
            text = text.replace(old, new)
        path.write_text(text)
    print(f"undid the empty-split change under {root}")


if __name__ == "__main__":
    if len(sys.argv) != 2 or not Path(sys.argv[1]).is_dir():
        sys.exit("usage: ab41_base.py TREE_COPY")
    main(Path(sys.argv[1]))
