"""Compact top-k encodings (opdcache/stores/compact.py): each round-trips within its declared bound on adversarial rows."""

import numpy as np
import pytest

from opdcache.errors import ConfigError
from opdcache.stores.compact import distortion, Q8_FLOOR, TopkCodec


def adversarial_rows(k: int = 8):
    """[T, k] ids and log-probs: an ordinary position, exact ties, one token with all the mass (the rest -inf),
    k larger than a 5-token vocabulary (the extra entries -inf), and very small probabilities."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=50) * 2
    lp = logits - np.log(np.exp(logits).sum())
    top = np.argsort(-lp)[:k]
    rows_ids, rows_lp = [top], [lp[top]]
    rows_ids.append(np.arange(k) + 3)
    rows_lp.append(np.full(k, np.log(1 / 16)))  # 8 ties of 1/16: half the mass, the rest outside the top-k
    rows_ids.append(np.arange(k))
    rows_lp.append(np.array([0.0] + [-np.inf] * (k - 1)))
    rows_ids.append(np.arange(k))
    rows_lp.append(np.array([np.log(0.2)] * 5 + [-np.inf] * (k - 5)))
    rows_ids.append(np.arange(k) * 1000)
    rows_lp.append(np.array([-1e-6, -14.0, -15.0, -16.0, -20.0, -30.0, -50.0, -80.0])[:k])
    return np.stack(rows_ids).astype(np.int32), np.stack(rows_lp).astype(np.float32)


def kept_pairs(codec, ids, lps):
    enc = codec.encode(ids, lps)
    return enc, codec.decode(enc)


@pytest.mark.parametrize("precision", ["float32", "float16", "q8"])
def test_round_trip_within_the_declared_bound(precision):
    ids, lps = adversarial_rows()
    codec = TopkCodec(precision)
    enc, decoded = kept_pairs(codec, ids, lps)
    assert enc["counts"].tolist() == [8] * len(ids)  # no mass threshold: every entry kept
    for t, (pid, plp) in enumerate(decoded):
        assert np.all(np.diff(pid) > 0) or len(pid) < 2  # ascending ids
        exact = dict(zip(ids[t].tolist(), lps[t].tolist()))
        assert sorted(pid.tolist()) == sorted(ids[t].tolist())
        for i, v in zip(pid.tolist(), plp.tolist()):
            e = exact[i]
            if precision == "float32":
                assert v == e or (np.isinf(v) and np.isinf(e))
            elif precision == "float16":
                assert (np.isinf(v) and np.isinf(e)) or abs(v - e) <= abs(e) * 2 ** -11 + 2 ** -25  # + float16's subnormal step
            elif e >= -Q8_FLOOR * codec.step:
                assert abs(v - e) <= codec.step / 2 + 1e-6
            else:  # below the range (or -inf): the floor code, whose probability is below e^-15.9
                assert v == -Q8_FLOOR * codec.step
    assert enc["tail"][2] == 0.0 and enc["tail"][1] == pytest.approx(0.5, abs=1e-6)


def test_the_mass_threshold_keeps_the_shortest_prefix():
    ids, lps = adversarial_rows()
    for mass in (0.0, 1e-6, 1e-3, 0.3):
        enc = TopkCodec(mass=mass).encode(ids, lps)
        p = np.exp(lps.astype(np.float64))
        for t, n in enumerate(enc["counts"].tolist()):
            ranked = np.sort(p[t])[::-1]
            residual = 1 - ranked[:n].sum()
            assert 1 <= n <= ids.shape[1]
            assert enc["tail"][t] == pytest.approx(max(residual, 0), abs=1e-6)
            if residual > mass:  # never reached: all k kept
                assert n == ids.shape[1]
            elif n > 1:  # the shortest prefix: one entry fewer would leave more than mass outside
                assert 1 - ranked[: n - 1].sum() > mass
    one = TopkCodec(mass=1e-6).encode(ids, lps)
    assert one["counts"][2] == 1  # all the mass on one token: one entry
    assert TopkCodec(mass=0.5).encode(ids, lps)["counts"][1] == 8  # ties at half the mass: all kept


def test_distortion_is_zero_exactly_when_lossless_and_bounded_otherwise():
    ids, lps = adversarial_rows()
    exact = distortion(TopkCodec(), ids, lps)
    assert exact["max_abs_logprob_error"] == 0 and exact["max_kl"] < 1e-6  # only the float32 tail's rounding
    q8 = distortion(TopkCodec("q8"), ids, lps)
    assert 0 < q8["max_abs_logprob_error"] <= TopkCodec().step / 2 + 1e-6 and q8["max_kl"] < 1e-2
    assert q8["below_range"] == 5  # -16, -20, -30, -50 and -80 lie below -255 / 16 = -15.9375


def test_bad_settings_name_the_fix():
    with pytest.raises(ConfigError, match="--topk-precision must be one of float32, float16, q8"):
        TopkCodec("int4")
    with pytest.raises(ConfigError, match=r"--topk-mass must be in \[0, 1\)"):
        TopkCodec(mass=1.5)
    with pytest.raises(ValueError, match=r"must both be \[T, k\]"):
        TopkCodec().encode(np.zeros((2, 3)), np.zeros((2, 4)))


# ---------------------------------------------------------------- the v3 store: writer, readers, validate, estimators

import json
import shutil
from pathlib import Path

import pyarrow as pa
import torch

from opdcache.format import schema as S, shards

from opdcache.stores import compact

from opdcache.training import losses as L


def test_the_padded_form_keeps_a_rank_ordered_prefix_and_the_exact_tail():
    ids, lps = adversarial_rows()
    for precision, mass in (("float32", None), ("float16", None), ("float32", 1e-3), ("float16", 0.3)):
        enc = compact.compact_topk(ids, lps, precision, mass)
        ragged = TopkCodec(precision, mass).encode(ids, lps)
        assert enc["counts"].tolist() == ragged["counts"].tolist()  # the same support as the codec
        for t in range(len(ids)):
            n = enc["counts"][t]
            order = np.argsort(-lps[t], kind="stable")
            assert enc["ids"][t, :n].tolist() == ids[t][order[:n]].tolist()  # most likely first
            assert (enc["ids"][t, n:] == S.PAD_ID).all() and (enc["logprobs"][t, n:] == -np.inf).all()
            kept_p = np.exp(lps[t][order[:n]].astype(np.float64)).sum()
            assert enc["tail"][t] == pytest.approx(max(0.0, 1 - kept_p), abs=1e-6)
        if precision == "float16":
            assert enc["stored"].dtype == np.uint16
            assert np.array_equal(enc["stored"].view(np.float16).astype(np.float32), enc["logprobs"])
    lossless = compact.distortion_summary(compact.distortion_sums(compact.compact_topk(ids, lps, "float32", None)))
    assert lossless["max_abs_logprob_error"] == 0 and lossless["max_moved_mass"] == 0 and lossless["max_kl_exact_to_compact"] < 1e-9
    lossy = compact.distortion_summary(compact.distortion_sums(compact.compact_topk(ids, lps, "float16", 0.3)))
    assert 0 < lossy["max_abs_logprob_error"] <= 80 * 2 ** -11 and 0 < lossy["max_moved_mass"] <= 0.3


@pytest.fixture(scope="module")
def compact_cache(hf_cache, weights, tmp_path_factory):
    """hf_cache's rollouts scored again into an exact top-16 table and a compact one (float16, mass 1e-3)."""
    from opdcache.teacher.scoring import ScoreJob, run_score

    root = tmp_path_factory.mktemp("compact") / "cache"
    shutil.copytree(hf_cache, root)
    run_score(ScoreJob(cache=root, teacher=weights / "teacher", stores=("logprob", "topk"), top_k=16, slug="exact16"))
    result = run_score(ScoreJob(cache=root, teacher=weights / "teacher", stores=("logprob", "topk"), top_k=16, slug="compact16",
                                topk_precision="float16", topk_mass=1e-3))
    return root, result


