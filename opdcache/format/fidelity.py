"""What a teacher table's stores lose against the teacher's full distribution, measured while scoring.

The scorer streams the whole vocabulary at every position (backends/streamed.py), so it knows, besides what it stores,
the full distribution's entropy H = -E_p[log p] and variance Var_p[log p]. From those and the stored values this module
computes, per position and without any student:

* **topk** (exact or compact): the teacher mass outside the stored support, r = 1 - sum_S p, and
  KL(p || q*), where q* is the *maximum-entropy completion* of the stored signal: the stored values on the support S
  (renormalised with the stored tail bin) and the tail bin's mass spread evenly over the V - |S| other tokens. q* is
  what the stored signal says when nothing else is known, so KL(p || q*) is the information the store dropped, in nats:
  0 for the full distribution, growing with the tail's mass and with how unevenly the teacher spreads it. With the
  exact top-k log-probs and H it is closed-form:
      KL(p || q*) = -H - sum_S p_i log q_i - r log r_q + r log(V - |S|)
  (r_q the stored tail). Its float error is ~1e-6 nats (float32 log-probs, H summed in float64).
* **sampled**: the standard error of the forward-KL estimate's teacher term, sqrt(Var_p[log p] / m): with m draws the
  estimate (1/m) sum_j (log p(x_j) - log q(x_j)) has this spread from the teacher's side alone (the student's side
  is logged by ``train --loss sampled-fkl``).
* **hidden** stored in a lower precision than the teacher computes in (``--hidden-dtype``): KL(p || p_rounded), the
  full distribution rebuilt from the rounded states against the unrounded one (streamed.py's "rkl").
* **svd**: its reconstruction KL on held-out positions is measured when the projection is fitted (opdcache/stores/svdprojection.py)
  and recorded with the fit; it is not repeated here.

Each shard's footer carries the sums (:data:`META`), finalize merges them into the table's manifest entry
(``fidelity``), and ``info`` and the card show it. Memory: per position numbers only (the [T, k] top-k at most).
"""

from __future__ import annotations

import json

import numpy as np

META = b"opdcache.fidelity"
"""Parquet key-value metadata of a teacher shard: the sums of :func:`row_sums`, merged by finalize."""

def quantities() -> dict:
    """Every quantity a fidelity record may hold, with what it means: each store's (``Store.fidelity_means``), then
    the teacher's entropy."""
    from opdcache.stores import REGISTRY

    out = {key: means for store in REGISTRY.values() for key, means in store.fidelity_means.items()}
    return out | {"entropy": "teacher entropy at temperature 1, nats"}  # every one per response position, temperature 1


def _stat(values: np.ndarray) -> dict:
    v = np.asarray(values, np.float64)
    return {"sum": float(v.sum()), "max": float(v.max(initial=0.0)), "positions": int(v.size)}


def row_sums(scores, params, vocab_size: int, encoded: dict | None = None) -> dict:
    """One row's sums (``scores``: the engine's Scores with ``entropy``/``variance``; ``encoded``: each store's encoding
    of the row, by store name, from its ``shard_encoder``). ``{"unmeasured": why}`` when the engine streamed no full
    distribution (vLLM returns the top log-probs only)."""
    from opdcache.stores import REGISTRY

    if getattr(scores, "entropy", None) is None:
        return {"unmeasured": "the engine returns no full distribution (vLLM: top log-probs only); score with --backend transformers to record it"}
    out = {}
    for name in params.stores:
        if name in REGISTRY:
            for key, values in REGISTRY[name].fidelity(scores, params, (encoded or {}).get(name), vocab_size).items():
                out[key] = _stat(values)
    out["entropy"] = _stat(scores.entropy)
    return out


