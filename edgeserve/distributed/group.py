"""The processes `mlx.launch` started, as one group: this process's rank, rank 0's messages to every rank, arrays
handed to a neighbour, and a rank that stops answering turned into one clear error instead of a hang.

MLX's ring backend sends only between neighbours in the ring (rank r and r +- 1), so a message for every rank
goes out as an all_sum to which only rank 0 adds anything. A peer that dies closes its sockets, and the ring
then fails whatever waits on it at once (GroupLostError here); a peer that hangs (a machine gone from the
network) would leave rank 0 waiting for ever, so rank 0 gives each step `timeout` seconds and then stops the
process with the error, which ends the group (`mlx.launch` stops the other ranks).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import mlx.core as mx
import numpy as np

from edgeserve.errors import GroupLostError

STEP_TIMEOUT = 60.0  # seconds rank 0 waits on the group in one step before it counts the group as lost


class Group:
    """This process's place in the group, and the group's messages; `bytes_sent` counts what this rank sends."""

    def __init__(self, group: mx.distributed.Group, timeout: float = STEP_TIMEOUT):
        self.group = group
        self.rank, self.size = group.rank(), group.size()
        self.bytes_sent = 0
        self._watchdog = _Watchdog(timeout) if self.rank == 0 else None

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Run work that waits on other ranks: a lost peer raises GroupLostError; on rank 0 a peer that does not
        answer within the timeout ends the process."""
        watch = self._watchdog.watch() if self._watchdog is not None else contextlib.nullcontext()
        try:
            with watch:
                yield
        except RuntimeError as exc:
            if "[ring]" not in str(exc):  # MLX's own failure, not the ring's
                raise
            raise GroupLostError(f"a rank of the group is gone ({exc}): the model is split across the group, so "
                                 "it cannot run on; start the group again") from exc

    def broadcast(self, message: dict[str, Any] | None = None) -> dict[str, Any]:
        """Rank 0's message (rank 0 passes it), on every rank (the others pass nothing and wait for it)."""
        data = encode(message) if self.rank == 0 else None
        with self.guard():
            length = self._sum(np.array([0 if data is None else len(data)], np.int32))
            received = self._sum(data if data is not None else np.zeros(int(length[0]), np.uint8))
        if data is not None:
            self.bytes_sent += len(data)
        return decode(received)

    def send(self, x: mx.array, dst: int) -> mx.array:
        """x to a neighbour in the ring, sent once the returned array is evaluated."""
        self.bytes_sent += x.nbytes
        return mx.distributed.send(x, dst, group=self.group)

    def recv(self, shape: tuple[int, ...], dtype: mx.Dtype, src: int) -> mx.array:
        """An array from a neighbour in the ring, received once evaluated."""
        return mx.distributed.recv(shape, dtype, src, group=self.group)

    def gather(self, part: np.ndarray, sizes: list[int]) -> list[np.ndarray]:
        """Every rank's bytes (each rank passes its own; sizes: every rank's byte count), on every rank."""
        offsets = np.cumsum([0, *sizes])
        buffer = np.zeros(offsets[-1], np.uint8)
        buffer[offsets[self.rank] : offsets[self.rank + 1]] = part.reshape(-1).view(np.uint8)
        self.bytes_sent += part.nbytes
        with self.guard():
            total = self._sum(buffer)
        return [total[a:b] for a, b in zip(offsets[:-1], offsets[1:])]

    def _sum(self, x: np.ndarray) -> np.ndarray:
        # no stream named: MLX runs the ring's operations on the CPU itself, on the calling thread's own stream (a
        # stream made in another thread cannot run there, and the server's engine has a thread of its own)
        out = mx.distributed.all_sum(mx.array(x), group=self.group)
        mx.eval(out)
        return np.array(out)


@functools.cache
def world() -> Group:
    """The group `mlx.launch` started this process in (one rank alone when it was started otherwise)."""
    return Group(mx.distributed.init())


def encode(message: dict[str, Any]) -> np.ndarray:
    """A message of NumPy arrays and JSON values as bytes: a JSON header, then the arrays' bytes."""
    arrays = {k: np.ascontiguousarray(v) for k, v in message.items() if isinstance(v, np.ndarray)}
    header = json.dumps({"values": {k: v for k, v in message.items() if k not in arrays},
                         "arrays": [[k, a.dtype.str, a.shape] for k, a in arrays.items()]}).encode()
    data = b"".join([len(header).to_bytes(4, "little"), header, *(a.tobytes() for a in arrays.values())])
    return np.frombuffer(data, np.uint8)


def decode(data: np.ndarray) -> dict[str, Any]:
    """The message `encode` made."""
    raw = data.tobytes()
    n = int.from_bytes(raw[:4], "little")
    header = json.loads(raw[4 : 4 + n])
    message = header["values"]
    offset = 4 + n
    for name, dtype, shape in header["arrays"]:
        size = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        message[name] = np.frombuffer(raw, dtype, count=size // np.dtype(dtype).itemsize, offset=offset).reshape(shape)
        offset += size
    return message


class _Watchdog:
    """Ends the process when one `watch()` lasts longer than timeout seconds: the group cannot be waited on from
    another thread, and a rank that does not answer would hold the step (and the server) for ever."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self._deadline: float | None = None
        self._changed = threading.Condition()
        threading.Thread(target=self._run, name="edgeserve-group-watchdog", daemon=True).start()

    @contextlib.contextmanager
    def watch(self) -> Iterator[None]:
        with self._changed:
            self._deadline = time.monotonic() + self.timeout
            self._changed.notify()
        try:
            yield
        finally:
            with self._changed:
                self._deadline = None

    def _run(self) -> None:
        with self._changed:
            while True:
                if self._deadline is None:
                    self._changed.wait()
                elif time.monotonic() < self._deadline:
                    self._changed.wait(self._deadline - time.monotonic())
                else:
                    print(f"error: a rank of the group has not answered for {self.timeout:g} s: the model is split "
                          "across the group, so it cannot run on; stopping", file=sys.stderr, flush=True)
                    os._exit(1)
