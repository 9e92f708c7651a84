"""Training-inference mismatch (papers/003 eq. 1), measured from a cache.

Two comparisons, each over every stored response token:

* **rollouts**: delta_t = log pi_train(a_t) - log pi_rollout(a_t), where pi_rollout is what the rollout engine
  stored (``ref_logprobs``: pi_ref at temperature 1, as that engine -- possibly quantised -- computed it) and
  pi_train a fresh float32 transformers forward of the same pi_ref weights, the trainer's view. Argmax flips
  compare the rollout engine's most likely token (``ref_topk_ids[:, 0]``, needs ``--ref-top-k``) with the
  trainer's. K1 = mean(-delta) and K3 = mean(exp(delta) - 1 - delta) estimate KL(pi_rollout || pi_train) per
  token from the rollout engine's own samples (papers/003 section 4.2).
* **teacher engines**: two teacher tables of the same teacher weights scored by different engines, dtypes or
  quantisations: delta_t = logprobs_a - logprobs_b (a = the float32 transformers table when there is one).
  Argmax flips need both tables' top-k stores. The tokens are pi_ref's samples, not either engine's, so K1 and
  K3 here are moments of the log-ratio on those tokens rather than KL estimates.

:func:`report` returns plain JSON-able figures; :func:`render` the terminal table; :func:`histogram_png` the
histogram; :func:`crossed` which thresholds a report crosses (``mismatch-report`` exits 1 on any).
"""

from __future__ import annotations

import json
from contextlib import closing
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path

import numpy as np

from opdcache.backends.quant import recorded_spec
from opdcache.errors import ConfigError
from opdcache.format import shards
from opdcache.format.cache import Cache
from opdcache.inputs.errortokens import error_token_mask, is_error_sequence, RULE
from opdcache.progress import bar

QUANTILES = (0.5, 0.9, 0.99, 0.999)
DEFINITIONS = {
    "delta": "per response token, log p_a(a_t) - log p_b(a_t) at temperature 1, nats; rollouts: a = float32 transformers "
             "recompute of pi_ref (trainer), b = the rollout engine's stored ref_logprobs; teachers: a, b as the section names them",
    "mean_delta": "mean of delta over all response tokens", "mean_abs_delta": "mean of |delta|", "max_abs_delta": "max of |delta|",
    "abs_delta_quantiles": "quantiles of |delta| over tokens, keyed by the quantile",
    "argmax_flip_fraction": "fraction of positions where the two sides' most likely token differs (null: top-k not stored)",
    "k1": "mean(-delta); for rollouts an estimate of KL(pi_rollout || pi_train) per token from the rollout engine's samples",
    "k3": "mean(exp(delta) - 1 - delta); the same KL, lower-variance and never negative",
    "histogram": "token counts of |delta| per bin [edge_i, edge_i+1); values above the last edge fall in the last bin",
    "worst_sequences": "rows with the largest max |delta|; position is the response token index, marked [[ ]] in text",
    "error_tokens": "rollout comparisons: papers/004's error tokens and sequences by the rule stated in 'rule' (opdcache/inputs/errortokens.py), "
                    "the learner being the section's recompute; worst lists the error sequences with the most, error tokens in [[ ]]",
}
HIST_EDGES = np.concatenate([[0.0], np.logspace(-8, 1, 37)])  # |delta| bins: 0, 1e-8 ... 10 (4 per decade)


@dataclass(frozen=True)
class Thresholds:
    """Limits a pipeline can gate on; None = not checked."""

    max_abs: float | None = None
    """Largest allowed max |delta| (nats)."""
    mean_abs: float | None = None
    """Largest allowed mean |delta| (nats)."""
    flip_fraction: float | None = None
    """Largest allowed fraction of positions whose argmax differs."""
    k3: float | None = None
    """Largest allowed K3 per token."""


