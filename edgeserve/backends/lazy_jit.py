"""numba's `njit` and `prange` for the fallback kernels, with numba imported when a kernel first runs.

numba takes about half a second to import and only the fallbacks need it (where the C extension is
absent, or EDGESERVE_QMATMUL=numba), so a process whose kernels are the C ones never imports it.
A kernel written with these is compiled by numba, with the same options and on-disk cache, at its
first call.
"""

from __future__ import annotations

import functools
import threading
import types
from collections.abc import Callable
from typing import Any


class _ParallelRange:
    """Stands for numba.prange in a kernel's code until the kernel is compiled."""

    def __call__(self, *args: int) -> range:
        return range(*args)


prange = _ParallelRange()


class LazyKernel:
    """A function numba compiles (numba.njit with `options`) when it is first called."""

    def __init__(self, py_func: Callable, options: dict[str, Any]):
        functools.update_wrapper(self, py_func)
        self.py_func = py_func
        self.options = options
        self._compiled: Callable | None = None
        self._lock = threading.Lock()  # the attention kernel's first calls can come from several threads

    def __call__(self, *args: Any) -> Any:
        return self.compiled()(*args)

    def compiled(self) -> Callable:
        """numba's dispatcher for the function, compiled (or loaded from numba's cache) on the first call."""
        if self._compiled is None:
            with self._lock:
                if self._compiled is None:
                    self._compiled = self._compile()
        return self._compiled

    def _compile(self) -> Callable:
        import numba

        # numba resolves a kernel's globals when it compiles it: there prange must be numba's, and a
        # kernel it calls must be that kernel's compiled form. The module's own names stay as they are.
        scope = dict(self.py_func.__globals__)
        for name in self.py_func.__code__.co_names:
            value = scope.get(name)
            if value is prange:
                scope[name] = numba.prange
            elif isinstance(value, LazyKernel):
                scope[name] = value.compiled()
        func = types.FunctionType(self.py_func.__code__, scope, self.py_func.__name__, self.py_func.__defaults__,
                                  self.py_func.__closure__)
        func.__qualname__ = self.py_func.__qualname__
        func.__module__ = self.py_func.__module__
        return numba.njit(**self.options)(func)


def njit(**options: Any) -> Callable[[Callable], LazyKernel]:
    """numba.njit(**options), compiled at the first call instead of importing numba now."""

    def decorate(py_func: Callable) -> LazyKernel:
        return LazyKernel(py_func, options)

    return decorate