def test_a_compact_table_is_v3_records_its_distortion_and_validates(compact_cache):
    from opdcache.format.cache import Cache
    from opdcache.format.validate import validate

    root, result = compact_cache
    cache = Cache(root)
    entry = cache.table("teachers/compact16")
    assert cache.manifest["format_version"] == 3 and entry["params"]["topk_precision"] == "float16"
    assert "topk_precision" not in cache.table("teachers/exact16")["params"]  # a v1 table's params are written as v1 wrote them
    assert S.params_from_schema(shards.read_schema(cache.shard_paths("teachers/exact16")[0]))[2] == 1
    d = entry["topk"]["distortion"]
    assert result["topk"] == entry["topk"]
    assert d["positions"] == sum(s["tokens"] for s in entry["shards"])
    assert 0 < d["max_abs_logprob_error"] <= 16 * 2 ** -11 and d["max_moved_mass"] <= 1e-3
    assert [p for p in validate(root) if not p.warning] == []


def _card_code(root, heading: str) -> str:
    import re

    card = (root / "README.md").read_text()
    return re.search(re.escape(heading) + r".*?```python\n(.*?)```", card, re.S).group(1)


def test_compact_rows_read_back_in_datasets_and_duckdb_and_match_the_exact_table(compact_cache, tmp_path):
    import datasets
    import duckdb

    from opdcache.format.cache import Cache

    root, _ = compact_cache
    cache = Cache(root)
    cpath, epath = cache.shard_paths("teachers/compact16")[0], cache.shard_paths("teachers/exact16")[0]
    ds = datasets.load_dataset(str(root), "teacher-compact16", split="train", cache_dir=str(tmp_path / "hf"))
    exact = shards.read_table(epath)
    code = _card_code(root, "### Decoding the compact top-k in `teacher-compact16` (format v3: float16")
    offset = 0
    for r in range(shards.open_parquet(cpath).metadata.num_rows):  # the first shard's rows come first
        scope = {"row": ds[offset + r]}
        exec(code, scope)  # the card's own recipe, on a `datasets` row
        e_ids, e_lps = exact["topk_ids"][r].as_py(), exact["topk_logprobs"][r].as_py()
        for t, entries in enumerate(scope["entries"]):
            n = len(entries)
            assert list(entries) == e_ids[t][:n]  # the kept support is the exact top-k's prefix, in rank order
            assert np.allclose(list(entries.values()), e_lps[t][:n], rtol=2 ** -11, atol=2 ** -24)
            assert scope["tail"][t] == pytest.approx(max(0.0, 1 - np.exp(np.float64(e_lps[t][:n])).sum()), abs=1e-6)
    rows = duckdb.sql(f"select count(*) as n, sum(len(topk_tail)) as t from read_parquet('{cpath}')").fetchall()[0]
    shard = shards.read_table(cpath)
    assert rows == (shard.num_rows, sum(len(x) for x in shard["topk_tail"].to_pylist()))
    import polars as pl

    for path in (cpath, cache.shard_paths("teachers/teacher")[0]):  # compact top-k; sampled store + bfloat16 svd
        frame = pl.read_parquet(path)
        arrow = shards.read_table(path)
        assert frame.columns == arrow.column_names
        for name in arrow.column_names:
            assert frame[name].to_list() == arrow[name].to_pylist(), name