def merge(parts) -> dict:
    """Merge :func:`row_sums` of rows or shards: a quantity missing from one part is missing from the result, and one
    unmeasured part (or none at all) makes the whole unmeasured, with its reason."""
    parts = list(parts)
    if not parts:
        return {"unmeasured": "no rows"}
    for p in parts:
        if not p or "unmeasured" in p:
            return {"unmeasured": (p or {}).get("unmeasured") or "a shard was written by an opdcache that did not record it"}
    out = {}
    for key in parts[0]:
        if all(key in p for p in parts):
            out[key] = {"sum": sum(p[key]["sum"] for p in parts), "max": max(p[key]["max"] for p in parts),
                        "positions": sum(p[key]["positions"] for p in parts)}
    return out


def encode(sums: dict) -> bytes:
    return json.dumps(sums, sort_keys=True).encode()


def unmeasured(reason: str) -> bytes:
    """The footer of a shard written without the teacher's distribution (``opdcache upgrade`` re-encodes stored values)."""
    return encode({"unmeasured": reason})


def summary(sums: dict) -> dict:
    """The manifest's ``fidelity`` record (``sums`` from :func:`merge`): per quantity its mean and max per position,
    what it means, and how many positions it covers; or ``measured: false`` and why."""
    if "unmeasured" in sums:
        return {"measured": False, "reason": str(sums["unmeasured"])}
    out = {"measured": True}
    means = quantities()
    for key, s in sorted(sums.items()):
        out[key] = {"mean": s["sum"] / max(s["positions"], 1), "max": s["max"], "positions": s["positions"], "means": means.get(key, key)}
    return out


def describe(record: dict) -> list[str]:
    """Lines for ``info`` and the card."""
    if not record:
        return ["error against the full vocabulary: not recorded (written before opdcache recorded it; re-score to record it)"]
    if not record.get("measured"):
        return [f"error against the full vocabulary: not measured ({record.get('reason')})"]
    lines = []
    for key in quantities():
        if key in record:
            r = record[key]
            lines.append(f"{r['means']}: mean {r['mean']:.3g}, max {r['max']:.3g} over {r['positions']:,} positions")
    return lines


def record_from_footers(metas: list[dict], where: str, error=ValueError) -> dict:
    """The manifest's ``fidelity`` record from the shards' footer metadata (each a dict of Parquet key-value metadata;
    a shard without the key counts as unmeasured). JSON read within the untrusted-input limits; ``error`` on a bad one."""
    from opdcache.untrusted import loads

    sums = [loads(m[META], where, error) if META in m else {} for m in metas]
    return summary(merge(sums))


def check_record(root, name: str, entry: dict) -> list[tuple[str, str, bool]]:
    """``validate``: (file, message, warning) for a teacher table's ``fidelity`` record: absent is a warning (tables
    written before it was recorded); it must equal what its shards' footers merge to. Reads footers only; a shard that
    cannot be read is left to the shard checks."""
    import pyarrow as pa

    from opdcache.format import shards
    from opdcache.errors import SchemaError
    from opdcache.format.manifest import MANIFEST_NAME

    record = entry.get("fidelity")
    if record is None:
        return [(MANIFEST_NAME, f"table {name} records no error against the full vocabulary (written before opdcache recorded "
                                "it); re-score it with `opdcache score-teacher` to record it", True)]
    metas = []
    for info in entry["shards"]:
        path = root / info["path"]
        try:
            metas.append(shards.read_schema(path).metadata or {})
        except (SchemaError, pa.ArrowException, OSError):
            return []
    try:
        want = record_from_footers(metas, f"{name} shard footer")
    except ValueError as exc:
        return [(name, str(exc), False)]
    except (TypeError, KeyError, AttributeError):
        return [(name, "a shard footer's record of the error against the full vocabulary is malformed; re-score the table", False)]
    if json.dumps(want, sort_keys=True) != json.dumps(record, sort_keys=True):
        return [(MANIFEST_NAME, f"table {name}: the recorded error against the full vocabulary differs from what its shards' "
                                "footers record (the manifest was edited by hand?); re-score the table to rewrite it", False)]
    return []
