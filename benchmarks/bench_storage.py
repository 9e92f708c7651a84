"""Bytes per token of each teacher store beside its error against the teacher's full vocabulary.

Headline (the default): a real teacher on its own rollouts. SmolLM2-135M-Instruct (the ``real`` group's model,
vocabulary 49,152, hidden 576) scores its own chat-template math rollouts at temperature 1 (benchmarks/realdata.py:
64 prompts, up to 128 tokens); the svd settings fit on the first 32 rows and every setting is measured on the other 32.
Two real students on the same vocabulary: the same model with int8 weights and activations (w8a8, near) and with int4
weight groups of 64 (w4a16:g64, far), emulated by opdcache's --quantize. The numbers come from opdcache/teacher/frontier.py (what
``opdcache plan`` prints); results/storage_real.json keeps them. Run:

    python benchmarks/bench_storage.py                 # real (about 3 minutes on 2 cores)
    python benchmarks/bench_storage.py --synthetic     # the synthetic stress case below

Stress case (``--synthetic``): shape vocabulary 151,936 (Qwen3), hidden 4,096 (bf16), top-k 20 and 128, SVD rank 512.
Data is synthetic but shaped like a real LM's: logits = Zipf prior over the vocabulary (BPE vocabularies
are roughly frequency-ordered) + a low-rank context term, scaled to a typical mean entropy; hidden states
are bf16 with per-dimension log-normal scales (a few outlier dimensions, as post-norm states have).

For each store it prints the raw size (fixed-width values, no compression), and the size written by
opdcache's writer (BYTE_STREAM_SPLIT for floats + zstd), next to two alternatives measured the same way:
PLAIN + zstd (Parquet's plain default) and PLAIN + snappy. Run:

    python benchmarks/bench_storage.py [--tokens 4096]
"""

from __future__ import annotations

import argparse
import io
import tempfile
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

from opdcache.format import schema as S, shards

V, H = 151_936, 4096