@dataclass
class Section:
    """One comparison: per-sequence deltas and (optionally) per-sequence argmax flips, with row ids."""

    name: str
    description: str
    deltas: list[np.ndarray]
    ids: list[str]
    responses: list[np.ndarray]
    flips: list[np.ndarray] | None = None
    rollout: list[np.ndarray] | None = None
    """Rollout comparisons: the rollout engine's stored log-probs per sequence (the error-token rule needs both sides)."""

    def figures(self, tokenizer=None, worst: int = 5) -> dict:
        flat = np.concatenate(self.deltas) if self.deltas else np.zeros(0)
        if flat.size == 0:
            raise ConfigError(f"{self.name}: no response tokens to compare")
        a = np.abs(flat)
        counts, _ = np.histogram(np.minimum(a, HIST_EDGES[-1]), bins=HIST_EDGES)
        out = {
            "description": self.description, "sequences": len(self.deltas), "tokens": int(flat.size),
            "mean_delta": float(flat.mean()), "mean_abs_delta": float(a.mean()), "max_abs_delta": float(a.max()),
            "abs_delta_quantiles": {str(q): float(np.quantile(a, q)) for q in QUANTILES},
            "k1": float((-flat).mean()), "k3": float(np.mean(np.expm1(flat) - flat)),
            "argmax_flip_fraction": None if self.flips is None else float(np.concatenate(self.flips).mean()),
            "histogram": {"abs_delta_edges": HIST_EDGES.tolist(), "counts": counts.tolist()},
        }
        order = np.argsort([-np.abs(d).max() if d.size else 0.0 for d in self.deltas])[:worst]
        out["worst_sequences"] = [self._worst(int(i), tokenizer) for i in order]
        if self.rollout is not None:
            out["error_tokens"] = self.error_tokens(tokenizer, worst)
        return out

    def error_tokens(self, tokenizer, worst: int) -> dict:
        """papers/004's error tokens and error sequences by opdcache/inputs/errortokens.py's rule, the learner being this
        section's recompute (learner log-prob = stored + delta)."""
        masks = [error_token_mask(r + d, r) for d, r in zip(self.deltas, self.rollout)]
        flagged = [i for i, (m, ids) in enumerate(zip(masks, self.responses)) if is_error_sequence(ids, m)]
        tokens = sum(int(m.sum()) for m in masks)
        total = sum(m.size for m in masks)
        flagged.sort(key=lambda i: -int(masks[i].sum()))
        listed = []
        for i in flagged[:worst]:
            entry = {"id": self.ids[i], "error_tokens": int(masks[i].sum()), "tokens": int(masks[i].size),
                     "positions": np.flatnonzero(masks[i]).tolist()[:20]}
            if tokenizer is not None:
                entry["text"] = "".join(f"[[{tokenizer.decode([int(x)])}]]" if m else tokenizer.decode([int(x)])
                                        for x, m in zip(self.responses[i], masks[i]))
            listed.append(entry)
        return {"rule": RULE, "tokens": tokens, "token_share": tokens / max(total, 1), "sequences": len(flagged),
                "sequence_share": len(flagged) / max(len(masks), 1), "worst": listed}

    def _worst(self, i: int, tokenizer) -> dict:
        d, ids = self.deltas[i], self.responses[i]
        t = int(np.abs(d).argmax())
        entry = {"id": self.ids[i], "max_abs_delta": float(abs(d[t])), "position": t, "token_id": int(ids[t]),
                 "sum_abs_delta": float(np.abs(d).sum()), "tokens": int(d.size)}
        if tokenizer is not None:
            pieces = [tokenizer.decode([int(x)]) for x in ids]
            entry["token"] = pieces[t]
            entry["text"] = "".join(pieces[:t]) + "[[" + pieces[t] + "]]" + "".join(pieces[t + 1:])
        return entry


def _ids(cache: Cache, table: str) -> list[str]:
    return [i for k in range(len(cache.table(table)["shards"])) for i in cache.read_shard(table, k, ["id"])["id"].to_pylist()]


