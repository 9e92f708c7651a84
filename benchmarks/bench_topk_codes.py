"""The compact top-128's value codes and layout on a real teacher: bytes against the error they add to the exact
top-128, for the levers of a smaller top-k store. Goal there: <= 200 B/token at a compact-vs-exact error <= 5e-4.

Data: the storage frontier's (benchmarks/realdata.py, bench_storage.py): SmolLM2-135M-Instruct as teacher on its own
temperature-1 responses to 64 chat-template math prompts; the second half of the rows (32 sequences, 4,011 positions).
Students: the same model with w8a8 (0.031 nats a position from the teacher) and w4a16:g64 (0.43 nats), emulated by
``--quantize`` as the frontier does. Every setting starts from the exact top-128 (float64 from the teacher's float32
logits) and the residual-mass support at 1e-4 (as score-teacher's ``--topk-mass 1e-4``). The settings: prob14's
two errors apart, zstd levels and page sizes, other roundings, finer and hybrid grids, and a grid sized per position by
an error budget (:func:`budget_grid`). Last, prob14's ids column alone under other id codings (:func:`id_levers`).

Error: |FKL_setting - FKL_exact top-128| a position, max and mean over the positions, each with the tail-bin estimator
train's ``topk-fkl --topk-tail`` uses (the kept probabilities renormalised with the stored tail; the student's tail is
its exact mass outside the kept ids). Bytes: the store's three columns as opdcache's writer lays them out (fixed width
128, padding id -1 / code 0, ids ascending in PLAIN int32, codes uint16 BYTE_STREAM_SPLIT, tail float32
BYTE_STREAM_SPLIT, zstd at the level shown, one row per sequence, one row group), per token; the first row writes
the v4 store with opdcache's own writer to check the layout. Compression speed: the two columns' raw pages through
zstd alone, tokens per CPU-second (what the setting costs a scorer). A measurement of error and bytes; only the zstd
speed is timed, on one core.

    python benchmarks/bench_topk_codes.py [--out benchmarks/results/topk_codes.json]
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_storage import column_bytes  # noqa: E402  (Parquet bytes per column: one reading for both benchmarks)

MASS = 1e-4
K = 128


@dataclass
class Data:
    ids: np.ndarray  # [T, 128] int32, rank order
    p: np.ndarray  # [T, 128] float64, normalised together with pout
    pout: np.ndarray  # [T] mass outside the top-128
    rows: list  # sequence lengths, in order
    students: dict  # name -> (s [T, 128] student probabilities at the ids, sout [T] student mass outside)


def collect() -> Data:
    """The teacher's top-128 and both students at those ids, per position of the frontier's measured rows."""
    import torch
    from realdata import real_rollouts

    from opdcache.backends.hf import TransformersBackend
    from opdcache.format.cache import Cache
    from opdcache.teacher.frontier import Model
    from opdcache.teacher.scoring import score_requests

    cache_dir, model = real_rollouts()
    cache = Cache(cache_dir)
    reqs = []
    for i in range(len(cache.shard_paths("rollouts"))):
        reqs += score_requests(cache.read_shard("rollouts", i, ["id", "prompt_ids", "response_ids"]))
    reqs = reqs[len(reqs) // 2:]  # the rows the frontier measures on
    teacher = Model(TransformersBackend(model, dtype="float32"), "teacher")
    students = {"w8a8": Model(TransformersBackend(model, dtype="float32", quantize="w8a8")),
                "w4a16": Model(TransformersBackend(model, dtype="float32", quantize="w4a16:g64"))}
    ids, plp, rows, s_at, s_out = [], [], [], {n: [] for n in students}, {n: [] for n in students}
    for req in reqs:
        p = teacher.log_probs(teacher.hidden(req))
        top = torch.topk(p, K, dim=-1)
        ids.append(top.indices.numpy().astype(np.int32))
        plp.append(top.values.numpy())
        rows.append(p.shape[0])
        for name, m in students.items():
            q = m.log_probs(m.hidden(req)).gather(1, top.indices).exp()
            s_at[name].append(q.numpy())
            s_out[name].append(np.clip(1 - q.sum(-1).numpy(), 1e-300, 1))
    P = np.exp(np.concatenate(plp))
    pout = np.clip(1 - P.sum(1), 0, 1)
    total = P.sum(1) + pout
    return Data(np.concatenate(ids), P / total[:, None], pout / total, rows,
                {n: (np.concatenate(s_at[n]), np.concatenate(s_out[n])) for n in students})


def estimate(q: np.ndarray, kept: np.ndarray, tail: np.ndarray, s: np.ndarray, sout: np.ndarray) -> np.ndarray:
    """The tail-bin forward-KL estimate per position from decoded probabilities ``q`` (0 off the kept support)."""
    z = q.sum(1) + tail
    qn, tn = q / z[:, None], tail / z
    s_tail = sout + np.where(kept, 0.0, s).sum(1)
    with np.errstate(divide="ignore", invalid="ignore"):
        on = np.where(kept & (qn > 0), qn * (np.log(qn) - np.log(s)), 0.0).sum(1)
        return on + np.where(tn > 0, tn * (np.log(np.maximum(tn, 1e-300)) - np.log(s_tail)), 0.0)


def support(d: Data, mass: float = MASS) -> np.ndarray:
    """The residual-mass prefix in rank order (opdcache.stores.compact.support): the shortest whose rest is <= ``mass``."""
    rest = d.pout[:, None] + np.cumsum(d.p[:, ::-1], 1)[:, ::-1]  # rest[:, j]: the mass from entry j on, outside included
    rest = np.concatenate([rest, d.pout[:, None]], 1)
    ok = rest <= mass
    return np.arange(K)[None] < np.maximum(np.where(ok.any(1), ok.argmax(1), K), 1)[:, None]


# ---------------------------------------------------------------- the codes: (kept [T, K], decoded q [T, K], codes [T, K])

def linear(d: Data, step: float, drop: float = 0.5, rounding: str = "nearest"):
    """Probability codes c on a grid of ``step`` (prob14: 2^-14); an entry below ``drop`` x step leaves the support
    (its mass joins the tail), the most likely one always stays. ``rounding``: nearest; "largest-remainder" (each
    position's codes sum to round(kept mass / step)); "diffused" (each rounding error carried to the next entry)."""
    base = support(d)
    x = np.where(base, d.p / step, 0.0)
    if rounding == "nearest":
        code = np.rint(x)
    elif rounding == "largest-remainder":
        floor = np.floor(x)
        need = (np.rint(x.sum(1)) - floor.sum(1)).astype(int)
        rank = np.argsort(np.argsort(-np.where(base, x - floor, -1), 1), 1)
        code = floor + (rank < need[:, None])
    else:
        code, carry = np.zeros_like(x), np.zeros(len(x))
        for j in range(K):
            v = x[:, j] + carry
            code[:, j] = np.where(base[:, j], np.rint(v), 0)
            carry = np.where(base[:, j], v - code[:, j], carry)
    kept = base & ((d.p >= drop * step) if rounding == "nearest" else (code > 0))
    kept[:, 0] = True
    code = np.maximum(code, 1)
    return kept, np.where(kept, code * step, 0.0), code


def hybrid(d: Data, step: float, ratio: float, floor: float = 1e-6):
    """A grid of ``step`` above step / ratio and geometric (relative spacing ``ratio``) below, down to ``floor``: small
    entries keep their relative precision instead of rounding to 0 or one step."""
    t0 = step / ratio
    geo = floor * (1 + ratio) ** np.arange(int(np.ceil(np.log(t0 / floor) / np.log1p(ratio))) + 1)
    grid = np.concatenate([geo[geo < t0], t0 + step * np.arange(int(np.ceil((1 - t0) / step)) + 1)])
    j = np.clip(np.searchsorted(grid, d.p), 1, len(grid) - 1)
    idx = np.where(d.p - grid[j - 1] < grid[j] - d.p, j - 1, j)
    kept = support(d) & (d.p >= grid[0] / np.sqrt(1 + ratio))
    kept[:, 0] = True
    return kept, np.where(kept, grid[idx], 0.0), idx + 1


def budget_grid(d: Data, budget: float, lo: int = 12, hi: int = 16):
    """A grid sized per position by an error budget (value codes on a grid sized by the error budget):
    position t's step is 2^-e_t with e_t the smallest exponent in [lo, hi] for which sqrt(n_t) x 2^-e_t <= ``budget``,
    n_t its kept entries (the rounding error of a sum of n_t independent roundings grows as sqrt(n_t) x step). The
    exponent is stored per position (one uint8 column); the codes are prob14's with that step. Returns prob14's
    (kept, q, codes) and the exponents."""
    base = support(d)
    e = np.clip(np.ceil(np.log2(np.sqrt(base.sum(1)) / budget)), lo, hi)
    step = 2.0 ** -e[:, None]
    x = np.where(base, d.p / step, 0.0)
    kept = base & (x >= 0.5)
    kept[:, 0] = True
    code = np.clip(np.rint(x), 1, 65535)
    return kept, np.where(kept, code * step, 0.0), code, e.astype(np.uint8)


def exact_values(d: Data):
    kept = support(d)
    return kept, np.where(kept, d.p, 0.0), None


def prob14_parts(d: Data, part: str):
    """prob14's two errors apart: "drop" (its support, exact values) or "round" (its codes, nothing dropped: an entry
    whose code is 0 keeps its exact value)."""
    kept, q, _ = linear(d, 2.0 ** -14)
    if part == "drop":
        return kept, np.where(kept, d.p, 0.0), None
    base = support(d)
    return base, np.where(kept, q, np.where(base, d.p, 0.0)), None


# ---------------------------------------------------------------- bytes

def columns(d: Data, kept: np.ndarray, codes: np.ndarray, tail: np.ndarray, exps: np.ndarray | None = None):
    """The store's three columns in the v4 layout: ids ascending with id -1 / code 0 padding, one row per sequence;
    with ``exps``, a fourth: each position's grid exponent (uint8, :func:`budget_grid`)."""
    import pyarrow as pa

    order = np.argsort(np.where(kept, d.ids, np.iinfo(np.int32).max), 1, kind="stable")
    k = np.take_along_axis(kept, order, 1)
    ids = np.where(k, np.take_along_axis(d.ids, order, 1), -1).astype(np.int32)
    vals = np.where(k, np.take_along_axis(codes, order, 1), 0).astype(np.uint16)
    bounds = np.concatenate([[0], np.cumsum(d.rows)])

    def nested(a, typ):
        flat = pa.array(a.reshape(-1), type=typ)
        inner = pa.FixedSizeListArray.from_arrays(flat, K)
        return pa.ListArray.from_arrays(pa.array(bounds, pa.int32()), inner)

    out = {"topk_ids": nested(ids, pa.int32()), "topk_logprobs": nested(vals, pa.uint16()),
           "topk_tail": pa.ListArray.from_arrays(pa.array(bounds, pa.int32()), pa.array(tail.astype(np.float32)))}
    if exps is not None:
        out["topk_exponent"] = pa.ListArray.from_arrays(pa.array(bounds, pa.int32()), pa.array(exps))
    return out, ids, vals


def store_bytes(cols: dict, level: int, page: int | None) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.table(cols), buf, compression="zstd", compression_level=level, use_dictionary=False, write_statistics=False,
                   column_encoding={"topk_ids.list.element.list.element": "PLAIN", "topk_logprobs.list.element.list.element": "BYTE_STREAM_SPLIT",
                                    "topk_tail.list.element": "BYTE_STREAM_SPLIT"}, data_page_size=page)
    return column_bytes(buf.getvalue())  # an exponent column, where there is one, is PLAIN uint8