def test_the_cards_sampled_recipe_and_the_exports_give_plain_values(compact_cache, tmp_path):
    import datasets

    from opdcache.format.export import export

    root, _ = compact_cache
    row = datasets.load_dataset(str(root), "teacher-teacher", split="train", cache_dir=str(tmp_path / "hf"))[0]
    scope = {"row": row}
    exec(_card_code(root, "### Reading the sampled store in `teacher-teacher`"), scope)
    assert all(sum(d.values()) == 4 for d in scope["draws"]) and len(scope["draws"]) == len(row["logprobs"])
    export(root, "jsonl", tmp_path / "j", teacher="compact16")
    export(root, "parquet-flat", tmp_path / "p", teacher="teacher")
    first = json.loads((tmp_path / "j" / "rollouts.jsonl").read_text().splitlines()[0])
    assert all(-1 not in pos for pos in first["teacher_topk_ids"])
    assert [len(a) for a in first["teacher_topk_ids"]] == [len(a) for a in first["teacher_topk_logprobs"]]
    assert all(isinstance(v, float) and v <= 0 for pos in first["teacher_topk_logprobs"] for v in pos)
    assert len(first["teacher_topk_tail"]) == len(first["response_ids"])
    flat = datasets.Dataset.from_parquet(str(sorted((tmp_path / "p").glob("*.parquet"))[0]))[0]
    assert [sum(c) for c in flat["teacher_sampled_counts"]] == [4] * len(flat["response_ids"])
    assert all(-1 not in pos and len(pos) == len(c) for pos, c in zip(flat["teacher_sampled_ids"], flat["teacher_sampled_counts"]))


