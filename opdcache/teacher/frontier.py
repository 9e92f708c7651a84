"""The storage frontier of one teacher on one cache's own rollouts: for each store and setting, bytes per token as
opdcache's writer writes them, beside the stored signal's error against the teacher's **full vocabulary**.
``opdcache plan`` (opdcache/teacher/plan.py) prints it; benchmarks/bench_storage.py measures it on SmolLM2's own rollouts.

Per response position, with p the teacher's full distribution and q* the full distribution a store implies (each
store says what its values imply: its ``Frontier`` hook, ``opdcache.stores.base``): a reconstruction of the whole
distribution (the hidden states rounded, a rank-r projection fitted on the first half of the sample's positions and
measured on the second), a stored support with a tail bin spread evenly over the rest (the top-k, exact or compact), or
draws (no q*: the estimate is unbiased, its spread is reported instead).

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

import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from opdcache.backends.base import STATISTICS
from opdcache.format import schema as S, shards
from opdcache.stores import enabled, REGISTRY
from opdcache.stores.base import Frontier, FrontierBlock, Implied

BLOCK_POSITIONS = 128  # positions per full-vocabulary block (151,936 columns: 156 MiB of float64 log-probs)


@dataclass(frozen=True)
class Setting:
    """One store setting on the frontier: a store and its ``schema.StoreParams`` fields (``Setting.of(name, **fields)``)."""

    store: str
    values: tuple[tuple[str, Any], ...]

    @classmethod
    def of(cls, store: str, **values) -> "Setting":
        """The setting of ``store`` with these fields (None values dropped: a field left at its default)."""
        if store not in REGISTRY or REGISTRY[store].frontier is None:
            on = ", ".join(n for n, st in REGISTRY.items() if st.frontier is not None)
            raise ValueError(f"the {store} store is not measured on the frontier (those that are: {on})")
        return cls(store, tuple(sorted((k, v) for k, v in values.items() if v is not None)))

    @property
    def spec(self) -> Frontier:
        return REGISTRY[self.store].frontier

    @property
    def setting(self) -> dict:
        return dict(self.values)

    def get(self, name: str):
        return self.setting.get(name)

    @property
    def label(self) -> str:
        return self.spec.label(self.setting)

    @property
    def flags(self) -> str:
        """The score-teacher flags of this setting."""
        return self.spec.flags(self.setting)

    @property
    def fitted(self) -> bool:
        """Whether it is fitted on hidden states first (on the sample's first half, measured on the second)."""
        return self.spec.fit is not None

    def params(self, hidden_size: int) -> S.StoreParams:
        return S.StoreParams(stores=enabled((self.store,), False), **self.spec.params(self.setting, hidden_size))

    def fits(self, hidden_size: int, vocab_size: int) -> bool:
        return self.spec.fits(self.setting, hidden_size, vocab_size)


def default_settings(hidden_size: int, vocab_size: int) -> list[Setting]:
    """What ``plan`` measures unless told otherwise: each store's defaults (``Frontier.defaults``) that fit the shapes."""
    out = [Setting.of(name, **v) for name, st in REGISTRY.items() if st.frontier for v in st.frontier.defaults(hidden_size, vocab_size)]
    return [s for s in out if s.fits(hidden_size, vocab_size)]


def scored_settings_of(params) -> list[Setting]:
    """The frontier settings a teacher table's recorded store parameters correspond to."""
    return [Setting.of(name, **v) for name in params.stores if REGISTRY.get(name) and REGISTRY[name].frontier
            for v in REGISTRY[name].frontier.scored(params)]


def held_out(settings: list[Setting], rows: int) -> int:
    """How many of ``rows`` sampled rows are fitted on, not measured (the first half, when a setting is fitted)."""
    return rows // 2 if rows > 1 and any(s.fitted for s in settings) else 0


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
    spread: bool = False  # its kl is the spread of an unbiased estimate, not a divergence
    fkl_err: dict = field(default_factory=dict)  # student -> list
    grad_err: dict = field(default_factory=dict)
    est: dict = field(default_factory=dict)  # student -> list of the estimates themselves
    records: list = field(default_factory=list)


def _stat(values: list) -> dict:
    v = np.concatenate(values) if values else np.zeros(0)
    return {"max": float(v.max(initial=0.0)), "mean": float(v.mean()) if v.size else 0.0}


def _student_errors(p_lp: torch.Tensor, implied: Implied, s_lp: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """|FKL_store - FKL_full|, ||g_store - g_full||_1 and FKL_store itself per position ([B, V] blocks, float64 sums)."""
    p = p_lp.double().exp()
    s_lp64 = s_lp.double()
    full = (p * (p_lp.double() - s_lp64)).sum(-1)
    if implied.counts is not None:  # draws: counts [B, V] of m draws; estimate (1/m) sum c (log p - log s)
        counts = implied.counts
        m = counts.sum(-1, keepdim=True)
        est = (counts * torch.where(counts > 0, p_lp.double() - s_lp64, torch.zeros_like(s_lp64))).sum(-1) / m[:, 0]
        target = counts / m
    elif implied.kept is None:  # a reconstruction of the whole distribution
        q = implied.log_q.double().exp()
        est = (q * (implied.log_q.double() - s_lp64)).sum(-1)
        target = q
    else:  # a support with a tail bin: q* on the support, the tail's mass spread over the rest in proportion to s
        kept, q_lp = implied.kept, implied.log_q.double()
        q = torch.where(kept, q_lp.exp(), torch.zeros_like(p))
        q_tail = implied.tail.double()
        s = s_lp64.exp()
        s_tail = torch.where(kept, torch.zeros_like(s), s).sum(-1).clamp_min(1e-300)
        on = torch.where(kept & (q > 0), q * (q_lp - s_lp64), torch.zeros_like(q)).sum(-1)
        est = on + torch.where(q_tail > 0, q_tail * (torch.log(q_tail.clamp_min(1e-300)) - torch.log(s_tail)), torch.zeros_like(q_tail))
        target = torch.where(kept, q, (q_tail / s_tail)[:, None] * s)
    return (est - full).abs().numpy(), (target - p).abs().sum(-1).numpy(), est.numpy()


def _width(s: Setting) -> int | None:
    """A setting's width: the value it gives its store's vector columns' width field (k, m), None for none."""
    return next((s.get(c.width) for c in REGISTRY[s.store].columns if c.width and s.get(c.width)), None)


def _widths(settings: list[Setting]) -> dict[str, int]:
    """The largest width each per-position statistic is asked at ({"topk_ids": k, "sampled_ids": m})."""
    out: dict[str, int] = {}
    for s in settings:
        width = _width(s)
        for stat in REGISTRY[s.store].needs:
            if STATISTICS[stat].source != "hidden_states" and width:
                out[stat] = max(out.get(stat, 0), int(width))
    return out


def _block_statistics(p_lp: torch.Tensor, widths: dict, resp: torch.Tensor, u: torch.Tensor | None) -> dict:
    """The statistics the settings ask on one block, from its exact log-probs, as the scorer computes them: the top-k
    (most likely first) and the draws (inverse CDF over the vocabulary order, for the row's uniforms)."""
    out = {"logprobs": p_lp.gather(1, resp[:, None])[:, 0].float()}
    if widths.get("topk_ids"):
        tv, ti = p_lp.topk(widths["topk_ids"], -1)
        out["topk_ids"], out["topk_logprobs"] = ti, tv.float()
    if widths.get("sampled_ids"):
        cdf = p_lp.double().exp().cumsum(-1)
        ids = torch.searchsorted(cdf, (u * cdf[:, -1:]).contiguous(), right=True).clamp_(max=p_lp.shape[1] - 1)
        out["sampled_ids"], out["sampled_logprobs"] = ids, p_lp.gather(1, ids).float()
    return out


def measure(teacher: Model, requests: list, row_ids: list[str], settings: list[Setting], students: dict[str, Model] | None = None,
            seed: int = 0, progress=None) -> dict:
    """The frontier on ``requests`` (ScoreRequests of the sample's rows): {label: {bytes_per_token, kl, students, ...}}
    plus the sample's size and the teacher's mean entropy. See the module docstring for what each number means; beside
    them, per setting, ``kl_is`` ("divergence": KL(p || q*); "spread": the standard error of an unbiased estimate, for
    draws) and, for a setting that encodes another (the compact top-k of the exact one), per student ``vs_exact``:
    |its forward-KL estimate - the encoded setting's| per position (max, mean), and its store's ``report``."""
    from opdcache.backends.base import row_uniforms, Scores
    from opdcache.teacher.scoring import teacher_records

    students = students or {}
    accs = {s: _Acc() for s in settings}
    H = teacher.hidden_size
    V = teacher.W.shape[0]
    fitted, encoders = {}, {}
    half = held_out(settings, len(requests))
    calibration_positions = 0
    if half:  # fitted on the first half of the sample, measured on the second
        calib = torch.cat([teacher.hidden(r) for r in requests[:half]]).float()
        calibration_positions = int(calib.shape[0])
        for s in settings:
            if s.fitted:
                fitted[s], encoders[s] = s.spec.fit(s.setting, teacher, calib)
        del calib
    measured_rows = range(half, len(requests))
    widths = _widths(settings)
    tokens, entropy = 0, []
    for i in measured_rows:
        req, row_id = requests[i], row_ids[i]
        h = teacher.hidden(req)
        sh = {name: st.hidden(req) for name, st in students.items()}
        T = h.shape[0]
        tokens += T
        resp = torch.as_tensor(np.asarray(req.response_ids, np.int64))
        u = torch.as_tensor(row_uniforms(seed, row_id, T, widths["sampled_ids"])) if widths.get("sampled_ids") else None
        row: dict[str, list] = {}
        per_block: dict[Setting, list] = {s: [] for s in settings}
        for a in range(0, T, BLOCK_POSITIONS):
            blk = slice(a, min(a + BLOCK_POSITIONS, T))
            p_lp = teacher.log_probs(h[blk])
            s_lps = {name: students[name].log_probs(x[blk]) for name, x in sh.items()}
            entropy.append((-(p_lp.double().exp() * p_lp.double()).sum(-1)).numpy())
            stats = _block_statistics(p_lp, widths, resp[blk], None if u is None else u[blk])
            for name, value in stats.items():
                row.setdefault(name, []).append(value)
            for s in settings:
                block = FrontierBlock(p_lp=p_lp, hidden=h[blk], stats=stats, log_probs=teacher.log_probs, fitted=fitted.get(s))
                per_block[s].append(block_errors(s, block, s_lps))
        whole = {name: torch.cat(parts) for name, parts in row.items()}
        for s in settings:
            acc = accs[s]
            for kl, st, spread in per_block[s]:
                acc.kl.append(kl)
                acc.spread = spread
                for name, (f, g, e) in st.items():
                    acc.fkl_err.setdefault(name, []).append(f)
                    acc.grad_err.setdefault(name, []).append(g)
                    acc.est.setdefault(name, []).append(e)
            sc = _scores(Scores, s, whole, h, T)
            params = s.params(H)
            prepared = {s.store: encoders[s]} if s in encoders else {}
            acc.records.append(teacher_records([row_id], [sc], params, prepared)[0])
        if progress:
            progress(1)
    out = {"tokens": tokens, "rows": len(measured_rows), "teacher_entropy": float(np.concatenate(entropy).mean()) if entropy else 0.0,
           "vocab_size": V, "hidden_size": H, "svd_calibration_positions": calibration_positions, "settings": {}}
    with tempfile.TemporaryDirectory(prefix="opdcache-plan-") as tmp:
        for s in settings:
            acc = accs[s]
            nbytes = store_bytes(s.params(H), acc.records, s.store, Path(tmp))
            entry = out["settings"][s.label] = {
                "store": s.store, "flags": s.flags, "bytes_per_token": nbytes / max(tokens, 1), "kl": _stat(acc.kl),
                "kl_is": "spread" if acc.spread else "divergence",
                "students": {name: {"fkl_error": _stat(acc.fkl_err[name]), "grad_l1_error": _stat(acc.grad_err[name])} for name in acc.fkl_err},
            }
            entry.update(s.spec.report(s.setting, acc.records))
            exact_values = s.spec.exact(s.setting)
            exact = accs.get(Setting.of(s.store, **exact_values)) if exact_values is not None else None
            for name in acc.est if exact is not None else ():  # a store against the exact values it encodes
                diff = [np.abs(a - b) for a, b in zip(acc.est[name], exact.est[name])]
                entry["students"][name]["vs_exact"] = _stat(diff)
    return out


def _scores(scores_type, s: Setting, whole: dict, h: torch.Tensor, T: int):
    """The engine's Scores of one row for a setting: the statistics its store needs, at its width."""
    store, width = REGISTRY[s.store], _width(s)
    sc = scores_type(logprobs=whole["logprobs"].numpy(), logsumexp=np.zeros(T, np.float32))
    for stat in store.needs:
        if STATISTICS[stat].source == "hidden_states":
            setattr(sc, stat, h)
        else:
            value = whole[stat][:, :width]
            setattr(sc, stat, value.numpy().astype(np.int32) if value.dtype == torch.int64 else value.numpy())
    return sc


def block_errors(s: Setting, block: FrontierBlock, s_lps: dict) -> tuple[np.ndarray, dict, bool]:
    """(kl [B], {student: (fkl_err [B], grad_err [B], estimate [B])}, whether kl is a spread) of one setting on one
    block: KL(p || q*) from what its store implies (the spread of its estimate, for draws)."""
    implied = s.spec.implied(s.setting, block)
    p_lp64 = block.p_lp.double()
    if implied.spread is not None:
        kl = implied.spread.numpy()
    else:
        kl = (p_lp64.exp() * (p_lp64 - implied.log_q.double())).sum(-1).clamp_min(0).numpy()
    return kl, {n: _student_errors(block.p_lp, implied, q) for n, q in s_lps.items()}, implied.spread is not None


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
        if r.get("kl_is") == "spread" and student is None:
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
