"""Verifiers: the rewards stored with each sampled row, behind one small contract.

A verifier is a function ``verify(response: str, task: dict) -> float | bool | tuple[float, str]``: the decoded
response and the row's task fields (``answer``, ``metadata`` as a dict, ``prompt_index``) give a score in [0, 1],
optionally with a reason. ``--reward NAME`` picks a built-in or a registered plugin; ``--reward module:function``
imports any function. Built-ins:

* ``exact``: the response, normalised (stripped, inner whitespace collapsed, case-folded), equals the ``answer``;
* ``math``: the response's last ``\\boxed{...}`` is mathematically equivalent to the ``answer``, by the
  ``math-verify`` package (``pip install 'opdcache[math]'``); a response with no ``\\boxed{}`` scores 0;
* ``math-fallback``: as ``math``, but a response without ``\\boxed{}`` is judged by its last number or expression
  (opt-in: a response that stops mid-sentence can end on the right number by chance).

A response cut off by ``--max-new-tokens`` (``finish_reason`` 'length') scores 0 with every verifier, whatever it
ends with, unless the job passes ``--credit-truncated`` (``task["finish_reason"]`` tells a verifier which it is).

Other packages register verifiers under the ``opdcache.verifiers`` entry-point group (the embedded demo registers
``addition`` this way), so the library never imports them by name. A verifier that raises, or returns something
outside [0, 1], marks only that row: its reward is left empty and the reason is recorded.
"""

from __future__ import annotations

import importlib
import re
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

from opdcache.errors import ConfigError

ENTRY_POINT_GROUP = "opdcache.verifiers"


@dataclass(frozen=True)
class Verdict:
    score: float | None
    """In [0, 1]; None when the verifier failed on this row."""
    reason: str | None = None
    """Why (from the verifier), or what went wrong."""


def _normalise(text: str) -> str:
    return re.sub(r"\s+", " ", text.strip()).casefold()


def exact(response: str, task: dict) -> float:
    """1.0 when the normalised response equals the normalised answer."""
    return float(_normalise(response) == _normalise(str(task["answer"])))


def _last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}``, braces balanced; None without one."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1: j]
    return None  # unclosed


def math_equivalent(response: str, task: dict, fallback: bool = False) -> tuple[float, str]:
    """1.0 when the response's last \\boxed{} (with ``fallback``, else its last number or expression) is mathematically
    equivalent to the reference answer (math-verify)."""
    try:
        from math_verify import parse, verify
    except ImportError:
        raise ConfigError("--reward math needs the math-verify package: pip install 'opdcache[math]'") from None
    boxed = _last_boxed(response)
    if boxed is None and not fallback:
        return 0.0, "no \\boxed{} final answer (--reward math-fallback judges the last number instead)"
    if boxed is not None:
        response = f"$\\boxed{{{boxed}}}$"
    gold = parse(str(task["answer"]))
    if not gold:  # a bare reference ("1/2", "0.5") may need a math environment to parse
        gold = parse(f"${task['answer']}$")
    got = parse(response)
    if not got:
        return 0.0, "no final answer found in the response"
    return (1.0, "equivalent") if verify(gold, got) else (0.0, f"final answer {got[-1]!s} is not {task['answer']}")


def math_fallback(response: str, task: dict) -> tuple[float, str]:
    """``math``, judging a response without \\boxed{} by its last number or expression (opt-in)."""
    return math_equivalent(response, task, fallback=True)


BUILTIN: dict[str, Callable] = {"exact": exact, "math": math_equivalent, "math-fallback": math_fallback}


def _plugins() -> dict:
    from importlib.metadata import entry_points

    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def available() -> list[str]:
    return sorted(set(BUILTIN) | set(_plugins()))


def resolve(spec: str) -> Callable:
    """The verifier named by ``--reward``: a built-in, a registered plugin, or ``module:function``."""
    if spec in BUILTIN:
        if spec.startswith("math"):  # checked here, at argument checking, not after every response is generated
            from importlib.util import find_spec

            if find_spec("math_verify") is None:
                raise ConfigError(f"--reward {spec} needs the math-verify package: pip install 'opdcache[math]'")
        return BUILTIN[spec]
    plugins = _plugins()
    if spec in plugins:
        return plugins[spec].load()
    if ":" in spec:
        module, _, name = spec.partition(":")
        try:
            fn = getattr(importlib.import_module(module), name)
        except Exception as exc:  # noqa: BLE001 (ImportError, AttributeError, a SyntaxError in it, whatever its import raises)
            first = (str(exc).strip().splitlines() or [""])[0][:200]
            raise ConfigError(f"--reward {spec}: cannot import {name!r} from {module!r} ({type(exc).__name__}: {first}); "
                              "check the module path and that the module imports on its own") from None
        if not callable(fn):
            raise ConfigError(f"--reward {spec}: {name!r} is not a function")
        return fn
    raise ConfigError(f"--reward must be one of {', '.join(available())} or module:function, got {spec!r}")


@contextmanager
def _interrupts_seen():
    """A list that becomes non-empty when SIGINT arrives during the block (the handler then raises KeyboardInterrupt as
    Python's default does), so a verifier's own ``raise KeyboardInterrupt`` can be told from a real Ctrl-C. Outside the
    main thread, or where SIGINT is ignored or handled by someone else, every KeyboardInterrupt counts as real."""
    import signal
    import threading

    seen: list[int] = []
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        seen.append(1)
        yield seen
        return

    def handler(signum, frame):
        seen.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, handler)
    try:
        yield seen
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def score(fn: Callable, response: str, task: dict, credit_truncated: bool = False) -> Verdict:
    """Run one verifier on one row; never raises for the row's sake (the failure becomes the verdict's reason).
    A response cut at the length limit scores 0 without asking the verifier, unless ``credit_truncated``."""
    if task.get("finish_reason") == "length" and not credit_truncated:
        return Verdict(0.0, "cut off by --max-new-tokens: no credit (--credit-truncated to let the verifier judge it)")
    try:
        with _interrupts_seen() as seen:
            out = fn(response, task)
    except ConfigError:
        raise  # a setup problem (missing package), not this row's
    except KeyboardInterrupt:
        if seen:  # a real Ctrl-C (SIGINT arrived): stop the job as always
            raise
        return Verdict(None, "verifier raised KeyboardInterrupt itself (no Ctrl-C was pressed)")
    except SystemExit as exc:  # sys.exit() inside a verifier must not end the job and lose its shards
        return Verdict(None, f"verifier called sys.exit({str(exc.code)[:100]})")
    except Exception as exc:  # a verifier's bug or a row it cannot read: mark the row, keep the job
        return Verdict(None, f"verifier raised {type(exc).__name__}: {str(exc)[:200]}")
    reason = None
    if isinstance(out, tuple):  # (score, reason); any other tuple shape is this row's failure, not the job's
        if len(out) != 2:
            return Verdict(None, f"verifier returned a tuple of {len(out)} items, not (score, reason): {str(out)[:100]}")
        out, reason = out[0], (None if out[1] is None else str(out[1])[:500])
    try:
        value = float(out)
    except (TypeError, ValueError, OverflowError):
        return Verdict(None, f"verifier returned {repr(out)[:100]}, not a number in [0, 1]")
    if value != value:
        return Verdict(None, "verifier returned NaN, not a number in [0, 1]")
    if not 0.0 <= value <= 1.0:
        return Verdict(None, f"verifier returned {value}, outside [0, 1]")
    return Verdict(value, reason)
