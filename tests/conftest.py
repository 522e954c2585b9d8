"""Shared fixtures: the real default model, pulled once into the cache."""

from pathlib import Path

import pytest

from edgeserve.models.catalog import DEFAULT_MODEL, pull


@pytest.fixture(scope="session")
def model_path() -> Path:
    """The default catalog model's GGUF file (pulled on first use)."""
    return pull(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def loaded_model(model_path: Path):
    """The default model parsed once per test session (GGUF parsing takes seconds)."""
    from edgeserve.models.loader import load_model

    return load_model(str(model_path))
