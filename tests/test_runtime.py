"""The services' process-wide settings."""

from __future__ import annotations

import gc
import weakref

from broker.runtime import freeze_startup_heap


class _Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the collector frees it


def test_the_startup_heap_is_frozen_and_its_garbage_collected_first() -> None:
    built = [[i] for i in range(10_000)]  # what startup keeps
    garbage = weakref.ref(_Node())
    before = gc.get_freeze_count()
    try:
        freeze_startup_heap()
        assert gc.get_freeze_count() >= before + len(built)
        assert garbage() is None  # collected, not frozen for good
    finally:
        gc.unfreeze()