def rollout_section(cache: Cache, model: str | Path | None = None, device: str = "auto", progress: bool | None = None,
                    aligned: bool = False, exact: bool = False) -> Section:
    """pi_ref recomputed in float32 by transformers against what the rollout engine stored; ``aligned``: the recompute
    runs in the rollouts' recorded low-bit scheme, as ``train --rollout-aligned``'s learner does; ``exact``: it runs in
    the exact arithmetic (train --exact's learner), in the rollouts' recorded dtype and scheme."""
    from opdcache.backends import EngineConfig, make_backend
    from opdcache.inputs.lineage import recorded_model
    from opdcache.teacher.scoring import score_requests

    if cache.kind != "rollouts":
        raise ConfigError(f"{cache.root} is a {cache.kind} cache; the rollout mismatch needs pi_ref rollouts (ref_logprobs)")
    recorded = cache.table("rollouts").get("model") or {}
    path = recorded_model(recorded, model, "--model", "the rollouts table")  # the mismatch is only meaningful for the same weights
    params = cache.params("rollouts")
    deltas, flips, ids, responses, stored_all = [], [] if params.ref_top_k else None, [], [], []
    scheme = None
    if aligned:
        from opdcache.backends.quant import aligned_scheme

        scheme = aligned_scheme(recorded, f"{cache.root}'s rollouts").spec()
    if exact:  # the exact arithmetic's recompute (in the table's own scheme when the table is exact too)
        backend = make_backend(path, EngineConfig(backend="exact", dtype=recorded.get("dtype") or "float32",
                                                  quantize=recorded_spec(recorded.get("quantization")) if recorded.get("engine") == "exact" else None))
    else:  # the float32 trainer's recompute, in the rollouts' scheme with --aligned
        backend = make_backend(path, EngineConfig(dtype="float32", device=device, quantize=scheme))
    top_column = ["ref_topk_ids"] if params.ref_top_k else []
    with closing(backend), bar(total=len(cache.shard_paths("rollouts")), desc="mismatch: float32 recompute", unit="shard", enabled=progress) as pbar:
        for index in range(len(cache.shard_paths("rollouts"))):
            rows = cache.read_shard("rollouts", index, ["id", "prompt_ids", "response_ids", "ref_logprobs"] + top_column)
            reqs = score_requests(rows.select(["prompt_ids", "response_ids"]))
            scores = backend.score(reqs, top_k=1)  # top-1: the trainer's argmax
            stored = shards.row_values(rows["ref_logprobs"])
            deltas += [sc.logprobs.astype(np.float64) - r.astype(np.float64) for sc, r in zip(scores, stored)]
            stored_all += [r.astype(np.float64) for r in stored]
            if flips is not None:
                flips += [sc.topk_ids[:, 0] != top[:, 0] for sc, top in zip(scores, shards.row_values(rows["ref_topk_ids"]))]
            ids += rows["id"].to_pylist()
            responses += [np.asarray(r.response_ids) for r in reqs]
            pbar.update(1)
    if exact:
        return Section("rollouts, exact", f"pi_ref: the exact arithmetic (train --exact) - rollout engine ({_engine_label(recorded)}) "
                       "on pi_ref's samples", deltas, ids, responses, flips, stored_all)
    if aligned:
        return Section("rollouts, aligned", f"pi_ref: float32 transformers in the rollouts' scheme {scheme} (train --rollout-aligned) - "
                       f"rollout engine ({_engine_label(recorded)}) on pi_ref's samples", deltas, ids, responses, flips, stored_all)
    return Section("rollouts", f"pi_ref: float32 transformers (trainer) - rollout engine ({_engine_label(recorded)}) on pi_ref's samples",
                   deltas, ids, responses, flips, stored_all)


def _engine_key(entry: dict) -> tuple:
    """How a table's model was run: (engine, dtype, quantization), from its manifest entry."""
    m = entry.get("model") or {}
    return (m.get("engine"), m.get("dtype"), m.get("quantization"))