def writer_bytes(d: Data) -> float:
    """The v4 prob14 store as opdcache's own writer writes it (compact_topk, build_table, write_table_atomic)."""
    from opdcache.format import shards
    from opdcache.stores import compact
    from opdcache.format import schema as S

    params = S.StoreParams(stores=("logprob", "topk"), top_k=K, topk_precision="prob14", topk_mass=MASS)
    bounds = np.concatenate([[0], np.cumsum(d.rows)])
    recs = []
    for r, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        enc = compact.compact_topk(d.ids[a:b], np.log(np.maximum(d.p[a:b], 1e-300)).astype(np.float32), "prob14", MASS)
        recs.append({"id": f"r{r}", "logprobs": np.zeros(b - a, np.float32), "logsumexp": np.zeros(b - a, np.float32),
                     "topk_ids": enc["ids"], "topk_logprobs": enc["stored"], "topk_tail": enc["tail"]})
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "t.parquet"
        shards.write_table_atomic(shards.build_table("teacher", params, recs), path, Path(tmp))
        return sum(size for name, size in column_bytes(path.read_bytes()).items() if name.startswith("topk_"))


def id_levers(d: Data) -> dict:
    """B/token of prob14's kept ids (the ids column alone, zstd 9, 8 MiB pages) under several id codings,
    beside the layout opdcache writes (ascending, PLAIN int32): Parquet's other encodings of that column; a dictionary
    per column chunk (a per-shard id table); each position's gaps between its ascending ids (uint16, split by byte);
    and ids coded against the previous position's set (a 128-bit mask over the previous kept ids, then only the ids
    that are new; two columns, each written as its own file, so this one carries a second footer, ~0.1 B/token).
    Also the share of a position's kept ids that the position before it in the same sequence kept too, averaged over
    every position but each sequence's first."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    kept, _, codes = linear(d, 2.0 ** -14)
    T, bounds = len(d.ids), np.concatenate([[0], np.cumsum(d.rows)])
    cols, ids, _ = columns(d, kept, codes, np.zeros(T))
    first = np.zeros(T, bool)
    first[bounds[:-1]] = True

    def nested(a: np.ndarray, typ, width: int = K):
        inner = pa.FixedSizeListArray.from_arrays(pa.array(a.reshape(-1), type=typ), width)
        return pa.ListArray.from_arrays(pa.array(bounds, pa.int32()), inner)

    def size(column, encoding: str | None = None, dictionary: bool = False) -> float:
        buf = io.BytesIO()
        pq.write_table(pa.table({"c": column}), buf, compression="zstd", compression_level=9, use_dictionary=dictionary,
                       write_statistics=False, data_page_size=8 << 20, dictionary_pagesize_limit=1 << 30,
                       column_encoding=None if dictionary else {"c.list.element.list.element": encoding or "PLAIN"})
        return len(buf.getvalue()) / T

    valid = ids >= 0
    gaps = np.where(valid, np.diff(np.concatenate([np.zeros((T, 1), np.int64), np.where(valid, ids, 0)], 1), axis=1), 0)
    fresh, masks, overlap = np.full_like(ids, -1), np.zeros((T, K // 8), np.uint8), []
    for t in range(T):
        cur = ids[t][valid[t]]
        if not first[t]:
            prev = ids[t - 1][valid[t - 1]]
            bits = np.zeros(K, bool)
            bits[: len(prev)] = np.isin(prev, cur)
            masks[t] = np.packbits(bits)
            overlap.append(bits.sum() / len(cur))
            cur = cur[~np.isin(cur, prev)]
        fresh[t, : len(cur)] = cur
    return {"as written (ascending, PLAIN)": size(cols["topk_ids"]),
            "DELTA_BINARY_PACKED": size(cols["topk_ids"], "DELTA_BINARY_PACKED"),
            "BYTE_STREAM_SPLIT": size(cols["topk_ids"], "BYTE_STREAM_SPLIT"),
            "dictionary (a per-shard id table)": size(cols["topk_ids"], dictionary=True),
            "gaps, uint16 split by byte": size(nested(gaps.astype(np.uint16), pa.uint16()), "BYTE_STREAM_SPLIT"),
            "against the previous position's set": size(nested(masks, pa.uint8(), K // 8)) + size(nested(fresh, pa.int32())),
            "share kept by the previous position (mean)": float(np.mean(overlap))}


def zstd_rate(ids: np.ndarray, vals: np.ndarray, level: int) -> float:
    """Tokens per CPU-second through zstd at ``level`` for the two columns' raw bytes (ids PLAIN, codes split by byte)."""
    import pyarrow as pa

    codec = pa.Codec("zstd", compression_level=level)
    split = np.concatenate([vals.view(np.uint8).reshape(-1, 2)[:, 0], vals.view(np.uint8).reshape(-1, 2)[:, 1]])
    start = time.process_time()
    for data in (ids.tobytes(), split.tobytes()):
        codec.compress(data)
    return len(ids) / (time.process_time() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "topk_codes.json")
    args = parser.parse_args()
    d = collect()
    T = len(d.p)
    exact = {n: estimate(d.p, np.ones_like(d.p, bool), d.pout, s, so) for n, (s, so) in d.students.items()}
    MiB = 1 << 20
    settings = [  # (label, code, zstd level, page bytes)
        ("float32 values (the support's own error)", lambda: exact_values(d), None, None),
        ("prob14's drop alone (exact values)", lambda: prob14_parts(d, "drop"), None, None),
        ("prob14's rounding alone (nothing dropped)", lambda: prob14_parts(d, "round"), None, None),
        ("prob14, 1 MiB pages (v4 before)", lambda: linear(d, 2.0 ** -14), 9, MiB),
        ("prob14, 8 MiB pages (v4 now)", lambda: linear(d, 2.0 ** -14), 9, 8 * MiB),
        ("prob14 largest-remainder", lambda: linear(d, 2.0 ** -14, rounding="largest-remainder"), 9, 8 * MiB),
        ("prob14 error-diffused", lambda: linear(d, 2.0 ** -14, rounding="diffused"), 9, 8 * MiB),
        ("prob14, zstd 15", lambda: linear(d, 2.0 ** -14), 15, 8 * MiB),
        ("prob14, zstd 19", lambda: linear(d, 2.0 ** -14), 19, 8 * MiB),
        ("step 2^-14.5", lambda: linear(d, 1 / 23170), 9, 8 * MiB),
        ("step 2^-15", lambda: linear(d, 2.0 ** -15), 9, 8 * MiB),
        ("step 2^-15, drop < 0.75 step", lambda: linear(d, 2.0 ** -15, drop=0.75), 9, 8 * MiB),
        ("step 2^-15, drop < 1 step", lambda: linear(d, 2.0 ** -15, drop=1.0), 9, 8 * MiB),
        ("step 2^-15, zstd 15", lambda: linear(d, 2.0 ** -15), 15, 8 * MiB),
        ("step 2^-15, zstd 19", lambda: linear(d, 2.0 ** -15), 19, 8 * MiB),
        ("step 2^-16", lambda: linear(d, 2.0 ** -16), 9, 8 * MiB),
        ("hybrid 2^-14 / relative 1/4", lambda: hybrid(d, 2.0 ** -14, 0.25), 9, 8 * MiB),
        ("hybrid 2^-14 / relative 1/8", lambda: hybrid(d, 2.0 ** -14, 0.125), 9, 8 * MiB),
        ("hybrid 2^-14 / relative 1/16", lambda: hybrid(d, 2.0 ** -14, 0.0625), 9, 8 * MiB),
        ("grid per position, budget 1e-3", lambda: budget_grid(d, 1e-3), 9, 8 * MiB),
        ("grid per position, budget 5e-4", lambda: budget_grid(d, 5e-4), 9, 8 * MiB),
        ("grid per position, budget 3e-4", lambda: budget_grid(d, 3e-4), 9, 8 * MiB),
    ]
    report = {"command": "python benchmarks/bench_topk_codes.py", "positions": T, "mass": MASS, "settings": {},
              "opdcache_writer_prob14_bytes_per_token": writer_bytes(d) / T}
    print(f"{T:,} positions; the v4 prob14 store as opdcache's writer writes it: {report['opdcache_writer_prob14_bytes_per_token']:.1f} B/token\n")
    head = f"{'setting':<44} {'B/token':>8} {'ids/codes/tail(/exp)':>21} {'entries':>8} {'zstd tok/CPU-s':>15}  " + "  ".join(
        f"{n + ' max':>10} {'mean':>8}" for n in d.students)
    print(head)
    print("-" * len(head))
    for label, code, level, page in settings:
        kept, q, codes, *exps = code()
        tail = np.clip(d.pout + np.where(kept, 0.0, d.p).sum(1), 0, 1)  # the exact mass outside the kept entries
        row = {"entries": float(kept.sum(1).mean()), "students": {}}
        for n, (s, so) in d.students.items():
            err = np.abs(estimate(q, kept, tail, s, so) - exact[n])
            row["students"][n] = {"max": float(err.max()), "mean": float(err.mean())}
        if codes is not None:
            cols, ids, vals = columns(d, kept, codes, tail, *exps)
            sizes = store_bytes(cols, level, page)
            row |= {"bytes_per_token": sum(sizes.values()) / T, "columns": {k: v / T for k, v in sizes.items()},
                    "zstd_level": level, "page_bytes": page, "zstd_tokens_per_cpu_s": zstd_rate(ids, vals, level)}
        report["settings"][label] = row
        b = f"{row['bytes_per_token']:8.1f} {'/'.join(f'{v:.0f}' for v in row['columns'].values()):>21}" if codes is not None else f"{'':>8} {'':>21}"
        rate = f"{row['zstd_tokens_per_cpu_s']:>15,.0f}" if codes is not None else f"{'':>15}"
        print(f"{label:<44} {b} {row['entries']:8.1f} {rate}  " + "  ".join(
            f"{st['max']:>10.2e} {st['mean']:>8.2e}" for st in row["students"].values()), flush=True)
    report["id_levers_bytes_per_token"] = levers = id_levers(d)
    print("\nprob14's ids column alone (zstd 9), B/token:")
    for label, value in levers.items():
        print(f"  {label:<44} {value:8.3f}" if label.startswith("share") else f"  {label:<44} {value:8.1f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