def test_validate_finds_damaged_compact_and_sampled_rows(compact_cache, hf_cache, tmp_path):
    from opdcache.format.cache import Cache
    from opdcache.format.validate import _Collector, _check_store_rules, _check_topk

    ids = np.array([[5, 7, -1, -1], [5, -1, 7, -1], [3, 4, 6, -1]])
    lps = np.array([[-0.1, -2.5, -np.inf, -np.inf], [-0.1, -np.inf, -2.5, -np.inf], [-0.1, -3.0, -4.0, -np.inf]], np.float32)
    kept = np.exp(lps.astype(np.float64)).sum(1)
    tail = (1 - kept).astype(np.float32)
    tail[2] = 1.5
    out = _Collector()
    _check_topk("f", "topk", ids, lps, np.arange(4), 100, out, tail)
    messages = {(p.row, p.message.split(" (")[0].split(",")[0]) for p in out.problems if "sorted" not in p.message}
    assert (1, "padding") in messages and (2, "tail outside [0") in messages and not any(r == 0 for r, _ in messages)
    table = shards.read_table(Cache(hf_cache).shard_paths("teachers/teacher")[0])
    counts = shards.token_values(table["sampled_counts"]).copy()
    offsets = shards.list_offsets(table["logprobs"])
    counts[3, 0] += 1  # one position's counts now sum to m + 1
    damaged = table.set_column(table.schema.get_field_index("sampled_counts"), "sampled_counts",
                               pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.FixedSizeListArray.from_arrays(pa.array(counts.ravel()), counts.shape[1])))
    out = _Collector()
    _check_store_rules("f", damaged, Cache(hf_cache).params("teachers/teacher"), offsets, 1000, out)
    assert [(p.row, p.column) for p in out.problems] == [(0, "sampled_counts")] and "sum to 4" in out.problems[0].message
    out = _Collector()
    _check_store_rules("f", table, Cache(hf_cache).params("teachers/teacher"), offsets, 1000, out)
    assert out.problems == []


def test_padding_slots_hold_no_mass_in_the_top_k_estimators():
    """A compact row's padded slots change nothing: the estimator equals the one on the kept entries alone, with the
    same gradient, in both directions and with the stored tail."""
    g = torch.Generator().manual_seed(0)
    s = torch.log_softmax(torch.randn(2, 3, 50, generator=g), -1)[..., :6].clone().requires_grad_(True)
    t = torch.log_softmax(torch.randn(2, 3, 50, generator=g), -1)[..., :6]
    valid = torch.ones(2, 3, 6, dtype=torch.bool)
    valid[..., 4:] = False
    tail = 1 - t[..., :4].exp().sum(-1)
    for direction in ("fkl", "rkl"):
        for use_tail in (False, True):
            got, _ = L.topk_terms(s, t.masked_fill(~valid, float("-inf")), direction, use_tail, valid, tail if use_tail else None)
            (gs,) = torch.autograd.grad(got.sum(), s)
            s4 = s[..., :4]
            want, _ = L.topk_terms(s4, t[..., :4], direction, use_tail)
            (ws,) = torch.autograd.grad(want.sum(), s)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
            torch.testing.assert_close(gs, ws, rtol=0, atol=1e-6)
            assert torch.isfinite(gs).all() and (gs[..., 4:] == 0).all()


