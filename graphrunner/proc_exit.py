"""Whether a child process is already on its way out, before it can be reaped (Linux /proc).

A killed GPU worker can stay in the kernel's exit path for as long as a peer's NCCL kernel keeps its memory in use:
its sentinel and waitpid say nothing until then. /proc/<pid>/stat shows the exit from its first moment.
"""

from __future__ import annotations

PF_EXITING = 0x4  # the task's flags once do_exit has begun (include/linux/sched.h)
SIGKILL_BIT = 1 << (9 - 1)  # SIGKILL in /proc/<pid>/status's signal masks


def parse_stat(text: str) -> tuple[str, int, int]:
    """(state, flags, exit_code) from a /proc/<pid>/stat line; the command name may hold spaces and parentheses."""
    fields = text[text.rindex(")") + 2:].split()
    # fields[0] is field 3 (state) of proc(5); flags is field 9, exit_code field 52 (absent before Linux 3.5)
    exit_code = int(fields[49]) if len(fields) > 49 else 0
    return fields[0], int(fields[6]), exit_code


def exit_code_if_exiting(pid: int) -> int | None:
    """The exit code in multiprocessing's form (negative: the signal) when process pid is exiting, has exited or has
    SIGKILL pending; None while it runs (or where /proc cannot say)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state, flags, exit_code = parse_stat(f.read())
        with open(f"/proc/{pid}/status") as f:
            pending = 0
            for line in f:
                if line.startswith(("SigPnd:", "ShdPnd:")):
                    pending |= int(line.split()[1], 16)
    except (OSError, ValueError, IndexError):
        return None
    if pending & SIGKILL_BIT:
        return -9
    if not (flags & PF_EXITING or state in "ZX"):
        return None
    signo = exit_code & 0x7F
    return -signo if signo else (exit_code >> 8) & 0xFF
