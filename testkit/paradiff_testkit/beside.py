"""Work of the test process done beside a rank-pool round trip instead of after it.

A test that compares ranks' results with single-process references used to compute the references once the ranks
had answered, while the ranks had waited idle for the test before. Here the references run in a thread of the test
process while the ranks work (torch releases the GIL in its operations, and the pool's caller only waits on a queue):
the same computations, done at the same time.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable


def beside(background: Callable[[], Any], foreground: Callable[[], Any]) -> tuple[Any, Any]:
    """Run `background()` in a thread while `foreground()` runs in this one; (foreground's, background's) results.
    Either one's exception is raised here, once both have ended (no thread outlives the call)."""
    with ThreadPoolExecutor(1, thread_name_prefix="paradiff-beside") as executor:
        future = executor.submit(background)
        try:
            ahead = foreground()
        finally:
            done = future.exception()  # waits for it
        if done is not None:
            raise done
        return ahead, future.result()