def test_sampled_fkl_is_the_forward_kl_in_expectation():
    """Exact: counts at their expectation m * p over the whole vocabulary give KL(p || q) and its gradient. Empirical:
    the mean over independent draws approaches it."""
    g = torch.Generator().manual_seed(0)
    V, m = 7, 12
    p = torch.log_softmax(torch.randn(V, generator=g, dtype=torch.float64), -1)
    q = torch.log_softmax(torch.randn(V, generator=g, dtype=torch.float64), -1).requires_grad_(True)
    expected_counts = (m * p.exp())[None, None]
    kl, _ = L.sampled_fkl_terms(q[None, None], p[None, None], expected_counts)
    (grad,) = torch.autograd.grad(kl.sum(), q)
    ref = (p.exp() * (p - q)).sum()
    (ref_grad,) = torch.autograd.grad(ref, q)
    torch.testing.assert_close(kl[0, 0], ref.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=1e-12)
    from opdcache.stores.sampled import collapse

    draws = torch.multinomial(p.exp(), 4000 * m, replacement=True, generator=g).view(4000, m).numpy()
    uid, counts, lps = collapse(draws, p.numpy()[draws].astype(np.float32))
    qv = q.detach().numpy()[np.maximum(uid, 0)]
    est, st = L.sampled_fkl_terms(torch.tensor(qv)[None], torch.tensor(lps.astype(np.float64))[None], torch.tensor(counts)[None])
    assert abs(float(est.mean()) - float(ref.detach())) < 4 * float(est.std()) / np.sqrt(4000)
    # the recorded standard error is the draws' own: std(log p - log q over the m draws, ddof 1) / sqrt(m)
    d = p.numpy()[draws] - q.detach().numpy()[draws]
    np.testing.assert_allclose(st["stderr"][0].numpy(), d.std(1, ddof=1) / np.sqrt(m), rtol=1e-5)  # teacher lps float32
    # and it predicts the spread of the estimates between positions (the same p and q everywhere)
    assert float(st["stderr"].mean()) == pytest.approx(float(est.std()), rel=0.1)


def test_upgrade_writes_the_same_compact_table_as_scoring_and_leaves_the_source(compact_cache, tmp_path):
    """`opdcache upgrade` re-encodes the exact top-16 table beside it: its compact columns equal those score-teacher
    wrote with the same settings, its recorded distortion too, and the source table is unchanged."""
    from opdcache.format.cache import Cache
    from opdcache.errors import ConfigError
    from opdcache.stores import REGISTRY
    from opdcache.teacher.upgrade import run_upgrade

    root, _ = compact_cache
    before = Cache(root).table("teachers/exact16")
    res = run_upgrade(root, "exact16", "float16", 1e-3, name="exact16-up")
    cache = Cache(root)
    assert cache.table("teachers/exact16") == before
    assert res["records"]["topk"] == cache.table("teachers/compact16")["topk"]
    assert res["describe"] == REGISTRY["topk"].describe(res["records"]["topk"])
    assert res["describe"][0].startswith("compact top-k: float16 log-probs, residual mass 0.001")
    for a, b in zip(cache.shard_paths("teachers/exact16-up"), cache.shard_paths("teachers/compact16")):
        ta, tb = shards.read_table(a), shards.read_table(b)
        for col in ("id", "logprobs", "topk_ids", "topk_logprobs", "topk_tail"):
            assert ta[col].equals(tb[col]), col
    with pytest.raises(ConfigError, match="already a compact top-k"):
        run_upgrade(root, "compact16", "float16", 1e-4)
    with pytest.raises(ConfigError, match="has no topk store"):
        run_upgrade(_without_topk(root, tmp_path / "c"), None, "float16", 1e-4)


