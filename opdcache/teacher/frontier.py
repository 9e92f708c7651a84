"""The storage frontier of one teacher on one cache's own rollouts: for each store and setting, bytes per token as
opdcache's writer writes them, beside the stored signal's error against the teacher's **full vocabulary**.
``opdcache plan`` (opdcache/teacher/plan.py) prints it; benchmarks/bench_storage.py measures it on SmolLM2's own rollouts.

Per response position, with p the teacher's full distribution and q* the full distribution a store implies:

* top-k (exact or compact): q* = the stored entries renormalised with the tail bin, the tail spread evenly over the
  rest (the maximum-entropy completion, opdcache/format/fidelity.py);
* hidden (float32 / bfloat16): q* = softmax of the rounded states' logits; svd: of the rank-r reconstruction (fitted on
  the first half of the sample's positions, measured on the second);
* sampled (m draws): no q*: the estimate is unbiased, its spread is reported instead.

Columns: ``kl`` = KL(p || q*) (student-independent; for the sampled store the standard error of the forward-KL
estimate's teacher term, sqrt(Var_p[log p] / m)), max and mean over positions. With students (other models on the same
vocabulary), per student: the forward-KL estimate's error |FKL_store - KL(p || s)| and the error of its gradient on
the student's logits, || g_store - g_full ||_1 with g = s - target (target: q* on the support, the tail bin's mass
spread over the rest in proportion to s, as the tail-bin estimator does; c/m for the sampled store), max and mean.

The reference is exact (BENCHMARKING.md): logits as the model computes them, their log-softmax in float64, and every
error summed in float64; stored values are rounded to float32 as the scorer stores them.

Memory: the teacher (and students), one row's hidden states [T, H], one [BLOCK_POSITIONS, V] float64 block of
log-probs per model and a few more while a setting's errors are summed (about 1.5 GiB at V = 151,936); the stored
values of the sampled rows for each setting (rows x T x width). Never the sample's tokens x vocabulary.
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from opdcache.format import schema as S, shards
from opdcache.stores import svd as svd_store

BLOCK_POSITIONS = 128  # positions per full-vocabulary block (151,936 columns: 156 MiB of float64 log-probs)


@dataclass(frozen=True)
class Setting:
    """One store setting on the frontier."""

    store: str  # topk, sampled, hidden, svd
    k: int | None = None
    precision: str | None = None  # compact top-k: float32/float16/prob14 (None with mass None: the exact v1 store)
    mass: float | None = None
    m: int | None = None
    dtype: str | None = None  # hidden: float32/bfloat16; svd: bfloat16/float32
    rank: int | None = None

    @property
    def label(self) -> str:
        if self.store == "topk":
            if self.precision is None and self.mass is None:
                return f"top-{self.k} exact"
            return f"top-{self.k} {self.precision or 'float32'}" + (f" mass {self.mass:g}" if self.mass is not None else "")
        if self.store == "sampled":
            return f"sampled m={self.m}"
        if self.store == "hidden":
            return f"hidden {self.dtype}"
        return f"svd r={self.rank} {self.dtype}"

    @property
    def flags(self) -> str:
        """The score-teacher flags of this setting."""
        if self.store == "topk":
            out = f"--store topk --top-k {self.k}"
            if self.precision is not None or self.mass is not None:
                out += f" --topk-precision {self.precision or 'float32'}" + (f" --topk-mass {self.mass:g}" if self.mass is not None else "")
            return out
        if self.store == "sampled":
            return f"--store sampled --samples-per-position {self.m}"
        if self.store == "hidden":
            return f"--store hidden --hidden-dtype {self.dtype}"
        return f"--store svd --svd-rank {self.rank} --svd-dtype {self.dtype}"

    def params(self, hidden_size: int) -> S.StoreParams:
        if self.store == "topk":
            return S.StoreParams(stores=("logprob", "topk"), top_k=self.k, topk_precision=self.precision, topk_mass=self.mass)
        if self.store == "sampled":
            return S.StoreParams(stores=("logprob", "sampled"), samples_per_position=self.m)
        if self.store == "hidden":
            return S.StoreParams(stores=("logprob", "hidden"), hidden_size=hidden_size, hidden_dtype=self.dtype)
        return S.StoreParams(stores=("logprob", "svd"), svd_rank=self.rank, svd_dtype="bfloat16" if self.dtype == "bfloat16" else None)


def default_settings(hidden_size: int, vocab_size: int) -> list[Setting]:
    """What ``plan`` measures unless told otherwise: top-k widths, the compact top-128 in float16 at two masses and as
    prob14 (the smallest top-k store: BENCHMARKS.md), sampled m, hidden in two precisions, svd ranks below the hidden
    size."""
    compact_k = min(128, vocab_size - 1)
    out = [Setting("topk", k=k) for k in (20, 128, 512) if k < vocab_size]
    out += [Setting("topk", k=compact_k, precision="float16", mass=mass) for mass in (1e-4, 1e-3)]
    out.append(Setting("topk", k=compact_k, precision="prob14", mass=1e-4))
    out += [Setting("sampled", m=m) for m in (4, 12, 32)]
    out += [Setting("hidden", dtype=d) for d in ("float32", "bfloat16")]
    out += [Setting("svd", rank=r, dtype="bfloat16") for r in (64, 256, 512) if r < hidden_size]
    return out


@dataclass
class Model:
    """A model's full next-token distribution at the response positions of a row, block by block."""

    backend: object  # an engine that declares full_distribution (its model and final_hidden)
    name: str = "model"
    temperature: float = 1.0
    """A student at another temperature (softmax(logits / t)): benchmarks use it for a student further away."""

    def __post_init__(self) -> None:
        from opdcache.backends.streamed import head_transform

        head = self.backend.model.get_output_embeddings()
        self.W, self.b = head.weight.detach(), None if getattr(head, "bias", None) is None else head.bias.detach()
        self.transform = head_transform(self.backend.model)

    @property
    def hidden_size(self) -> int:
        return int(self.W.shape[1])

    def hidden(self, request) -> torch.Tensor:
        with torch.no_grad():
            return self.backend.final_hidden([request])[0]

    def log_probs(self, hidden_BH: torch.Tensor, W=None, b=None) -> torch.Tensor:
        """[B, V] float64 log-probs from hidden states (the model's own head, or ``W``/``b``: an svd decoder): the logits
        as the model computes them, their log-softmax in float64 (the exact reference)."""
        W = self.W if W is None else W
        with torch.no_grad():
            z = hidden_BH.to(W.dtype) @ W.T
            if (self.b if W is self.W else b) is not None:
                z = z + (self.b if W is self.W else b)
            z = self.transform(z.float()) if W is self.W else z.float()
            return torch.log_softmax((z / self.temperature if self.temperature != 1.0 else z).double(), -1)