def synthetic_teacher(tokens: int, seq_len: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    prior = -1.2 * torch.log(torch.arange(V, dtype=torch.float32) + 20.0)
    basis = torch.randn(64, V, generator=g) * 0.9
    rows = []
    entropies = []
    for start in range(0, tokens, seq_len):
        T = min(seq_len, tokens - start)
        ctx = torch.randn(T, 64, generator=g)
        logits = prior + ctx @ basis  # [T, V]
        logits *= 1.6
        lse = torch.logsumexp(logits, -1)
        logp = logits - lse[:, None]
        entropies.append(float(-(logp.exp() * logp).sum(-1).mean()))
        sampled = torch.multinomial(logp.exp(), 1, generator=g).squeeze(1)
        top128_lp, top128_ids = logp.topk(128, -1)
        # a student near the teacher (the situation OPD trains in): teacher logits plus noise, and the exact
        # full-vocabulary forward KL(teacher || student) per position, for the top-k frontier's fidelity
        q = torch.log_softmax(logits + torch.randn(T, V, generator=g) * 0.5, -1)
        fkl_full = (logp.exp() * (logp - q)).sum(-1)
        student_top = q.gather(1, top128_ids)
        # the mass outside the top-128 on each side, summed in float64 (1 - sum(top) in float32 cancels to <= 0)
        outside = torch.ones_like(logp, dtype=torch.bool).scatter_(1, top128_ids, False)
        teacher_tail = (logp.double().exp() * outside).sum(-1)
        student_tail = (q.double().exp() * outside).sum(-1)
        # RS-KD draws: 32 i.i.d. tokens per position from the teacher (the first m of them are m i.i.d. draws)
        draws = torch.multinomial(logp.exp(), 32, replacement=True, generator=g)
        draw_teacher, draw_student = logp.gather(1, draws), q.gather(1, draws)
        scale = torch.exp(torch.randn(H, generator=g) * 0.7)
        hidden = (torch.randn(T, H, generator=g) * scale).to(torch.bfloat16)
        rows.append(dict(
            id=f"row-{start}", logprobs=logp.gather(1, sampled[:, None]).squeeze(1).numpy(), logsumexp=lse.numpy(),
            top128_ids=top128_ids.numpy().astype(np.int32), top128_lp=top128_lp.numpy(),
            hidden=shards.hidden_to_numpy(hidden), svd=(torch.randn(T, 512, generator=g) * 3).numpy(),
            student_top128=student_top.numpy(), fkl_full=fkl_full.double().numpy(),
            teacher_tail128=teacher_tail.numpy(), student_tail128=student_tail.numpy(),
            draws=draws.numpy(), draw_teacher=draw_teacher.numpy(), draw_student=draw_student.numpy(),
        ))
        del logits, logp, q
    return rows, float(np.mean(entropies))


def teacher_records(rows, k: int | None, with_hidden: bool, with_svd: bool):
    out = []
    for r in rows:
        rec = {"id": r["id"], "logprobs": r["logprobs"], "logsumexp": r["logsumexp"]}
        if k:
            rec["topk_ids"], rec["topk_logprobs"] = r["top128_ids"][:, :k], r["top128_lp"][:, :k]
        if with_hidden:
            rec["hidden"] = r["hidden"]
        if with_svd:
            rec["svd"] = r["svd"]
        out.append(rec)
    return out


def column_bytes(data: bytes) -> dict[str, int]:
    meta = pq.ParquetFile(io.BytesIO(data)).metadata
    sizes: dict[str, int] = {}
    for rg in range(meta.num_row_groups):
        for c in range(meta.num_columns):
            col = meta.row_group(rg).column(c)
            name = col.path_in_schema.split(".")[0]
            sizes[name] = sizes.get(name, 0) + col.total_compressed_size
    return sizes


def write_variant(table, variant: str) -> bytes:
    buf = io.BytesIO()
    if variant == "plain+zstd":
        pq.write_table(table, buf, compression="zstd", compression_level=shards.COMPRESSION_LEVEL, use_dictionary=False, write_statistics=False)
    elif variant == "plain+snappy":
        pq.write_table(table, buf, compression="snappy", use_dictionary=False, write_statistics=False)
    else:
        raise ValueError(variant)
    return buf.getvalue()


FRONTIER = [  # (label, codec or None for today's store, ascending ids)
    ("exact top-128 (today's store)", None, False),
    ("rank order, float32 (codec)", ("float32", None), False),
    ("ascending ids, float32", ("float32", None), True),
    ("ascending ids, float16", ("float16", None), True),
    ("ascending ids, q8 (1/16 nat)", ("q8", None), True),
    ("float16, mass 1e-6", ("float16", 1e-6), True),
    ("float16, mass 1e-4", ("float16", 1e-4), True),
    ("q8, mass 1e-6", ("q8", 1e-6), True),
    ("q8, mass 1e-4", ("q8", 1e-4), True),
    ("q8, mass 1e-3", ("q8", 1e-3), True),
    ("float16, mass 1e-3", ("float16", 1e-3), True),
    ("rank order, float16, mass 1e-4", ("float16", 1e-4), False),
]


def _fkl_topk(p_lp: list[np.ndarray], q_lp: list[np.ndarray], p_tail: np.ndarray, q_tail: np.ndarray) -> np.ndarray:
    """The top-k forward KL with one tail bin, per position: sum_kept p log(p / q) + p_tail log(p_tail / q_tail), the kept
    p renormalised together with the stored tail (the estimator topk-fkl --tail uses); q_tail is the student's exact
    mass outside the kept ids."""
    out = np.empty(len(p_lp))
    for t, (lp, lq, pt, qt) in enumerate(zip(p_lp, q_lp, p_tail, q_tail)):
        p, q = np.exp(lp.astype(np.float64)), np.exp(lq.astype(np.float64))
        total = p.sum() + pt
        p, pt = p / total, pt / total
        with np.errstate(divide="ignore", invalid="ignore"):
            kept = np.where(p > 0, p * (np.log(p) - np.log(q)), 0.0).sum()
        out[t] = kept + (pt * (np.log(pt) - np.log(qt)) if pt > 0 else 0.0)
    return out


def rank_ordered(codec, enc: dict) -> dict:
    """An encoding's positions re-sorted by descending log-prob (the exact store's order) instead of ascending id."""
    ids, vals = [], []
    for (pid, plp), (a, b) in zip(codec.decode(enc), zip(np.r_[0, np.cumsum(enc["counts"])][:-1], np.cumsum(enc["counts"]))):
        order = np.argsort(-plp, kind="stable")
        ids.append(pid[order])
        vals.append(enc["values"][a:b][order])
    return {**enc, "ids": np.concatenate(ids), "values": np.concatenate(vals)}


def topk_frontier(rows, n_tokens: int) -> None:
    """Bytes/token beside measured error for every top-k setting at k=128: the frontier."""
    import pyarrow as pa

    from opdcache.stores.compact import TopkCodec, distortion

    print(f"\ntop-k k=128 frontier: bytes/token (Parquet, zstd {shards.COMPRESSION_LEVEL}) and error against the exact top-128 "
          "and against the full vocabulary")
    header = (f"{'setting':<32} {'B/token':>8} {'ids/vals':>9} {'entries':>8} {'max|dlp|':>9} {'mean|dlp|':>10} {'|FKL-FKL_full| max':>19} "
              f"{'mean':>9} {'vs exact top-128 max':>21}")
    print(header)
    print("-" * len(header))
    fkl_full = np.concatenate([r["fkl_full"] for r in rows])
    base = None
    for label, setting, ascending in FRONTIER:
        ids_col, val_col, tail_col, p_lp, q_lp, tails, q_tails, dist = [], [], [], [], [], [], [], []
        for r in rows:
            ids, lps, qs = r["top128_ids"], r["top128_lp"], r["student_top128"]
            if setting is None:
                ids_col.append(ids)
                val_col.append(lps)
                p_lp += list(lps)
                q_lp += list(qs)
                tails.append(r["teacher_tail128"])
                q_tails.append(r["student_tail128"])
                continue
            codec = TopkCodec(*setting)
            enc = codec.encode(ids, lps)
            if not ascending:  # the same support and values, back in rank order (descending log-prob)
                enc = rank_ordered(codec, enc)
            dist.append(distortion(codec, ids, lps))
            bounds = np.concatenate([[0], np.cumsum(enc["counts"])])
            ids_col.append([enc["ids"][a:b] for a, b in zip(bounds[:-1], bounds[1:])])
            val_col.append([enc["values"][a:b] for a, b in zip(bounds[:-1], bounds[1:])])
            tail_col.append(enc["tail"])
            q_exp = np.exp(qs.astype(np.float64))
            for t, (did, dlp) in enumerate(codec.decode(enc)):
                where = {i: j for j, i in enumerate(ids[t].tolist())}
                kept = [where[i] for i in did.tolist()]
                p_lp.append(dlp)
                q_lp.append(qs[t, kept])
                q_tails.append([r["student_tail128"][t] + q_exp[t].sum() - q_exp[t, kept].sum()])
            tails.append(enc["tail"].astype(np.float64))
        value_type = {None: pa.float32(), "float32": pa.float32(), "float16": pa.uint16(), "q8": pa.uint8()}[setting and setting[0]]
        to_arrow = (lambda v: v.view(np.uint16)) if value_type == pa.uint16() else (lambda v: v)  # float16 as its bit pattern

        def nested(col, typ, conv=lambda v: v):
            return pa.array([[conv(np.asarray(x)) for x in row] for row in col], type=pa.list_(pa.list_(typ)))

        cols = {"topk_ids": nested(ids_col, pa.int32()), "topk_values": nested(val_col, value_type, to_arrow)}
        enc_map = {"topk_ids.list.element.list.element": "DELTA_BINARY_PACKED" if ascending else "BYTE_STREAM_SPLIT"}
        if value_type != pa.uint8():
            enc_map["topk_values.list.element.list.element"] = "BYTE_STREAM_SPLIT"
        if tail_col:
            cols["topk_tail"] = pa.array([np.asarray(t, np.float32) for t in tail_col], type=pa.list_(pa.float32()))
            enc_map["topk_tail.list.element"] = "BYTE_STREAM_SPLIT"
        buf = io.BytesIO()
        pq.write_table(pa.table(cols), buf, compression=shards.COMPRESSION, compression_level=shards.COMPRESSION_LEVEL,
                       use_dictionary=False, column_encoding=enc_map, write_statistics=False)
        sizes = column_bytes(buf.getvalue())
        per_token = sum(sizes.values()) / n_tokens
        split = f"{sizes['topk_ids'] / n_tokens:.0f}/{sizes['topk_values'] / n_tokens:.0f}"
        err = np.abs(_fkl_topk(p_lp, q_lp, np.concatenate(tails), np.concatenate([np.ravel(x) for x in q_tails])) - fkl_full)
        if base is None:
            base = err
        entries = np.mean([d["mean_entries"] for d in dist]) if dist else 128.0
        mx = max((d["max_abs_logprob_error"] for d in dist), default=0.0)
        mean = float(np.mean([d["mean_abs_logprob_error"] for d in dist])) if dist else 0.0
        print(f"{label:<32} {per_token:>8.1f} {split:>9} {entries:>8.1f} {mx:>9.2e} {mean:>10.2e} {err.max():>19.2e} {err.mean():>9.2e} "
              f"{np.abs(err - base).max():>21.2e}")


def v3_stores(rows, n_tokens: int) -> None:
    """The v3 stores as opdcache's writer writes them (schema, padding, encodings): compact top-128 at the documented
    settings, and the sampled store at m = 4-32, each with its measured forward-KL fidelity against the full vocabulary.
    For the sampled store the estimator is unbiased; its per-position error is sampling noise, so the table gives the
    bias over all positions (mean of estimate - exact) beside the per-position spread."""
    from opdcache.stores import compact
    from opdcache.stores.sampled import store_columns

    print("\nv3 stores written by opdcache's writer (k=128 source), bytes/token of the store's columns and forward-KL fidelity")
    header = f"{'store':<38} {'B/token':>8} {'entries':>8} {'max|FKL-FKL_full|':>18} {'mean':>9} {'bias':>10}"
    print(header)
    print("-" * len(header))
    fkl_full = np.concatenate([r["fkl_full"] for r in rows])
    settings = [("exact top-128 (v1)", None, None), ("compact top-128 float16, mass 1e-4", "float16", 1e-4),
                ("compact top-128 float16, mass 1e-3", "float16", 1e-3), ("compact top-128 float32, mass 1e-4", "float32", 1e-4)]
    with tempfile.TemporaryDirectory() as tmp:
        for label, precision, mass in settings:
            params = S.StoreParams(stores=("logprob", "topk"), top_k=128, topk_precision=precision, topk_mass=mass)
            records, est, entries = [], [], []
            for r in rows:
                rec = {"id": r["id"], "logprobs": r["logprobs"], "logsumexp": r["logsumexp"], "topk_ids": r["top128_ids"], "topk_logprobs": r["top128_lp"]}
                kept = np.ones(r["top128_ids"].shape, bool)
                lp_dec, tail = r["top128_lp"], r["teacher_tail128"]
                if params.topk_compact:
                    enc = compact.compact_topk(r["top128_ids"], r["top128_lp"], precision, mass)
                    order = np.argsort(-r["top128_lp"], axis=1, kind="stable")  # enc is in rank order, the source too
                    assert np.array_equal(np.take_along_axis(r["top128_ids"], order, 1)[enc["ids"] != -1], enc["ids"][enc["ids"] != -1])
                    rec.update(topk_ids=enc["ids"], topk_logprobs=enc["stored"], topk_tail=enc["tail"])
                    kept, lp_dec, tail = enc["ids"] != -1, enc["logprobs"], enc["tail"].astype(np.float64)
                entries.append(kept.sum(1))
                qs = r["student_top128"]  # rank order too (top-k of the teacher)
                q_exp = np.exp(qs.astype(np.float64))
                q_tail = r["student_tail128"] + np.where(kept, 0.0, q_exp).sum(1)
                est.append(_fkl_topk([lp[k] for lp, k in zip(lp_dec, kept)], [q[k] for q, k in zip(qs, kept)], tail, q_tail))
                records.append(rec)
            path = Path(tmp) / f"{label.replace(' ', '_')}.parquet"
            shards.write_table_atomic(shards.build_table("teacher", params, records), path, tmp)
            sizes = column_bytes(path.read_bytes())
            per = sum(v for k, v in sizes.items() if k.startswith("topk")) / n_tokens
            err = np.concatenate(est) - fkl_full
            print(f"{label:<38} {per:>8.1f} {np.concatenate(entries).mean():>8.1f} {np.abs(err).max():>18.2e} {np.abs(err).mean():>9.2e} {err.mean():>10.2e}")
        for m in (4, 8, 12, 32):
            params = S.StoreParams(stores=("logprob", "sampled"), samples_per_position=m)
            records, est = [], []
            for r in rows:
                cols = store_columns(r["draws"][:, :m], r["draw_teacher"][:, :m])
                records.append({"id": r["id"], "logprobs": r["logprobs"], "logsumexp": r["logsumexp"], **cols})
                # the estimate from what the store holds: (1/m) sum_v c_v (log p_v - log q_v), p decoded from float16
                kept = cols["sampled_counts"] > 0
                p_lp = cols["sampled_logprobs"].view(np.float16).astype(np.float64)
                q_at = {}
                for t_, (ids_row, q_row) in enumerate(zip(r["draws"][:, :m], r["draw_student"][:, :m])):
                    q_at.update({(t_, int(i)): float(q) for i, q in zip(ids_row, q_row)})
                q_lp = np.array([[q_at.get((t_, int(i)), 0.0) for i in row] for t_, row in enumerate(cols["sampled_ids"])])
                est.append((cols["sampled_counts"] * np.where(kept, p_lp - q_lp, 0.0)).sum(1) / m)
            path = Path(tmp) / f"sampled{m}.parquet"
            shards.write_table_atomic(shards.build_table("teacher", params, records), path, tmp)
            per = sum(v for k, v in column_bytes(path.read_bytes()).items() if k.startswith("sampled")) / n_tokens
            err = np.concatenate(est) - fkl_full
            entries = np.mean([(rec["sampled_ids"] != -1).sum(1).mean() for rec in records])
            print(f"{f'sampled (RS-KD), m={m}':<38} {per:>8.1f} {entries:>8.1f} {np.abs(err).max():>18.2e} {np.abs(err).mean():>9.2e} {err.mean():>10.2e}")


def real(out_path: Path) -> None:
    """The headline: the frontier on SmolLM2's own rollouts, with two real quantized students."""
    import json
    import sys
    import time

    sys.path.insert(0, str(Path(__file__).parent))
    from realdata import real_rollouts

    from opdcache.backends.hf import TransformersBackend
    from opdcache.format.cache import Cache
    from opdcache.teacher.frontier import Model, Setting, default_settings, measure
    from opdcache.teacher.plan import render
    from opdcache.teacher.scoring import score_requests

    cache_dir, model = real_rollouts()
    cache = Cache(cache_dir)
    reqs, ids = [], []
    for i in range(len(cache.shard_paths("rollouts"))):
        table = cache.read_shard("rollouts", i, ["id", "prompt_ids", "response_ids"])
        reqs += score_requests(table)
        ids += table["id"].to_pylist()
    teacher = Model(TransformersBackend(model, dtype="float32"), "teacher")
    students = {"w8a8": Model(TransformersBackend(model, dtype="float32", quantize="w8a8"), "w8a8"),
                "w4a16:g64": Model(TransformersBackend(model, dtype="float32", quantize="w4a16:g64"), "w4a16:g64")}
    settings = default_settings(teacher.hidden_size, int(teacher.W.shape[0]))
    settings[3:3] = [Setting.of("topk", top_k=128, topk_precision="float32", topk_mass=1e-4),
                     Setting.of("topk", top_k=128, topk_precision="float16")]
    settings[7:7] = [Setting.of("topk", top_k=128, topk_precision="prob14", topk_mass=1e-4),
                     Setting.of("topk", top_k=128, topk_precision="prob14", topk_mass=1e-3)]
    settings += [Setting.of("svd", svd_rank=512)]
    start = time.perf_counter()
    report = measure(teacher, reqs, ids, settings, students)
    report["seconds"] = time.perf_counter() - start
    report["student_distance"] = _student_distance(teacher, students, reqs[len(reqs) // 2:])
    print(render(report))
    print("\ncompact top-128 against the exact top-128, |FKL_compact - FKL_exact| a position (max, mean):")
    for label, r in report["settings"].items():
        if "mean_entries" in r:
            print(f"  {label:<28} {r['mean_entries']:6.1f} entries  " + "  ".join(
                f"{n} {st['vs_exact']['max']:.2e} {st['vs_exact']['mean']:.2e}" for n, st in r["students"].items() if "vs_exact" in st))
    print("\nmean KL(teacher || student) per position: " + ", ".join(f"{k} {v:.3f} nats" for k, v in report["student_distance"].items()))
    report["command"] = "python benchmarks/bench_storage.py"
    out_path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {out_path} ({report['seconds']:.0f} s)")


def _student_distance(teacher, students, reqs) -> dict:
    total, n = {k: 0.0 for k in students}, 0
    for req in reqs:
        p = teacher.log_probs(teacher.hidden(req)).double()
        n += p.shape[0]
        for name, st in students.items():
            q = st.log_probs(st.hidden(req)).double()
            total[name] += float((p.exp() * (p - q)).sum())
    return {k: v / max(n, 1) for k, v in total.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--synthetic", action="store_true", help="the synthetic stress case instead of the real teacher")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "storage_real.json")
    args = parser.parse_args()
    if not args.synthetic:
        real(args.out)
        return
    rows, entropy = synthetic_teacher(args.tokens, args.seq_len)
    n = args.tokens
    print(f"{n} tokens in rows of {args.seq_len}; vocabulary {V:,}, hidden {H}; mean teacher entropy {entropy:.2f} nats\n")
    stores = {  # store -> (params, columns belonging to it, raw bytes per token)
        "logprob": (S.StoreParams(stores=("logprob",)), ["logprobs", "logsumexp"], 8),
        "topk k=20": (S.StoreParams(stores=("logprob", "topk"), top_k=20), ["topk_ids", "topk_logprobs"], 20 * 8),
        "topk k=128": (S.StoreParams(stores=("logprob", "topk"), top_k=128), ["topk_ids", "topk_logprobs"], 128 * 8),
        "hidden bf16": (S.StoreParams(stores=("logprob", "hidden"), hidden_size=H, hidden_dtype="bfloat16"), ["hidden"], H * 2),
        "svd r=512": (S.StoreParams(stores=("logprob", "svd"), svd_rank=512), ["svd"], 512 * 4),
        "svd r=512 bf16": (S.StoreParams(stores=("logprob", "svd"), svd_rank=512, svd_dtype="bfloat16"), ["svd"], 512 * 2),
    }
    header = f"{'store':<14} {'raw B/tok':>10} {'opdcache B/tok':>15} {'ratio':>7} {'plain+zstd':>11} {'plain+snappy':>13}"
    print(header)
    print("-" * len(header))
    with tempfile.TemporaryDirectory() as tmp:
        for name, (params, cols, raw) in stores.items():
            k = params.top_k if "topk" in params.stores else None
            records = teacher_records(rows, k, "hidden" in params.stores, "svd" in params.stores)
            if params.svd_dtype:  # v3: z as bfloat16 bits, as score-teacher writes it
                records = [r | {"svd": shards.hidden_to_numpy(torch.from_numpy(r["svd"]).to(torch.bfloat16))} for r in records]
            table = shards.build_table("teacher", params, records)
            info = shards.write_table_atomic(table, Path(tmp) / f"{name.replace(' ', '_')}.parquet", tmp)
            ours = column_bytes((Path(tmp) / info.path).read_bytes())
            alt = {v: column_bytes(write_variant(table, v)) for v in ("plain+zstd", "plain+snappy")}
            per = lambda sizes: sum(sizes[c] for c in cols) / n  # noqa: E731
            print(f"{name:<14} {raw:>10,.0f} {per(ours):>15,.1f} {raw / per(ours):>6.2f}x {per(alt['plain+zstd']):>11,.1f} {per(alt['plain+snappy']):>13,.1f}")
    topk_frontier(rows, n)
    v3_stores(rows, n)
    print(f"\nfull logits for reference: {V * 2:,} B/token raw in bf16, {V * 4:,} in float32")
    print("DistillKit's published figure for top-k at k=128: ~300 B/token")


if __name__ == "__main__":
    main()