def _without_topk(root, out):
    """A copy of the cache at ``out`` holding only a logprob-store teacher table."""
    from opdcache.teacher.scoring import ScoreJob, run_score

    shutil.copytree(root, out, ignore=shutil.ignore_patterns("teachers"))
    manifest = json.loads((out / "opdcache.json").read_text())
    manifest["tables"] = {k: v for k, v in manifest["tables"].items() if not k.startswith("teachers/")}
    (out / "opdcache.json").write_text(json.dumps(manifest))
    run_score(ScoreJob(cache=out, teacher=Path(__file__).parent.parent / "opdcache" / "demo" / "weights" / "teacher"))
    return out


def test_info_shows_the_compact_store_and_its_distortion(compact_cache, capsys):
    from opdcache.cli.main import main

    root, _ = compact_cache
    with pytest.raises(SystemExit) as exit_:
        main(["info", str(root)])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "compact top-k: float16 log-probs, residual mass 0.001" in out and "KL(exact || compact) max" in out
    assert "sampled store: 4 teacher draws a position" in out
    assert max(len(line) for line in out.splitlines()) <= 80


@pytest.mark.parametrize("args, message", [
    (["--store", "logprob,topk", "--top-k", "8", "--topk-precision", "q8"], "--topk-precision must be one of float32, float16, prob14, got 'q8'"),
    (["--store", "logprob,topk", "--top-k", "8", "--topk-mass", "1.5"], r"--topk-mass must be in \[0, 1\), got 1.5"),
    (["--store", "logprob", "--topk-mass", "1e-3"], "--topk-precision and --topk-mass shape the topk store: add --store topk"),
    (["--store", "logprob,sampled"], "--samples-per-position must be between 1 and 255 with --store sampled, got None"),
    (["--store", "logprob", "--samples-per-position", "8"], "--samples-per-position sets the sampled store: add --store sampled"),
    (["--store", "logprob", "--svd-dtype", "float8"], "--svd-dtype must be bfloat16 or float32, got 'float8'"),
])
def test_bad_v3_settings_are_one_line_before_any_model_loads(tmp_path, capsys, args, message):
    import re

    from opdcache.cli.main import main

    with pytest.raises(SystemExit) as exit_:
        main(["score-teacher", str(tmp_path / "nowhere"), "--teacher", str(tmp_path / "no-model"), *args])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and re.search(message, err) and len(err.strip().splitlines()) == 1, err


# ------------------------------------------------------------------------------------------------ prob14 (format v4)

