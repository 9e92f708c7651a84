"""Progress bars: tqdm on a terminal, silent when output is redirected (logs stay clean)."""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager


def enabled_by_default() -> bool:
    if os.environ.get("OPDCACHE_PROGRESS") in ("0", "1"):
        return os.environ["OPDCACHE_PROGRESS"] == "1"
    return sys.stderr.isatty()


class _Null:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix(self, **kwargs) -> None:
        pass

    def set_postfix_str(self, s: str) -> None:
        pass


@contextmanager
def bar(total: int | None = None, desc: str = "", unit: str = "it", enabled: bool | None = None):
    """A tqdm bar, or a no-op object with the same methods when disabled or not on a terminal."""
    if enabled is None:
        enabled = enabled_by_default()
    if not enabled or not enabled_by_default():
        yield _Null()
        return
    from tqdm.auto import tqdm

    with tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, leave=False) as pbar:
        yield pbar
