"""opdcache/stores/rowrules.py's fast paths (whole-array tests first, per-row reductions only for a broken shard) against the
plain per-row rules they replace, on valid and damaged stores of every layout."""

from __future__ import annotations

import numpy as np
import pytest

from opdcache.format import schema as S
from opdcache.stores import rowrules

V = 1000


def _outside_reference(ids, vocab, pad):
    hi = vocab if vocab is not None else np.iinfo(np.int64).max
    return (((ids < 0) | (ids >= hi)) & ~pad).any(axis=1)


def _duplicates_reference(ids, pad):
    x = np.where(pad, np.iinfo(np.int64).min + np.arange(ids.shape[1]), ids.astype(np.int64))
    x.sort(axis=1)
    return (x[:, 1:] == x[:, :-1]).any(axis=1)


def topk_reference(prefix, ids, lps, vocab, tail=None, tol=1e-3, order="logprobs"):
    """The plain rules: every rule as a per-row reduction, in the order the loader reports the first of."""
    col_ids, col_lps = f"{prefix}_ids", f"{prefix}_logprobs"
    pad = ids == S.PAD_ID if tail is not None else np.zeros(ids.shape, bool)
    out = [(col_ids, _outside_reference(ids, vocab, pad), f"token id outside the vocabulary [0, {vocab})")]
    if tail is not None:
        out.append((col_ids, (pad[:, :-1] & ~pad[:, 1:]).any(axis=1) | pad[:, 0] | (pad != (lps == -np.inf)).any(axis=1),
                    "padding (id -1, log-prob -inf) must fill the trailing slots only, after at least one entry"))
    out.append((col_ids, _duplicates_reference(ids, pad), "duplicate token ids in a top-k row"))
    kept = np.where(pad, 0.0, lps)
    finite = np.isfinite(kept).all(axis=1)
    out.append((col_lps, ~finite, "non-finite log-prob"))
    out.append((col_lps, (kept > 0).any(axis=1) & finite, "log-prob above 0"))
    if order == "ids":
        ascending = (np.diff(ids.astype(np.int64), axis=1) > 0) | pad[:, 1:]
        out.append((col_ids, ~ascending.all(axis=1), "top-k ids of a prob14 row not ascending"))
    else:
        with np.errstate(invalid="ignore"):
            out.append((col_lps, (np.diff(lps, axis=1) > 0).any(axis=1), "top-k log-probs not sorted descending"))
    with np.errstate(over="ignore"):
        mass = np.exp(lps).sum(axis=1, dtype=np.float64)
    out.append((col_lps, mass > 1 + tol, "top-k probabilities sum to more than 1"))
    if tail is not None:
        with np.errstate(invalid="ignore"):
            out.append((f"{prefix}_tail", ~((tail >= 0) & (tail <= 1)) | (np.abs(mass + tail - 1) > tol),
                        f"tail outside [0, 1], or kept probabilities plus tail differ from 1 by more than {tol:g}"))
    return [v for v in out if v[1].any()]


def sampled_reference(ids, counts, lps, samples, vocab):
    pad = ids == S.PAD_ID
    c = counts.astype(np.int64)
    with np.errstate(invalid="ignore"):
        out = [
            ("sampled_ids", _outside_reference(ids, vocab, pad), f"token id outside the vocabulary [0, {vocab})"),
            ("sampled_ids", (pad[:, :-1] & ~pad[:, 1:]).any(axis=1) | pad[:, 0],
             "padding (id -1) must fill the trailing slots only, after at least one entry"),
            ("sampled_counts", (c.sum(axis=1) != samples) | ((c == 0) != pad).any(axis=1) | (c < 0).any(axis=1),
             f"counts must be positive, sum to {samples} (samples_per_position), and be 0 exactly at padding"),
            ("sampled_logprobs", ((pad & (lps != -np.inf)) | (~pad & (~np.isfinite(lps) | (lps > 0)))).any(axis=1),
             "log-probs must be finite and not above 0 at entries, -inf at padding"),
            ("sampled_ids", _duplicates_reference(ids, pad), "duplicate token ids in a sampled row"),
        ]
    return [v for v in out if v[1].any()]


def _same(fast, ref):
    assert [(c, m) for c, _, m in fast] == [(c, m) for c, _, m in ref]
    for (_, a, _), (_, b, _) in zip(fast, ref):
        np.testing.assert_array_equal(a, b)


