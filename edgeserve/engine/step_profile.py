"""Where a step's time goes: seconds per phase, summed over the steps run (`edgeserve bench --profile`).

A step is laid out as consecutive phases; each `lap` closes the phase that ran since the last mark.
Everything but `eval` (waiting for the device's results) and `idle` (between steps) is host work.
"""

from __future__ import annotations

import time

PHASES = (
    "schedule",  # the scheduler and the block manager
    "draft",  # a draft model's guesses for speculative decoding (its forward passes and draws)
    "batch",  # the step's NumPy arrays: tokens, positions, slots, block tables; pool copies and tier moves
    "graph",  # the forward pass: per-step device arrays and the lazy graph (MLX), or the computation (NumPy)
    "eval",  # evaluating the graph and bringing its results to the host
    "sample",  # grammar masks, sampling, logprobs
    "output",  # counting computed tokens, the prefix cache, draft checks, stop checks, detokenizing
)
HOST_PHASES = tuple(p for p in PHASES if p != "eval")


class StepProfile:
    """Seconds per phase over the steps since the last `reset`, and the idle time between them."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.seconds = dict.fromkeys((*PHASES, "idle"), 0.0)
        self.steps = 0
        self._mark = 0.0
        self._last_end: float | None = None

    def begin(self) -> None:
        now = time.perf_counter()
        if self._last_end is not None:
            self.seconds["idle"] += now - self._last_end
        self._mark = now

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] += now - self._mark
        self._mark = now

    def end(self, phase: str, steps: int = 1) -> None:
        """Close the step's last phase; steps: the model steps it ran (a burst of decode steps runs several)."""
        self.lap(phase)
        self.steps += steps
        self._last_end = self._mark

    def summary(self) -> dict:
        """Seconds per step of each phase ('schedule_s', ..., 'idle_s'), of host work ('host_s': every phase but
        eval) and of the whole step ('step_s'), and the number of steps."""
        n = max(self.steps, 1)
        host = sum(self.seconds[p] for p in HOST_PHASES)
        per_step = {**self.seconds, "host": host, "step": host + self.seconds["eval"]}
        return {"steps": self.steps, **{f"{p}_s": round(s / n, 7) for p, s in per_step.items()}}