def _engine_label(model: dict) -> str:
    """'engine/dtype[/quantization]' of a manifest model record."""
    return "/".join(str(model.get(k)) for k in ("engine", "dtype", "quantization") if model.get(k))


def engine_pairs(cache: Cache, teachers: list[str] | None = None) -> list[tuple[str, str]]:
    """Teacher tables to compare: the two given, or every pair of one teacher's weights run differently.
    Each pair is ordered (reference, other), the reference being a float32 transformers table when there is one."""
    def rank(slug: str) -> tuple:
        from opdcache.backends import is_reference_record

        return (not is_reference_record(cache.table(cache.teacher_table(slug)).get("model") or {}), slug)

    if teachers:
        if len(teachers) != 2:
            raise ConfigError(f"--teacher takes exactly two teacher tables to compare, got {len(teachers)}")
        for t in teachers:
            cache.teacher_table(t)
        return [tuple(sorted(teachers, key=rank))]  # type: ignore[list-item]
    pairs = []
    for a, b in combinations(cache.teachers, 2):
        ea, eb = cache.table(cache.teacher_table(a)), cache.table(cache.teacher_table(b))
        same_weights = (ea.get("model") or {}).get("fingerprint") == (eb.get("model") or {}).get("fingerprint")
        if same_weights and _engine_key(ea) != _engine_key(eb):
            pairs.append(tuple(sorted((a, b), key=rank)))
    return pairs  # type: ignore[return-value]


def teacher_section(cache: Cache, a: str, b: str) -> Section:
    ta, tb = cache.teacher_table(a), cache.teacher_table(b)
    la, lb = cache.sequences(ta, "logprobs"), cache.sequences(tb, "logprobs")
    flips = None
    if cache.params(ta).top_k and cache.params(tb).top_k:
        ka, kb = cache.sequences(ta, "topk_ids"), cache.sequences(tb, "topk_ids")
        flips = [x[:, 0] != y[:, 0] for x, y in zip(ka, kb)]
    desc = " - ".join(f"{s} ({_engine_label(cache.table(t).get('model') or {})})" for s, t in ((a, ta), (b, tb)))
    return Section(f"teachers {a} vs {b}", f"teacher log-probs: {desc}",
                   [x.astype(np.float64) - y.astype(np.float64) for x, y in zip(la, lb)],
                   _ids(cache, cache.base_table), cache.sequences(cache.base_table, "response_ids"), flips)


def exact_teacher_section(cache: Cache, slug: str, teacher: str | Path | None = None) -> Section:
    """A teacher table's stored log-probs against the exact arithmetic's recompute of the same teacher weights."""
    from opdcache.backends import EngineConfig, make_backend
    from opdcache.inputs.lineage import recorded_model
    from opdcache.teacher.scoring import score_requests

    table = cache.teacher_table(slug)
    recorded = cache.table(table).get("model") or {}
    path = recorded_model(recorded, teacher, "--teacher-model", f"the {table} table")
    backend = make_backend(path, EngineConfig(backend="exact", dtype=recorded.get("dtype") or "float32",
                                              quantize=recorded_spec(recorded.get("quantization")) if recorded.get("engine") == "exact" else None))
    deltas, ids, responses = [], [], []
    for index in range(len(cache.shard_paths(table))):
        rows = cache.read_shard(cache.base_table, index, ["id", "prompt_ids", "response_ids"])
        stored = shards.row_values(cache.read_shard(table, index, ["logprobs"])["logprobs"])
        reqs = score_requests(rows)
        deltas += [sc.logprobs.astype(np.float64) - r.astype(np.float64) for sc, r in zip(backend.score(reqs), stored)]
        ids += rows["id"].to_pylist()
        responses += [np.asarray(r.response_ids) for r in reqs]
    return Section(f"{table}, exact", f"teacher: the exact arithmetic - the stored table ({_engine_label(recorded)})", deltas, ids, responses)


