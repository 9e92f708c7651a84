"""Progress: a tqdm bar on a terminal, plain periodic lines when asked for elsewhere, nothing by default in logs.

``enabled=None`` (no flag) shows a bar only on a terminal (``OPDCACHE_PROGRESS=0|1`` overrides); ``enabled=True``
(``--progress``) also reports when stderr is a file or a pipe, as one line every ``OPDCACHE_PROGRESS_INTERVAL``
seconds (default 30) and a last one at the end; ``enabled=False`` is silent. Long stages count sequences, not
shards: the bar that :func:`bar` opens with ``track=True`` is advanced by :func:`advance`, which the engines call
after each batch, so a bar moves within a shard; inside a batch, :func:`detail` says where the engine is (the decode
step of the batch), so the first line comes within the first batch's first step, whatever its size. Plain lines
print the first report at once, then at most one per interval.
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager
from contextvars import ContextVar

_current: ContextVar = ContextVar("opdcache_progress", default=None)


def enabled_by_default() -> bool:
    if os.environ.get("OPDCACHE_PROGRESS") in ("0", "1"):
        return os.environ["OPDCACHE_PROGRESS"] == "1"
    return sys.stderr.isatty()


def advance(n: int = 1) -> None:
    """Advance the tracked bar of the running stage by ``n`` sequences (a no-op when none is open)."""
    current = _current.get()
    if current is not None:
        current.update(n)


DETAIL_EVERY = 1.0  # seconds between two refreshes of a terminal bar's detail


def detail(text: str) -> None:
    """Say where the running stage is inside one unit of its count (the engines say "decoding 64 sequences: token 37/128"), shown beside the
    count: on a terminal at most once a second, as plain lines at the reporter's interval (a no-op when none is open)."""
    current = _current.get()
    if current is None:
        return
    if isinstance(current, (_Lines, _Null)):
        current.detail(text)
        return
    now = time.monotonic()
    if now - getattr(current, "_opd_detail_at", 0.0) >= DETAIL_EVERY:
        current._opd_detail_at = now
        current.set_postfix_str(text)


class _Null:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix(self, **kwargs) -> None:
        pass

    def set_postfix_str(self, s: str) -> None:
        pass

    def detail(self, text: str) -> None:
        pass


class _Lines:
    """Progress as plain lines on stderr, at most one per ``interval`` seconds, and one at the end."""

    def __init__(self, total: int | None, desc: str, unit: str, interval: float):
        self.total, self.desc, self.unit, self.interval = total, desc, unit, interval
        self.n, self.postfix, self.where, self.start = 0, "", "", time.monotonic()
        self.last, self.printed = self.start, None  # printed: the (count, postfix) of the last line, None before the first

    def update(self, n: int = 1) -> None:
        self.n += n
        self.where = ""  # a finished unit: the detail was about the one inside it
        self._maybe_print()

    def detail(self, text: str) -> None:
        self.where = text
        self._maybe_print()

    def _maybe_print(self) -> None:
        now = time.monotonic()
        if self.printed is None or now - self.last >= self.interval:  # the first report at once
            self.last = now
            self._print()

    def set_postfix(self, **kwargs) -> None:
        self.postfix = ", ".join(f"{k}={v}" for k, v in kwargs.items())

    def set_postfix_str(self, s: str) -> None:
        self.postfix = s

    def _print(self) -> None:
        done = f"{self.n}/{self.total}" if self.total is not None else f"{self.n}"
        extra = f" ({', '.join(x for x in (self.where, self.postfix) if x)})" if self.where or self.postfix else ""
        self.printed = (self.n, self.postfix)
        print(f"{self.desc}: {done} {self.unit}{extra}, {time.monotonic() - self.start:.0f} s", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.printed != (self.n, self.postfix):  # the final state, once
            self._print()


@contextmanager
def bar(total: int | None = None, desc: str = "", unit: str = "it", enabled: bool | None = None, track: bool = False):
    """A progress reporter with tqdm's ``update`` / ``set_postfix``: tqdm on a terminal, periodic lines when
    ``enabled`` is True elsewhere, a no-op otherwise. ``track``: :func:`advance` updates this one."""
    if enabled is None:
        enabled = enabled_by_default()
    if not enabled:
        reporter, close = _Null(), None
    elif sys.stderr.isatty():
        from tqdm.auto import tqdm

        reporter = tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, leave=False)
        close = reporter.close
    else:
        reporter = _Lines(total, desc, unit, float(os.environ.get("OPDCACHE_PROGRESS_INTERVAL", "30")))
        close = reporter.close
    token = _current.set(reporter) if track else None
    try:
        yield reporter
    finally:
        if token is not None:
            _current.reset(token)
        if close is not None:
            close()
