"""For GPU tests: wrap an engine's step launch so that any host synchronisation inside it raises
(torch.cuda.set_sync_debug_mode("error")), and count the launches that passed the check."""

from __future__ import annotations

from typing import Any

import torch


class SyncFreeLaunches:
    """`engine.runner.execute` replaced by a checked one; `count` is the number of launches so far."""

    def __init__(self, engine: Any) -> None:
        self.count = 0
        launch = engine.runner.execute

        def checked(sched: Any) -> Any:
            torch.cuda.set_sync_debug_mode("error")
            try:
                out = launch(sched)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            self.count += 1
            return out

        engine.runner.execute = checked