def test_prob14_equals_a_plain_reference():
    """Per position: the residual-mass prefix in rank order, minus entries whose code round(p x 2^14) is 0 (the most
    likely always stays), in ascending id order, codes as uint16; tail = 1 - the kept entries' exact mass."""
    ids, lps = adversarial_rows(8)
    rng = np.random.default_rng(1)  # and a wide row in no id order, with codes near 0 and 0.5
    logits = rng.normal(size=(3, 400)) * 3
    lp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    top = np.argsort(-lp, 1)[:, :8]
    ids = np.concatenate([ids, rng.permutation(400)[top].astype(np.int32)])
    lps = np.concatenate([lps, np.take_along_axis(lp, top, 1).astype(np.float32)])
    enc = compact.compact_topk(ids, lps, "prob14", 1e-3)
    for t in range(len(ids)):
        order = sorted(range(ids.shape[1]), key=lambda j: -float(lps[t, j]))  # stable, like the store's argsort
        kept, left = [], 1.0
        for j in order:
            if left <= 1e-3 and kept:
                break
            kept.append(j)
            left -= float(np.exp(np.float64(lps[t, j])))
        codes = {int(ids[t, j]): int(np.rint(np.exp(np.float64(lps[t, j])) * 2 ** 14)) for j in kept}
        codes[int(ids[t, order[0]])] = max(codes[int(ids[t, order[0]])], 1)
        want = sorted((i, c) for i, c in codes.items() if c > 0)
        n = len(want)
        assert enc["ids"][t, :n].tolist() == [i for i, _ in want] and (enc["ids"][t, n:] == -1).all()
        assert enc["stored"][t, :n].tolist() == [c for _, c in want] and (enc["stored"][t, n:] == 0).all()
        kept_mass = sum(float(np.exp(np.float64(lps[t, j]))) for j in kept if codes.get(int(ids[t, j]), 0) > 0)
        assert enc["tail"][t] == pytest.approx(max(0.0, 1 - kept_mass), abs=1e-6)
        np.testing.assert_allclose(np.exp(enc["logprobs"][t, :n].astype(np.float64)), np.array([c for _, c in want]) * 2.0 ** -14, rtol=1e-6)


@pytest.fixture(scope="module")
def prob14_cache(compact_cache, weights):
    from opdcache.teacher.scoring import ScoreJob, run_score

    root, _ = compact_cache
    result = run_score(ScoreJob(cache=root, teacher=weights / "teacher", stores=("logprob", "topk"), top_k=16, slug="prob16",
                                topk_precision="prob14", topk_mass=1e-3))
    return root, result


def test_a_prob14_table_is_v4_validates_and_reads_back_everywhere_as_the_same_numbers(prob14_cache, tmp_path):
    import datasets

    from opdcache.format.cache import Cache
    from opdcache.training.decoded import DecodedShard
    from opdcache.format.export import export
    from opdcache.format.validate import validate

    root, result = prob14_cache
    cache = Cache(root)
    assert cache.manifest["format_version"] == 4 and S.params_from_schema(shards.read_schema(cache.shard_paths("teachers/prob16")[0]))[2] == 4
    assert not [p for p in validate(root) if not p.warning]
    exact = shards.read_table(cache.shard_paths("teachers/exact16")[0])
    ds = datasets.load_dataset(str(root), "teacher-prob16", split="train", cache_dir=str(tmp_path / "hf"))
    code = _card_code(root, "### Decoding the compact top-k in `teacher-prob16` (format v4: prob14")
    scope = {"row": ds[0]}
    exec(code, scope)
    e_ids, e_lps = exact["topk_ids"][0].as_py(), exact["topk_logprobs"][0].as_py()
    for t, entries in enumerate(scope["entries"]):
        assert list(entries) == sorted(entries)  # ascending ids
        truth = dict(zip(e_ids[t], e_lps[t]))
        for i, lp in entries.items():  # each probability to within 2^-15 of the exact top-k's
            assert abs(np.exp(lp) - np.exp(truth[i])) <= 2 ** -15 + 1e-7
    rpath, tpath = cache.shard_paths("rollouts")[0], cache.shard_paths("teachers/prob16")[0]
    decoded = DecodedShard(rpath, tpath, ["prompt_ids", "response_ids"], ["topk_ids", "topk_logprobs", "topk_tail"], vocab=64)
    T = len(scope["entries"])
    ids_k, lps_k = decoded.cols["teacher_topk_ids"][:T], decoded.cols["teacher_topk_logprobs"][:T]
    _same_entries([dict(zip(i[i != -1].tolist(), lp[i != -1].tolist())) for i, lp in zip(ids_k, lps_k)], scope["entries"])
    export(root, "jsonl", tmp_path / "j", teacher="prob16")
    row = json.loads((tmp_path / "j" / "rollouts.jsonl").read_text().splitlines()[0])
    _same_entries([dict(zip(i, lp)) for i, lp in zip(row["teacher_topk_ids"], row["teacher_topk_logprobs"])], scope["entries"])


