"""``Transfer``: the handle of one asynchronous save or load.

The caller owns it. A transfer runs on the ``TensorIO``'s pipeline thread;
``wait()`` returns when every page has landed (in the store for a save, in the
destination tensors for a load) and raises the first failure.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any

__all__ = ["Transfer"]


class Transfer:
    """One in-flight ``TensorIO.save`` or ``load`` of ``pages`` pages, ``payload_bytes`` bytes.

    On CUDA, ``event`` is a ``torch.cuda.Event`` recorded on the copy stream
    after the last copy: ``torch.cuda.current_stream().wait_event(t.event)``
    orders later kernels after the load without blocking the host. On CPU it
    is None.
    """

    __slots__ = ("_event", "_future", "_issued", "kind", "pages", "payload_bytes")

    def __init__(self, kind: str, pages: int, payload_bytes: int) -> None:
        self.kind = kind
        self.pages = pages
        self.payload_bytes = payload_bytes
        self._future: Future[None] = Future()
        self._issued = threading.Event()
        self._event: Any = None

    # -- used by the pipeline --------------------------------------------

    def _set_issued(self, event: Any) -> None:
        self._event = event
        self._issued.set()

    def _finish(self, error: BaseException | None) -> None:
        self._issued.set()
        if error is None:
            self._future.set_result(None)
        else:
            self._future.set_exception(error)

    # -- public ------------------------------------------------------------

    def wait(self, timeout: float | None = None) -> None:
        """Block until the transfer has completed; raise its error, if any.

        ``timeout`` (seconds) raises ``TimeoutError`` if it has not completed by
        then; the transfer keeps running.
        """
        self._future.result(timeout)

    def done(self) -> bool:
        """True once the transfer has completed, successfully or not."""
        return self._future.done()

    @property
    def event(self) -> Any:
        """The CUDA event after the last copy (blocks until the copies are issued); None on CPU."""
        self._issued.wait()
        return self._event

    def __repr__(self) -> str:
        state = "done" if self.done() else "running"
        return f"Transfer({self.kind}, pages={self.pages}, bytes={self.payload_bytes}, {state})"
