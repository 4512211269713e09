"""What may a request's handler leave until its reply has left?

Short work the tenant need not wait for (a released memfd with nothing to zero, put
back in the warm pool), done by the thread that served the request, once the reply is
sent and before it reads the next frame. Handing it to another thread instead made the
two contend for the GIL while the next request was served: with the punch thread doing
it, an agent serving one tenant spent 0.75 ms of CPU per lease+release, and 0.60 ms with
the work on the request's own thread (the handoffs gone, and the futex wake-ups with
them). Long work (2 MiB of pages to zero) is no candidate: the next request on the
connection would wait for it.

:func:`defer` returns False outside a request (a revocation from the heartbeat thread,
a test calling the service directly): the caller then does the work its own way.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger("pool_agent")

_local = threading.local()


class _Serving:
    # A class, not @contextmanager: entered on every request, where a generator's
    # set-up costs more than the rest of it.
    __slots__ = ("_work",)

    def __enter__(self) -> None:
        self._work: list[Callable[[], None]] = []
        _local.work = self._work

    def __exit__(self, *exc: object) -> None:
        _local.work = None
        for fn in self._work:
            try:
                fn()
            except Exception:
                log.exception("work left until after a reply failed")


def serving() -> _Serving:
    """Around one request, reply included: what its handler defers runs when it ends,
    each piece on its own (one that fails is logged and the rest still run)."""
    return _Serving()


def defer(fn: Callable[[], None]) -> bool:
    """Run ``fn`` once the current request's reply has left; False (not taken) when this
    thread is serving no request."""
    work: list[Callable[[], None]] | None = getattr(_local, "work", None)
    if work is None:
        return False
    work.append(fn)
    return True