def _topk(rng, n, k, layout):
    """A valid store of ``layout``: v1 (float32, descending), compact (descending, trailing padding, tail) or prob14
    (kept ids ascending, trailing padding, tail)."""
    x = rng.random((n, k + 1)) * 6
    lp = -np.sort(-(x - np.log(np.exp(x).sum(1, keepdims=True))), axis=1)[:, :k].astype(np.float32)
    ids = np.stack([rng.choice(V, k, replace=False) for _ in range(n)]).astype(np.int32)
    if layout == "v1":
        return ids, lp, None
    kept = rng.integers(1, k + 1, n)
    pad = np.arange(k)[None] >= kept[:, None]
    if layout == "prob14":
        ids = np.sort(ids, axis=1)
    ids, lp = np.where(pad, S.PAD_ID, ids).astype(np.int32), np.where(pad, -np.inf, lp).astype(np.float32)
    tail = (1 - np.exp(lp.astype(np.float64)).sum(1)).astype(np.float32)
    return ids, lp, tail


DAMAGE = ["id_high", "id_negative", "duplicate", "nan", "posinf", "above_zero", "unsorted", "mass", "pad_middle", "tail"]


def _damage(rng, ids, lp, tail, kind):
    ids, lp = ids.copy(), lp.copy()
    tail = None if tail is None else tail.copy()
    rows = rng.choice(len(ids), 3, replace=False)
    for r in rows:
        if kind == "id_high":
            ids[r, 0] = V + 5
        elif kind == "id_negative":
            ids[r, 0] = -7
        elif kind == "duplicate" and ids.shape[1] > 1 and ids[r, 1] != S.PAD_ID:
            ids[r, 1] = ids[r, 0]
        elif kind == "nan":
            lp[r, 0] = np.nan
        elif kind == "posinf":
            lp[r, -1] = np.inf
        elif kind == "above_zero":
            lp[r, 0] = 0.5
        elif kind == "unsorted":
            lp[r, :] = lp[r, ::-1]
            ids[r, :] = ids[r, ::-1]
        elif kind == "mass":
            lp[r, 0] = -1e-6
            if ids.shape[1] > 1:
                lp[r, 1] = np.where(lp[r, 1] == -np.inf, lp[r, 1], -0.01)
        elif kind == "pad_middle":
            ids[r, 0], lp[r, 0] = S.PAD_ID, -np.inf
        elif kind == "tail" and tail is not None:
            tail[r] = 1.5
    return ids, lp, tail


@pytest.mark.parametrize("block_rows", [rowrules.BLOCK_ROWS, 7])  # 7: the 200 rows in 29 blocks, the last one short
@pytest.mark.parametrize("layout", ["v1", "compact", "prob14"])
@pytest.mark.parametrize("damage", [None] + DAMAGE)
def test_topk_rules_match_the_plain_per_row_rules(layout, damage, block_rows):
    rng = np.random.default_rng(len(layout) * 31 + (DAMAGE.index(damage) + 1 if damage else 0))
    ids, lp, tail = _topk(rng, 200, 12, layout)
    tol, order = (1e-3 + 12 * S.PROB14_STEP / 2, "ids") if layout == "prob14" else (1e-3, "logprobs")
    if damage:
        ids, lp, tail = _damage(rng, ids, lp, tail, damage)
    fast = rowrules.topk_rules("topk", ids, lp, V, tail, tol, order, block_rows=block_rows)
    _same(fast, topk_reference("topk", ids, lp, V, tail, tol, order))
    if damage is None:
        assert fast == []
    elif damage not in ("tail", "duplicate") or layout != "v1":
        assert fast, f"{damage} was not found"


def test_blocks_merge_violations_in_rule_order_and_name_every_row():
    """A rule broken only in a later block still comes after one broken in an earlier block only if it comes after it
    in the rules' order: the loader refuses at the first violation, so the order is what it reports."""
    rng = np.random.default_rng(9)
    ids, lp, _ = _topk(rng, 40, 6, "v1")
    lp[2, 0] = 0.5  # "log-prob above 0" and "sum to more than 1" (later rules), in the first block
    ids[37, 0] = V  # "outside the vocabulary" (the first rule), in the last block
    ref = topk_reference("topk", ids, lp, V)
    for block_rows in (5, 40, 1000):
        fast = rowrules.topk_rules("topk", ids, lp, V, block_rows=block_rows)
        _same(fast, ref)
        assert [(message.split()[0], np.flatnonzero(bad).tolist()) for _, bad, message in fast] == [
            ("token", [37]), ("log-prob", [2]), ("top-k", [2])]