def report(cache_root: str | Path, model: str | Path | None = None, teachers: list[str] | None = None, rollouts: bool = True,
           worst: int = 5, device: str = "auto", progress: bool | None = None, aligned: bool = False,
           exact: bool = False) -> tuple[dict, list[Section]]:
    """The mismatch figures of a cache, and the sections they came from (for the histogram)."""

    if worst < 0:
        raise ConfigError(f"--worst must be 0 or more, got {worst}")
    cache = Cache(cache_root)
    tokenizer = cache.tokenizer()
    sections = []
    if exact:  # the exact arithmetic against every stored table (rollouts, then teachers)
        if rollouts and cache.kind == "rollouts":
            sections.append(rollout_section(cache, model, device, progress, exact=True))
        sections += [exact_teacher_section(cache, slug) for slug in (teachers or cache.teachers)]
    elif rollouts and cache.kind == "rollouts":
        sections.append(rollout_section(cache, model, device, progress))
        if aligned:
            sections.append(rollout_section(cache, model, device, progress, aligned=True))
    elif aligned:
        raise ConfigError("--rollout-aligned compares pi_ref's recompute with the rollouts: it needs a rollouts cache and --rollouts")
    sections += [teacher_section(cache, a, b) for a, b in engine_pairs(cache, teachers)]
    if not sections:
        raise ConfigError(f"{cache_root}: nothing to compare (no pi_ref rollouts, and no two teacher tables of one teacher "
                          "scored by different engines; name two with --teacher A --teacher B)")
    return {"cache": str(cache.root), "definitions": DEFINITIONS,
            "sections": {s.name: s.figures(tokenizer, worst) for s in sections}}, sections


def crossed(rep: dict, t: Thresholds) -> list[str]:
    """Human lines for every threshold a report crosses."""
    out = []
    checks = (("max_abs_delta", t.max_abs, "--max-abs-delta"), ("mean_abs_delta", t.mean_abs, "--max-mean-abs-delta"),
              ("argmax_flip_fraction", t.flip_fraction, "--max-flip-fraction"), ("k3", t.k3, "--max-k3"))
    for name, fig in rep["sections"].items():
        for key, limit, flag in checks:
            value = fig.get(key)
            if limit is not None and value is not None and value > limit:
                out.append(f"{name}: {key} {value:.3g} > {flag} {limit:g}")
    return out


WIDTH = 80  # the report's columns: a terminal's, whatever the number of comparisons


def render(rep: dict) -> str:
    """The report as text within WIDTH columns: one column per comparison (up to three a block), one row per figure;
    then per comparison its description, worst sequences and error tokens, wrapped."""
    import textwrap

    qs = [str(q) for q in QUANTILES]
    rows = [("tokens", lambda f: f"{f['tokens']:,}"), ("mean |delta|", lambda f: f"{f['mean_abs_delta']:.2e}"),
            ("max |delta|", lambda f: f"{f['max_abs_delta']:.2e}")]
    rows += [(f"p{format(float(q) * 100, 'g')} |delta|", lambda f, q=q: f"{f['abs_delta_quantiles'][q]:.2e}") for q in qs]
    rows += [("argmax flips", lambda f: "n/a" if f["argmax_flip_fraction"] is None else f"{f['argmax_flip_fraction']:.2%}"),
             ("K1", lambda f: f"{f['k1']:.2e}"), ("K3", lambda f: f"{f['k3']:.2e}")]
    names = list(rep["sections"])
    lines = []
    for start in range(0, len(names), 3):
        block = names[start: start + 3]
        lines.append(f"{'':<17}" + "".join(f"{n[:20]:>21}" for n in block))
        for label, cell in rows:
            lines.append(f"{label:<17}" + "".join(f"{cell(rep['sections'][n]):>21}" for n in block))
        lines.append("")
    wrap = lambda text, indent: textwrap.fill(text, WIDTH, initial_indent=indent, subsequent_indent=indent + "  ")  # noqa: E731
    for name, f in rep["sections"].items():
        lines.append(wrap(f"{name}: {f['description']}", ""))
        if f["argmax_flip_fraction"] is None:
            lines.append(wrap("argmax flips: n/a (needs the rollout engine's --ref-top-k, or both teachers' top-k stores)", "  "))
        lines.append("  worst sequences (largest |delta|; the token is in [[ ]]):")
        for w in f["worst_sequences"]:
            text = w.get("text", "").replace("\n", "\\n")
            lines.append(f"    {w['id']}  |d| {w['max_abs_delta']:.3e} at token {w['position']} (id {w['token_id']})")
            lines.append(f"      {text[:WIDTH - 6]}")
        if "error_tokens" in f:
            e = f["error_tokens"]
            lines.append(wrap(f"error tokens (papers/004): {e['tokens']:,} tokens ({e['token_share']:.3%}), {e['sequences']:,} error "
                              f"sequences ({e['sequence_share']:.1%}); rule: {e['rule']}", "  "))
            for w in e["worst"]:
                text = w.get("text", "").replace("\n", "\\n")
                lines.append(f"    {w['id']}  {w['error_tokens']} error tokens of {w['tokens']}")
                lines.append(f"      {text[:WIDTH - 6]}")
        lines.append("")
    return "\n".join(lines).rstrip()


