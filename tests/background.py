"""Subprocess runs that start when collection ends, so that the main process runs other tests meanwhile.

Two modules check subprocess runs: the entry points (`tests/experiments/test_entry_points.py`) and the
expert-parallel checks on 4 forced devices (`tests/experts/test_expert_parallel.py`). Those runs, and
most of the in-process suite, are single-threaded XLA compilation, so on a 2-core machine one run beside
the main process uses the core that the main process leaves idle. `conftest.py` calls each module's
`start_background(session, items)` after collection, which `submit`s its runs here (one slot), and moves
those modules' tests to the end of the session. When the first of them waits on a result (`result`), the
main process has nothing else to run, and every slot opens (at once when such a module runs alone).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Hashable

SLOTS = max(1, min(2, os.cpu_count() or 1))

_lock = threading.Lock()
_slots = threading.Semaphore(1)
_opened = False
_pool: ThreadPoolExecutor | None = None
_jobs: dict[Hashable, Future] = {}


def submit(key: Hashable, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
    """fn(*args, **kwargs) in the background, once per key (a later call returns the same future).
    Runs in submission order, as slots allow."""
    global _pool
    with _lock:
        if key not in _jobs:
            if _pool is None:
                _pool = ThreadPoolExecutor(max_workers=SLOTS, thread_name_prefix="tests-background")

            def job():
                with _slots:
                    return fn(*args, **kwargs)

            _jobs[key] = _pool.submit(job)
        return _jobs[key]


def started(key: Hashable) -> bool:
    return key in _jobs


def open_all_slots() -> None:
    """The main process is waiting on the runs: let them use every slot."""
    global _opened
    with _lock:
        if not _opened:
            _opened = True
            for _ in range(SLOTS - 1):
                _slots.release()


def result(key: Hashable) -> Any:
    """The run's result, waiting for it with every slot open."""
    open_all_slots()
    return _jobs[key].result()


def shutdown() -> None:
    """At the session's end: drop the runs not started, wait for the running ones."""
    global _pool
    with _lock:
        pool, _pool = _pool, None
    if pool is not None:
        open_all_slots()
        pool.shutdown(wait=True, cancel_futures=True)
