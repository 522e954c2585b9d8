"""The step gate: bulk work (a large body's parse, a large schema's text) runs between the engine's steps."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager

import pytest

from edgeserve.engine import step_gate
from edgeserve.engine.step_gate import StepGate


def _started(fn: Callable[[], None]) -> threading.Thread:
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    return thread


def _held(enter: Callable[[], AbstractContextManager], release: threading.Event,
          inside: threading.Event) -> Callable[[], None]:
    """A thread's body that enters the gate's step or bulk, says so, and stays in until released."""
    def hold() -> None:
        with enter():
            inside.set()
            release.wait(10)
    return hold


@pytest.mark.parametrize("first, second", [("step", "bulk"), ("bulk", "step")])
def test_a_step_and_bulk_work_never_overlap(first: str, second: str) -> None:
    gate = StepGate()
    release, held, entered = threading.Event(), threading.Event(), threading.Event()
    holder = _started(_held(getattr(gate, first), release, held))
    assert held.wait(5)
    _started(_held(getattr(gate, second), threading.Event(), entered))
    assert not entered.wait(0.3), f"{second} entered while {first} ran"
    release.set()
    assert entered.wait(5), f"{second} did not enter once {first} ended"
    holder.join(5)


def test_a_busy_engine_steps_between_two_pieces_of_bulk_work() -> None:
    gate = StepGate()
    order: list[str] = []
    stop = threading.Event()

    def engine() -> None:
        while not stop.is_set():
            with gate.step():
                order.append("step")
                time.sleep(0.002)
        gate.rest()

    def bulk() -> None:
        for _ in range(6):
            with gate.bulk():
                order.append("bulk")
                time.sleep(0.01)  # a parse, ten times a step: without the gate all six would run back to back

    engine_thread = _started(engine)
    while "step" not in order:
        time.sleep(0.001)
    bulk_thread = _started(bulk)
    bulk_thread.join(10)
    stop.set()
    engine_thread.join(10)
    pieces = [i for i, kind in enumerate(order) if kind == "bulk"]
    assert len(pieces) == 6
    assert all(b - a > 1 for a, b in zip(pieces, pieces[1:])), order  # a step between any two


def test_bulk_work_runs_back_to_back_once_the_engines_rest() -> None:
    gate = StepGate()

    def engine() -> None:
        with gate.step():
            pass
        gate.rest()

    _started(engine).join(5)
    started = time.monotonic()
    for _ in range(5):
        with gate.bulk():
            pass
    assert time.monotonic() - started < step_gate.MAX_WAIT_S / 2  # waited for no step


def test_bulk_work_goes_ahead_when_a_step_never_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(step_gate, "MAX_WAIT_S", 0.3)
    gate = StepGate()
    release, held, entered = threading.Event(), threading.Event(), threading.Event()
    _started(_held(gate.step, release, held))
    assert held.wait(5)
    started = time.monotonic()
    _started(_held(gate.bulk, threading.Event(), entered))
    assert entered.wait(5)
    assert 0.25 < time.monotonic() - started < 3
    release.set()