def histogram_png(sections: list[Section], path: str | Path) -> Path:
    """Histogram of |delta| on log-spaced bins, one series per comparison."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        from opdcache.errors import MissingDependencyError

        raise MissingDependencyError("the PNG histogram needs matplotlib, a dependency of opdcache: pip install matplotlib (or pass --no-png)") from None
    fig, ax = plt.subplots(figsize=(7, 4))
    edges = HIST_EDGES[1:]
    for s in sections:
        a = np.abs(np.concatenate(s.deltas))
        zeros = int((a == 0).sum())
        ax.hist(np.clip(a[a > 0], edges[0], edges[-1]), bins=edges, histtype="step", linewidth=1.5,
                label=f"{s.name} ({zeros:,} exact zeros omitted; |delta| < 1e-8 in the first bin)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("|delta| per response token (nats, temperature 1): rollouts |log pi_train - log pi_rollout|, teachers |log p_a - log p_b|")
    ax.set_ylabel("tokens")
    ax.set_title("training-inference mismatch per token")
    ax.legend(fontsize=8)
    fig.tight_layout()
    from opdcache import storage

    path = Path(path)
    with storage.staged(path) as tmp:  # a new file renamed onto the name: never written through a link planted there
        fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight")  # the whole x-axis label, not cut at the figure's edge
    plt.close(fig)
    return path


REPORT_FILE, HIST_FILE = "mismatch_report.json", "mismatch_hist.png"


def report_folder(cache: str | Path, out: Path | None) -> Path:
    """Where the report goes: ``out``, else CACHE/mismatch-report (./mismatch-report for a cache at a URL: the report is
    written locally). Checked before anything is recomputed: a folder inside the cache must not lead the writes outside
    it through a link (refused in one line naming the link)."""
    from opdcache.storage import confined_write, is_url

    if out is None:
        out = Path("mismatch-report") if is_url(cache) else Path(cache) / "mismatch-report"
    if not is_url(cache) and Path(out).absolute().is_relative_to(Path(cache).absolute()):
        for name in (REPORT_FILE, HIST_FILE):
            confined_write(Path(cache), Path(out) / name)
    return Path(out)


def write_report(rep: dict, sections: list[Section], out: Path, png: bool) -> list[Path]:
    """The JSON report and, with ``png``, the histogram, each written whole under its final name."""
    from opdcache.storage import write_text_atomic

    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / REPORT_FILE, json.dumps(rep, indent=2) + "\n")
    return [out / REPORT_FILE] + ([histogram_png(sections, out / HIST_FILE)] if png else [])
