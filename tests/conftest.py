import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def _isolated_hash_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("OPDCACHE_HASH_CACHE", str(tmp_path_factory.getbasetemp() / "hashes"))
    monkeypatch.setenv("OPDCACHE_PROGRESS", "0")


@pytest.fixture
def synth_cache(tmp_path):
    from synth import make_cache

    return make_cache(tmp_path / "cache")