def _same_entries(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want) and [list(g) for g in got] == [list(w) for w in want]
    for g, w in zip(got, want):
        np.testing.assert_allclose(list(g.values()), list(w.values()), rtol=1e-6)


def test_prob14_is_smaller_and_trains(prob14_cache, weights, tmp_path, capsys):
    from opdcache.format.cache import Cache
    from opdcache.cli.main import main
    from opdcache.format.info import store_bytes

    root, _ = prob14_cache
    cache = Cache(root)
    assert store_bytes(cache, "teachers/prob16")["topk"] < store_bytes(cache, "teachers/compact16")["topk"]
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--model", str(weights / "student"), "--cache", str(root), "--teacher", "prob16", "--loss", "topk-fkl",
              "--topk-tail", "--steps", "1", "--batch-size", "4", "--out", str(tmp_path / "run")])
    assert exit_.value.code == 0, capsys.readouterr().err


def test_a_prob14_table_is_written_in_pages_that_span_its_column_chunks(tmp_path):
    """zstd compresses each Parquet page on its own; the ascending id lists of a prob14 store repeat across positions, so
    its tables are written with 8 MiB pages (shards.PROB14_PAGE_BYTES) and come out smaller than with pyarrow's 1 MiB:
    here 3 MiB of ids, each position's list one of 3,000 lists (1.5 MiB of them: a 1 MiB page holds a list's first use
    again and again, one page holds it once). Read back unchanged."""
    import pyarrow.parquet as pq

    from opdcache.format import schema as S
    from opdcache.format import shards

    rng = np.random.default_rng(0)
    lists = np.sort(np.stack([rng.choice(50_000, 128, replace=False) for _ in range(3000)]), 1).astype(np.int32)
    T = 1024
    recs = []
    for r in range(6):
        ids = lists[rng.integers(0, len(lists), T)]
        recs.append({"id": f"r{r}", "logprobs": np.zeros(T, np.float32), "logsumexp": np.zeros(T, np.float32), "topk_ids": ids,
                     "topk_logprobs": np.full((T, 128), 100, np.uint16), "topk_tail": np.full(T, 1 - 128 * 100 * 2.0 ** -14, np.float32)})
    params = S.StoreParams(stores=("logprob", "topk"), top_k=128, topk_precision="prob14", topk_mass=1e-4)
    table = shards.build_table("teacher", params, recs)
    shards.write_table_atomic(table, tmp_path / "big.parquet", tmp_path)
    pq.write_table(table, tmp_path / "small.parquet", compression="zstd", compression_level=9, use_dictionary=False,
                   column_encoding={"topk_ids.list.element.list.element": "PLAIN"}, write_statistics=False,
                   row_group_size=shards._row_group_rows(table))

    def ids_bytes(path):
        meta = pq.ParquetFile(path).metadata
        return sum(meta.row_group(g).column(c).total_compressed_size for g in range(meta.num_row_groups)
                   for c in range(meta.num_columns) if meta.row_group(g).column(c).path_in_schema.startswith("topk_ids"))

    assert ids_bytes(tmp_path / "big.parquet") < 0.8 * ids_bytes(tmp_path / "small.parquet")
    assert pq.read_table(tmp_path / "big.parquet").equals(table)


def test_validate_and_the_loader_refuse_a_prob14_row_out_of_id_order():
    from opdcache.stores import rowrules

    ids = np.array([[3, 9, 12, -1], [9, 3, 12, -1]])
    lps = np.log(np.array([[0.5, 0.3, 0.1, 0.0], [0.3, 0.5, 0.1, 0.0]]))
    tail = np.full(2, 0.1)
    out = rowrules.topk_rules("topk", ids, lps, 100, tail, tol=1e-3, order="ids")
    assert [(c, bad.tolist(), m) for c, bad, m in out] == [("topk_ids", [False, True], "top-k ids of a prob14 row not ascending")]