@pytest.mark.parametrize("k", [0, 1, 2])
def test_narrow_rows_are_checked_like_the_plain_rules(k):
    """Widths with no neighbour pairs (0, 1) and one pair (2), valid and with a duplicate or an unsorted row."""
    ids = np.tile(np.arange(k, dtype=np.int32), (6, 1))
    lp = np.tile(np.log(np.full(k, 1 / (k + 1), np.float32)) - np.arange(k, dtype=np.float32), (6, 1))
    assert rowrules.topk_rules("topk", ids, lp, V) == topk_reference("topk", ids, lp, V) == []
    if k == 2:
        ids[3, 1], lp[4] = ids[3, 0], lp[4, ::-1]
        _same(rowrules.topk_rules("topk", ids, lp, V, block_rows=4), topk_reference("topk", ids, lp, V))
        assert len(rowrules.topk_rules("topk", ids, lp, V)) == 2


def test_every_damaged_row_is_named_and_an_empty_shard_passes():
    rng = np.random.default_rng(5)
    ids, lp, tail = _topk(rng, 50, 8, "compact")
    ids[[3, 17], 0] = V
    (column, bad, message), = rowrules.topk_rules("topk", ids, lp, V, tail)
    assert (column, message) == ("topk_ids", f"token id outside the vocabulary [0, {V})") and np.flatnonzero(bad).tolist() == [3, 17]
    empty = np.zeros((0, 8), np.int32)
    assert rowrules.topk_rules("topk", empty, np.zeros((0, 8), np.float32), V, np.zeros(0, np.float32)) == []
    assert rowrules.ids_in_vocabulary("response_ids", np.zeros(0, np.int32), V) == []


@pytest.mark.parametrize("block_rows", [rowrules.BLOCK_ROWS, 4])
@pytest.mark.parametrize("damage", [None, "id_high", "duplicate", "count", "pad_lp", "nan", "pad_middle"])
def test_sampled_rules_match_the_plain_per_row_rules(damage, block_rows):
    rng = np.random.default_rng(11)
    n, k, m = 150, 6, 12
    ids, lp, _ = _topk(rng, n, k, "compact")
    pad = ids == S.PAD_ID
    counts = np.where(pad, 0, 1).astype(np.int32)
    counts[:, 0] += m - counts.sum(1)
    r = rng.choice(n, 2, replace=False)
    if damage == "id_high":
        ids[r, 0] = V
    elif damage == "duplicate":
        ids[r, 0] = np.where(ids[r, 1] == S.PAD_ID, ids[r, 0], ids[r, 1])
    elif damage == "count":
        counts[r, 0] += 1
    elif damage == "pad_lp":
        lp[r, -1] = np.where(pad[r, -1], -1.0, lp[r, -1])
    elif damage == "nan":
        lp[r, 0] = np.nan
    elif damage == "pad_middle":
        ids[r, 0] = S.PAD_ID
    fast = rowrules.sampled_rules(ids, counts, lp, m, V, block_rows=block_rows)
    _same(fast, sampled_reference(ids, counts, lp, m, V))
    assert bool(fast) == (damage is not None)


@pytest.mark.parametrize("block_rows", [rowrules.BLOCK_ROWS, 7])
def test_the_sampled_token_against_its_top_k_entry_is_the_plain_per_token_rule(block_rows):
    """against_topk in blocks of rows reports exactly the tokens a plain per-token loop finds."""
    rng = np.random.default_rng(3)
    T, k = 200, 5
    lps = np.sort(np.log(rng.dirichlet(np.ones(k + 3), T)[:, :k]), axis=1)[:, ::-1].astype(np.float32)
    ids = np.stack([rng.permutation(50)[:k] for _ in range(T)]).astype(np.int32)
    sampled = np.where(rng.random(T) < 0.5, ids[np.arange(T), rng.integers(0, k, T)], 60).astype(np.int32)
    hit_at = [list(ids[t]).index(sampled[t]) if sampled[t] in ids[t] else None for t in range(T)]
    sampled_lp = np.array([lps[t, j] if j is not None else lps[t, -1] - 1.0 for t, j in enumerate(hit_at)], np.float32)
    sampled_lp[[3, 50]] += 0.5  # off its entry when inside, above the k-th when outside
    sampled_lp[[120, 199]] = 0.0
    got = {message: np.flatnonzero(bad).tolist()
           for _, bad, message in rowrules.against_topk("logprobs", sampled, sampled_lp, ids, lps, block_rows=block_rows)}
    tol = rowrules.LOGPROB_TOL
    want = {"log-prob of the sampled token disagrees with its top-k entry":
            [t for t, j in enumerate(hit_at) if j is not None and abs(lps[t, j] - sampled_lp[t]) > tol],
            "sampled token is outside the top-k but more likely than the k-th":
            [t for t, j in enumerate(hit_at) if j is None and sampled_lp[t] > lps[t].min() + tol]}
    assert got == {m: v for m, v in want.items() if v} and all(want.values())
