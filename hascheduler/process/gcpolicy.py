"""The garbage collector's policy: while a command's modules are imported, and for the
long-running processes (replica, dev server).

Both hold a large live heap that grows fast under load: the development server every
document, the leader every claim made ahead and its heap of next fires. CPython's full
collection walks the whole heap; at 10,000 fires a second the leader spent 70-80 ms in
one more than once a second (reclaiming nothing), which delayed publishes due meanwhile,
and the development server's claims fell behind their due times. After each full
collection the survivors are frozen (moved out of the collector's sight): later
collections walk only what is newer. The stored documents, indexes, mirror entries and
claims hold no reference cycles, so refcounting frees them when they die; what freezing
can keep is cyclic garbage that was still alive at a freeze (a closed connection's
asyncio objects), so every THAW_EVERY_S the frozen objects are handed back and the next
full collection walks everything once.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator

THAW_EVERY_S = 600.0


class _SurvivorFreezer:
    def __init__(self, thaw_every_s: float | None) -> None:
        self.thaw_every_s = thaw_every_s
        self.thawed_at = time.monotonic()

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase != "stop" or info.get("generation") != 2:
            return
        now = time.monotonic()
        if self.thaw_every_s is not None and now - self.thawed_at >= self.thaw_every_s:
            self.thawed_at = now
            gc.unfreeze()
        else:
            gc.freeze()


def freeze_survivors(thaw_every_s: float | None = THAW_EVERY_S) -> None:
    """Install the policy for this process (once). ``thaw_every_s`` None: never thaw. The
    full collection after a thaw walks the whole heap; in the development server, holding
    every stored document, that took over a second (a one-second lease's renewals missed
    their deadline), and the cyclic garbage a freeze can keep there is a closed client
    connection's few objects."""
    if not any(isinstance(cb, _SurvivorFreezer) for cb in gc.callbacks):
        gc.callbacks.append(_SurvivorFreezer(thaw_every_s))


@contextlib.contextmanager
def importing() -> Iterator[None]:
    """The collector off while a command's modules are imported, and what they made frozen
    after. Module bodies build classes, schemas and tables that live as long as the
    process: the collections their allocations set off found nothing to free, and later
    ones need not walk them again (docs/ARCHITECTURE.md, garbage collector)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()