@dataclass
class _Acc:
    """Per-position errors of one setting (and the stored rows, for the bytes)."""

    kl: list = field(default_factory=list)
    fkl_err: dict = field(default_factory=dict)  # student -> list
    grad_err: dict = field(default_factory=dict)
    est: dict = field(default_factory=dict)  # student -> list of the estimates themselves
    records: list = field(default_factory=list)


def _stat(values: list) -> dict:
    v = np.concatenate(values) if values else np.zeros(0)
    return {"max": float(v.max(initial=0.0)), "mean": float(v.mean()) if v.size else 0.0}


def _student_errors(p_lp: torch.Tensor, q_star_lp: torch.Tensor | None, s_lp: torch.Tensor, kept: torch.Tensor | None = None,
                    tail: torch.Tensor | None = None, counts: torch.Tensor | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """|FKL_store - FKL_full|, ||g_store - g_full||_1 and FKL_store itself per position ([B, V] blocks, float64 sums)."""
    p = p_lp.double().exp()
    s_lp64 = s_lp.double()
    full = (p * (p_lp.double() - s_lp64)).sum(-1)
    if counts is not None:  # sampled: counts [B, V] of m draws; estimate (1/m) sum c (log p - log s)
        m = counts.sum(-1, keepdim=True)
        est = (counts * torch.where(counts > 0, p_lp.double() - s_lp64, torch.zeros_like(s_lp64))).sum(-1) / m[:, 0]
        target = counts / m
    elif kept is None:  # a full reconstruction (hidden, svd)
        q = q_star_lp.double().exp()
        est = (q * (q_star_lp.double() - s_lp64)).sum(-1)
        target = q
    else:  # top-k with a tail bin: q* on the support, the tail's mass spread over the rest in proportion to s
        q = torch.where(kept, q_star_lp.double().exp(), torch.zeros_like(p))
        q_tail = tail.double()
        s = s_lp64.exp()
        s_tail = torch.where(kept, torch.zeros_like(s), s).sum(-1).clamp_min(1e-300)
        on = torch.where(kept & (q > 0), q * (q_star_lp.double() - s_lp64), torch.zeros_like(q)).sum(-1)
        est = on + torch.where(q_tail > 0, q_tail * (torch.log(q_tail.clamp_min(1e-300)) - torch.log(s_tail)), torch.zeros_like(q_tail))
        target = torch.where(kept, q, (q_tail / s_tail)[:, None] * s)
    return (est - full).abs().numpy(), (target - p).abs().sum(-1).numpy(), est.numpy()


def measure(teacher: Model, requests: list, row_ids: list[str], settings: list[Setting], students: dict[str, Model] | None = None,
            seed: int = 0, progress=None) -> dict:
    """The frontier on ``requests`` (ScoreRequests of the sample's rows): {label: {bytes_per_token, kl, students, ...}}
    plus the sample's size and the teacher's mean entropy. See the module docstring for what each number means."""
    from opdcache.stores import svdprojection as svd
    from opdcache.backends.base import Scores
    from opdcache.stores.sampled import uniforms
    from opdcache.teacher.scoring import teacher_records

    students = students or {}
    accs = {s: _Acc() for s in settings}
    H = teacher.hidden_size
    V = teacher.W.shape[0]
    projections = {}
    half = max(1, len(requests) // 2)
    svd_settings = [s for s in settings if s.store == "svd"]
    svd_positions = 0
    if svd_settings:  # fitted on the first half of the sample, measured on the second
        calib = torch.cat([teacher.hidden(r) for r in requests[:half]]).float()
        svd_positions = int(calib.shape[0])
        for s in svd_settings:
            projections[s] = svd.fit(teacher.W, teacher.b, calib, min(s.rank, H), "prob-weighted")
        del calib
    measured_rows = range(half, len(requests)) if svd_settings and len(requests) > 1 else range(len(requests))
    tokens, entropy = 0, []
    max_k = max([s.k for s in settings if s.store == "topk"] or [0])
    max_m = max([s.m for s in settings if s.store == "sampled"] or [0])
    for i in measured_rows:
        req, row_id = requests[i], row_ids[i]
        h = teacher.hidden(req)
        sh = {name: st.hidden(req) for name, st in students.items()}
        T = h.shape[0]
        tokens += T
        resp = torch.as_tensor(np.asarray(req.response_ids, np.int64))
        u = torch.as_tensor(uniforms(seed, row_id, T, max_m)) if max_m else None
        row = {"lp": [], "lse": [], "top_ids": [], "top_lp": [], "draw_ids": [], "draw_lp": []}
        per_block: dict[Setting, list] = {s: [] for s in settings}
        for a in range(0, T, BLOCK_POSITIONS):
            blk = slice(a, min(a + BLOCK_POSITIONS, T))
            p_lp = teacher.log_probs(h[blk])
            s_lps = {name: students[name].log_probs(x[blk]) for name, x in sh.items()}
            p64 = p_lp.double().exp()
            entropy.append((-(p64 * p_lp.double()).sum(-1)).numpy())
            row["lp"].append(p_lp.gather(1, resp[blk, None])[:, 0].float())
            if max_k:
                tv, ti = p_lp.topk(max_k, -1)
                row["top_ids"].append(ti)
                row["top_lp"].append(tv.float())
            if max_m:  # inverse CDF over the vocabulary order, as the scorer draws
                cdf = p64.cumsum(-1)
                ids = torch.searchsorted(cdf, (u[blk] * cdf[:, -1:]).contiguous(), right=True).clamp_(max=V - 1)
                row["draw_ids"].append(ids)
                row["draw_lp"].append(p_lp.gather(1, ids).float())
            for s in settings:
                per_block[s].append(_block_errors(s, teacher, p_lp, h[blk], s_lps, row, projections.get(s), u[blk] if u is not None else None))
        scores = Scores(logprobs=torch.cat(row["lp"]).numpy(), logsumexp=np.zeros(T, np.float32))
        for s in settings:
            acc = accs[s]
            for kl, st in per_block[s]:
                acc.kl.append(kl)
                for name, (f, g, e) in st.items():
                    acc.fkl_err.setdefault(name, []).append(f)
                    acc.grad_err.setdefault(name, []).append(g)
                    acc.est.setdefault(name, []).append(e)
            sc = Scores(logprobs=scores.logprobs, logsumexp=scores.logsumexp)
            if s.store == "topk":
                sc.topk_ids = torch.cat(row["top_ids"])[:, : s.k].numpy().astype(np.int32)
                sc.topk_logprobs = torch.cat(row["top_lp"])[:, : s.k].numpy()
            elif s.store == "sampled":
                sc.sampled_ids = torch.cat(row["draw_ids"])[:, : s.m].numpy()
                sc.sampled_logprobs = torch.cat(row["draw_lp"])[:, : s.m].numpy()
            else:
                sc.hidden = h
            params = s.params(H)
            proj = projections.get(s)
            prepared = {} if proj is None else {"svd": svd_store.encoding_with(proj, params.svd_dtype == "bfloat16")}
            acc.records.append(teacher_records([row_id], [sc], params, prepared)[0])
        if progress:
            progress(1)
    out = {"tokens": tokens, "rows": len(measured_rows), "teacher_entropy": float(np.concatenate(entropy).mean()) if entropy else 0.0,
           "vocab_size": V, "hidden_size": H, "svd_calibration_positions": svd_positions, "settings": {}}
    with tempfile.TemporaryDirectory(prefix="opdcache-plan-") as tmp:
        for s in settings:
            acc = accs[s]
            nbytes = store_bytes(s.params(H), acc.records, s.store, Path(tmp))
            out["settings"][s.label] = {
                "store": s.store, "flags": s.flags, "bytes_per_token": nbytes / max(tokens, 1), "kl": _stat(acc.kl),
                "students": {name: {"fkl_error": _stat(acc.fkl_err[name]), "grad_l1_error": _stat(acc.grad_err[name])} for name in acc.fkl_err},
            }
            if s.store == "topk" and (s.precision or s.mass is not None):
                out["settings"][s.label]["mean_entries"] = float(np.mean([(r["topk_ids"] != -1).sum(1).mean() for r in acc.records]))
                exact = accs.get(Setting("topk", k=s.k))
                for name in acc.est if exact is not None else ():  # the compact store against the exact top-k it encodes
                    diff = [np.abs(a - b) for a, b in zip(acc.est[name], exact.est[name])]
                    out["settings"][s.label]["students"][name]["vs_exact_topk"] = _stat(diff)
    return out


def _block_errors(s: Setting, teacher: Model, p_lp: torch.Tensor, h_BH: torch.Tensor, s_lps: dict, row: dict, proj, u_BD):
    """(kl [B], {student: (fkl_err [B], grad_err [B])}) of one setting on one block."""
    from opdcache.stores import compact

    p_lp64 = p_lp.double()
    if s.store == "sampled":
        var = (p_lp64.exp() * p_lp64 * p_lp64).sum(-1) - ((p_lp64.exp() * p_lp64).sum(-1)) ** 2
        kl = torch.sqrt(var.clamp_min(0) / s.m).numpy()
        ids = row["draw_ids"][-1][:, : s.m]
        counts = torch.zeros_like(p_lp64).scatter_add_(1, ids, torch.ones(ids.shape, dtype=torch.float64))
        return kl, {n: _student_errors(p_lp, None, q, counts=counts) for n, q in s_lps.items()}
    if s.store in ("hidden", "svd"):
        if s.store == "hidden":
            q_lp = teacher.log_probs(h_BH.to(getattr(torch, s.dtype)).to(h_BH.dtype))
        else:
            z = proj.encode(h_BH)
            if s.dtype == "bfloat16":
                z = z.to(torch.bfloat16).float()
            q_lp = teacher.log_probs(z, proj.decoder, proj.bias)
        kl = (p_lp64.exp() * (p_lp64 - q_lp.double())).sum(-1).clamp_min(0).numpy()
        return kl, {n: _student_errors(p_lp, q_lp, q) for n, q in s_lps.items()}
    ids = row["top_ids"][-1][:, : s.k]
    lps = row["top_lp"][-1][:, : s.k]
    if s.precision is None and s.mass is None:  # the exact store: its tail bin is the mass outside, summed directly
        kept_k, stored = torch.ones(ids.shape, dtype=torch.bool), lps
        outside = torch.ones(p_lp.shape, dtype=torch.bool).scatter_(1, ids.long(), False)
        tail = (p_lp64.exp() * outside).sum(-1)
    else:
        enc = compact.compact_topk(ids.numpy(), lps.numpy(), s.precision or "float32", s.mass)
        kept_k = torch.as_tensor(enc["ids"] != -1)
        ids = torch.as_tensor(enc["ids"]).long().clamp_min(0)
        stored = torch.as_tensor(enc["logprobs"])
        tail = torch.as_tensor(enc["tail"]).double()
    tail = tail.clamp_min(1e-30)  # a tail rounded to 0 while the teacher still has mass there: a finite, large KL
    # q* over the vocabulary: the stored entries renormalised with the tail, the tail spread evenly over the rest
    B, V = p_lp.shape
    stored64 = torch.where(kept_k, stored.double(), torch.full_like(stored.double(), -math.inf))
    z = stored64.exp().sum(-1) + tail
    r, c = kept_k.nonzero(as_tuple=True)  # only kept slots: a padding slot's id (clamped to 0) must not touch token 0
    kept = torch.zeros((B, V), dtype=torch.bool)
    kept[r, ids[r, c]] = True
    q_star = torch.log((tail / z) / (V - kept_k.sum(-1)).clamp_min(1).double())[:, None].expand(B, V).clone()
    q_star[r, ids[r, c]] = (stored64 - torch.log(z)[:, None])[r, c]
    p = p_lp64.exp()
    kl = (p * (p_lp64 - q_star)).sum(-1).clamp_min(0).numpy()
    return kl, {n: _student_errors(p_lp, q_star, q, kept=kept, tail=tail / z) for n, q in s_lps.items()}


def store_bytes(params: S.StoreParams, records: list, store: str, tmp: Path) -> int:
    """Bytes of one store's columns (its own, not the logprob store's) when opdcache's writer writes ``records``."""
    import pyarrow.parquet as pq

    path = tmp / f"{store}.parquet"
    shards.write_table_atomic(shards.build_table("teacher", params, records), path, tmp)
    meta = pq.ParquetFile(path).metadata
    own = {c.name for c in S.columns("teacher", params) if c.store == store}
    total = 0
    for rg in range(meta.num_row_groups):
        for c in range(meta.num_columns):
            col = meta.row_group(rg).column(c)
            if col.path_in_schema.split(".")[0] in own:
                total += col.total_compressed_size
    return total


def choose(frontier: dict, max_error: float | None = None, max_bytes: float | None = None, student: str | None = None) -> dict | None:
    """The cheapest setting whose max error (``kl``, or the student's forward-KL error) is at most ``max_error``, or
    the most accurate within ``max_bytes`` B/token. None if nothing qualifies."""
    rows = []
    for label, r in frontier["settings"].items():
        if r["store"] == "sampled" and student is None:
            continue  # its kl column is a spread, not a bias: chosen only against a student's measured error
        err = r["students"][student]["fkl_error"]["max"] if student else r["kl"]["max"]
        rows.append((label, r["bytes_per_token"], err))
    if max_error is not None:
        ok = [x for x in rows if x[2] <= max_error]
        pick = min(ok, key=lambda x: x[1]) if ok else None
    else:
        ok = [x for x in rows if x[1] <= max_bytes]
        pick = min(ok, key=lambda x: x[2]) if ok else None
    return None if pick is None else {"label": pick[0], "bytes_per_token": pick[1], "max_error": pick[2],
                                      "flags": frontier["settings"][pick[0]]["flags"]}
