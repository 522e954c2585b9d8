"""Bulk work between the engine threads' steps: a long call that holds the GIL (parsing a large request body,
writing a large schema as text) runs while no step does, and a step runs between any two such calls.

A thread that releases the GIL gets it back only once the thread holding it lets go, and a step releases it
dozens of times (every kernel call, much of NumPy): a parse of ten milliseconds beside a step holds up each of
those returns, and eight parses back to back held one step up for all of them (the victim's gap of ~15x normal).
Here a step waits for one piece of bulk work at most.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

# Bulk work goes ahead after this long even if no step has made way (an engine stuck in a step, say): the gate
# keeps steps and bulk work apart for fairness, never for correctness.
MAX_WAIT_S = 1.0


class StepGate:
    """Engine steps share the gate; bulk work holds it alone, one piece at a time, and while an engine has work, a
    step of it runs between two pieces."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._steps = 0  # steps running now
        self._bulk_running = False
        self._bulk_waiting = 0
        self._busy: set[int] = set()  # engine threads that have work (they step until they rest)
        self._stepped_since_bulk = True

    @contextmanager
    def step(self) -> Iterator[None]:
        """Held by an engine thread through one step."""
        with self._changed:
            while self._bulk_running or (self._bulk_waiting and self._stepped_since_bulk):
                self._changed.wait()
            self._steps += 1
            self._busy.add(threading.get_ident())
        try:
            yield
        finally:
            with self._changed:
                self._steps -= 1
                self._stepped_since_bulk = True
                self._changed.notify_all()

    def rest(self) -> None:
        """Called by an engine thread that has no work (or stops): bulk work need not wait for its steps."""
        with self._changed:
            self._busy.discard(threading.get_ident())
            self._changed.notify_all()

    @contextmanager
    def bulk(self) -> Iterator[None]:
        """Held through one piece of bulk work."""
        deadline = time.monotonic() + MAX_WAIT_S
        with self._changed:
            self._bulk_waiting += 1
            try:
                while self._bulk_running or self._steps or (self._busy and not self._stepped_since_bulk):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._changed.wait(left)
            finally:
                self._bulk_waiting -= 1
            self._bulk_running = True
        try:
            yield
        finally:
            with self._changed:
                self._bulk_running = False
                self._stepped_since_bulk = False
                self._changed.notify_all()


STEP_GATE = StepGate()
