"""Prefetching onto the devices: the next batches are transferred while a step runs."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator

from absl import logging

from jdp.data.core import Batch


class Prefetcher:
    """Moves host batches onto devices in a background thread, `depth` ahead.

    `put` turns a host batch into device arrays (it is the backend's); the
    transfer overlaps the running step. Errors surface on the next `next()`.
    `close()` stops the thread and closes `batches` (its threads or worker
    processes) from that thread, which owns it.
    """

    _DONE = object()
    # How long close() waits for the batch being prepared; workers are closed then.
    _CLOSE_TIMEOUT_S = 60.0

    def __init__(self, batches: Iterator[Batch], put: Callable, depth: int = 2):
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fill, args=(batches, put), daemon=True)
        self._thread.start()

    def _offer(self, item) -> bool:
        """Queues `item` unless stopped first (the consumer may never take it)."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _fill(self, batches, put) -> None:
        try:
            for batch in batches:
                if not self._offer(put(batch)):
                    return
            self._offer(self._DONE)
        except BaseException as e:  # noqa: BLE001 - re-raised in the consumer
            self._offer(e)
        finally:
            close = getattr(batches, "close", None)
            if close is not None:
                close()

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self):
        item = self._queue.get()
        if item is self._DONE:
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self._stop.set()
        self._thread.join(self._CLOSE_TIMEOUT_S)
        if self._thread.is_alive():
            logging.warning("the input pipeline did not stop within %.0f s; its worker "
                            "processes end with this process", self._CLOSE_TIMEOUT_S)
