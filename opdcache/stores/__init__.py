"""The teacher stores, one file each; this registry is the only list of them.

A new store is one file in this folder filling in :class:`opdcache.stores.base.Store` and one line below. The format
(opdcache/format/schema.py), score-teacher's checks and encoding (opdcache/teacher/scoring.py), validate's row rules, the loader and
``info`` read this registry.
"""

from __future__ import annotations

from opdcache.stores import aligned, entropy, hidden, logprob, sampled, svd, topk
from opdcache.stores.base import Column, Store, Violation

REGISTRY: dict[str, Store] = {s.name: s for s in (
    logprob.STORE,
    topk.STORE,
    hidden.STORE,
    svd.STORE,
    sampled.STORE,
    entropy.STORE,
    aligned.STORE,
)}
"""Every teacher store by name, in the order their columns are written."""

__all__ = ["ALWAYS", "Column", "REGISTRY", "Store", "Violation", "always", "columns", "check_job", "check_params", "describe", "enabled", "gives",
           "giving", "needing_hidden", "needing_own_tokenizer", "signal_columns"]


def always() -> tuple[str, ...]:
    """The stores every teacher table holds, whatever ``--store`` names."""
    return tuple(name for name, store in REGISTRY.items() if store.always)


ALWAYS = always()
"""The stores every teacher table holds: ``score-teacher --store``'s and the loader's default."""


def describe(name: str, record) -> list[str]:
    """The store ``name``'s lines for the record a manifest keeps under its name (``Store.describe``); a record of
    another shape (a manifest is untrusted input) is one line saying so, never an exception."""
    try:
        return [str(line) for line in REGISTRY[name].describe(record)]
    except (KeyError, TypeError, ValueError, AttributeError, IndexError):
        return [f"{name} store: its record in the manifest is not one opdcache wrote (nothing to show)"]


def needing_hidden(names) -> bool:
    """Whether any of the stores ``names`` is made from the engine's hidden states (score()'s ``hidden`` argument)."""
    from opdcache.backends.base import STATISTICS

    return any(STATISTICS[n].source == "hidden_states" for name in names if name in REGISTRY for n in REGISTRY[name].needs)


def enabled(names, own_tokenizer: bool) -> tuple[str, ...]:
    """The stores a teacher table holds when ``--store`` names ``names``: those always held first, then ``names`` in
    their order, then those a teacher with its own tokenizer holds (``own_tokenizer``); each once."""
    mine = tuple(name for name, store in REGISTRY.items() if store.own_tokenizer) if own_tokenizer else ()
    return tuple(dict.fromkeys(always() + tuple(names) + mine))


def needing_own_tokenizer(names) -> list[str]:
    """Those of ``names`` that only a teacher with its own tokenizer holds."""
    return [name for name in names if name in REGISTRY and REGISTRY[name].own_tokenizer]


def columns() -> tuple[Column, ...]:
    """Every teacher store's columns, in registry order."""
    return tuple(c for store in REGISTRY.values() for c in store.columns)


def check_job(job, enabled: tuple[str, ...]) -> None:
    """Every store's checks of a score-teacher job's settings (ConfigError, one line)."""
    for store in REGISTRY.values():
        store.check_job(job, store.name in enabled)


def check_params(params) -> None:
    """Every store's checks of a table's recorded parameters (ConfigError, one line)."""
    for store in REGISTRY.values():
        store.check_params(params)


def giving(signal: str, among: tuple[str, ...] = ()) -> str:
    """The store a loss reads ``signal`` from (``opdcache.stores.base.SIGNALS``): the first of ``among`` (a table's stores)
    that gives it, else the registry's first."""
    names = [name for name, store in REGISTRY.items() if signal in store.gives]
    return next((name for name in names if name in among), names[0])


def gives(stores: tuple[str, ...], signal: str) -> bool:
    """Whether any of ``stores`` gives ``signal``."""
    return any(signal in REGISTRY[name].gives for name in stores if name in REGISTRY)


def signal_columns(signal: str) -> tuple[str, ...]:
    """The columns of every store giving ``signal`` (e.g. the vectors kept as their stored bits until they reach torch)."""
    return tuple(c.name for store in REGISTRY.values() if signal in store.gives for c in store.columns)
