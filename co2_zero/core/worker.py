"""The background thread the exchange runs its pipelines on (docs/design.md §3 a–g): jobs one at a time, in
order, each result or error delivered through a `Future`."""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable, Optional


class BackgroundWorker:
    """A daemon thread that runs submitted jobs one at a time, in order.

    Daemon, so a collective stuck on a dead peer can never keep the process from exiting.
    """

    def __init__(self, name: str) -> None:
        self._jobs: queue.Queue[Optional[tuple[Callable[[], Any], Future]]] = queue.Queue()
        self._unfinished = 0  # jobs submitted and not yet done
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (item := self._jobs.get()) is not None:
            job, future = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(job())
                except BaseException as error:  # delivered to whoever waits on the future
                    future.set_exception(error)
            with self._lock:
                self._unfinished -= 1

    @property
    def idle(self) -> bool:
        """No job queued or running: the thread ends as soon as it is scheduled once closed."""
        with self._lock:
            return self._unfinished == 0

    def submit(self, job: Callable[[], Any]) -> Future:
        future: Future = Future()
        with self._lock:
            self._unfinished += 1
        self._jobs.put((job, future))
        return future

    def close(self, timeout: float = 1.0, idle_timeout: Optional[float] = None) -> bool:
        """Stop after the jobs already queued; True if the thread has ended within `timeout` (an idle
        worker's: `idle_timeout`, when given, it cannot be stuck in a collective).

        Joining matters: a thread that used torch's C++ code (gloo, tensor ops) and still runs or ends
        while the interpreter shuts down aborts the process ("terminate called without an active
        exception"); so an orderly close waits for the thread, not just a moment, and on a busy host an
        idle thread may take longer than a moment to be scheduled and end.
        """
        if idle_timeout is not None and self.idle:
            timeout = max(timeout, idle_timeout)
        self._jobs.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=timeout)
        return not self._thread.is_alive()
