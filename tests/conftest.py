"""Shared fixtures: the real default model, pulled once into the cache."""

from pathlib import Path

import pytest

from edgeserve.models.catalog import DEFAULT_MODEL, pull


@pytest.fixture(scope="session")
def model_path() -> Path:
    """The default catalog model's GGUF file (pulled on first use)."""
    return pull(DEFAULT_MODEL)
