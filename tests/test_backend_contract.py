"""Every backend provides the Backend protocol (each member, with the protocol's parameters), and
the model, the KV pool and the runner use nothing of a backend beyond it."""

from __future__ import annotations

import importlib.util
import inspect
import typing

import numpy as np
import pytest

from edgeserve.backends import Backend, get_backend
from edgeserve.batch import random_paged_batch
from edgeserve.engine.kv_budget import PoolSize
from edgeserve.engine.model_runner import ModelRunner

METHODS = {name: f for name, f in vars(Backend).items() if inspect.isfunction(f) and not name.startswith("_")}
ATTRIBUTES = typing.get_type_hints(Backend)  # the data members: name, kv_dtype

BACKENDS = [
    pytest.param(("numpy", "float32"), id="numpy-float32"),
    pytest.param(("numpy", "quantized"), id="numpy-quantized"),
    pytest.param(("mlx", "auto"), id="mlx", marks=pytest.mark.skipif(
        importlib.util.find_spec("mlx") is None, reason="MLX is not installed: MLX backend not checked")),
]


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request) -> Backend:
    name, weights = request.param
    return get_backend(name, weights=weights)


def test_the_protocol_lists_the_operations():
    assert len(METHODS) + len(ATTRIBUTES) >= 20
    assert {"linear", "batch_meta", "paged_attention", "allocate_kv", "write_kv", "copy_blocks"} <= set(METHODS)


def test_backend_has_every_member_with_the_protocol_signature(backend):
    assert isinstance(backend, Backend)
    for name, kind in ATTRIBUTES.items():
        assert isinstance(getattr(backend, name), kind), name
    for name, proto in METHODS.items():
        ours = inspect.signature(getattr(type(backend), name))
        want = inspect.signature(proto)
        shape = [(p.name, p.kind, p.default) for p in ours.parameters.values()]
        assert shape == [(p.name, p.kind, p.default) for p in want.parameters.values()], f"{name}{ours} vs {want}"


class ContractOnly:
    """A backend seen only through the protocol: any other attribute raises AttributeError."""

    def __init__(self, backend: Backend):
        self._backend = backend

    def __getattr__(self, name: str):
        if name not in METHODS and name not in ATTRIBUTES:
            raise AttributeError(f"{name!r} is not part of the Backend protocol")
        return getattr(self._backend, name)


def test_model_pool_and_runner_use_only_the_protocol(tiny_model, backend):
    runner = ModelRunner(tiny_model, ContractOnly(backend), PoolSize(num_blocks=4, block_size=16, bytes_per_token=0))
    rng = np.random.default_rng(0)
    batch, _ = random_paged_batch([20, 7], [20, 1], 16, rng)
    batch.token_ids = rng.integers(0, tiny_model.args.vocab_size, len(batch.positions))
    batch.logits_indices = np.array([19, 20])
    logits = runner.backend.to_numpy(runner.model.forward(batch, runner.kv))
    assert logits.shape == (2, tiny_model.args.vocab_size) and np.isfinite(logits).all()
    runner.copy_blocks([(0, 3)])
    assert np.array_equal(runner.backend.to_numpy(runner.kv.k[0][3]), runner.backend.to_numpy(runner.kv.k[0][0]))
