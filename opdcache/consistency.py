"""Teacher consistency: the verdict from lineage, in one line (the full empirical probe is `check-consistency`)."""

from __future__ import annotations

from pathlib import Path

from opdcache.cache import Cache


def lineage_line(cache_root: str | Path, teacher: str | None) -> str:
    """'teacher consistency: <verdict> (...)' for the teacher a run is about to use, from the manifest."""
    cache = Cache(cache_root)
    table = cache.table(cache.teacher_table(teacher))
    c = table.get("consistency") or {"verdict": "unknown", "note": "no consistency record"}
    return f"teacher consistency: {c['verdict']} ({c['note']})"
