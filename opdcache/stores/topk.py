"""The topk store: the teacher's own k most likely next tokens and their log-probs, exact (format v1), or compact
(v3/v4: a residual-mass support, float16 log-probs or prob14 codes, and the tail's mass; opdcache/stores/compact.py)."""

from __future__ import annotations

from opdcache.errors import ConfigError
from opdcache.stores.base import Column, Frontier, Implied, PROB14_STEP, Store
from opdcache.stores.compact import DISTORTION_META

PRECISIONS = ("float32", "float16", "prob14")
"""Precisions of the compact top-k store's values: float32 or float16 log-probs (v3), or ``prob14`` (v4): each kept
entry's probability as a uint16 code c = round(p x 2^14), decoded p = c x 2^-14 (|error| <= 2^-15), entries whose code
would be 0 (p < 2^-15) moved into the tail, the kept entries in ascending id order (their ids then compress to half:
bench_storage.py, BENCHMARKS.md). opdcache/stores/compact.py measures q8 too: on bench_storage.py's data, 44x float16's
forward-KL error for 6 B/token less at mass 1e-3, so it is not offered."""
PRECISION_SINCE = {"float32": 3, "float16": 3, "prob14": 4}
MAX_K = 1024

_SHAPES = "--topk-precision and --topk-mass shape the topk store: add --store topk"


def _precision(params) -> tuple[str, str | None]:
    """v1: float32; v3 compact: float32, or float16 bits; v4: prob14 codes."""
    precision = params.topk_precision or "float32"
    return precision, (precision if precision != "float32" else None)


def _dtype_doc(version: int) -> str:
    """Written "float32" before v3 added the float16 form; the same column either way."""
    if version < 3:
        return "float32"
    if version < 4:
        return "float32, or float16 bits in uint16 (v3 compact, field metadata opdcache.dtype)"
    return "float32, or uint16: float16 bits (v3) or prob14 codes (v4), named by field metadata opdcache.dtype"


def _format_notes(version: int) -> dict:
    """The compact top-k's encodings (v3; prob14 since v4)."""
    if version < 3:
        return {}
    notes = {
        "when": "store parameters topk_precision or topk_mass set (score-teacher --topk-precision / --topk-mass)",
        "support": "per position, the teacher's most likely entries until the residual mass is at most topk_mass "
                   "(at least 1, at most top_k), most likely first; the remaining slots hold id -1 and log-prob -inf",
        "precisions": [p for p in PRECISIONS if PRECISION_SINCE[p] <= version],
        "float16": "topk_logprobs holds the IEEE float16 bit pattern in uint16 (field metadata opdcache.dtype = float16); "
                   "numpy: values.view(np.float16).astype(np.float32)",
        "tail": "topk_tail = 1 - sum of the kept entries' probabilities, from the float32 log-probs in float64",
        "distortion": "measured at write time against the exact top-k and recorded in the manifest table entry 'topk'",
    }
    if version >= 4:
        notes["prob14"] = (
            "topk_logprobs holds uint16 codes c (field metadata opdcache.dtype = prob14): probability c x 2^-14, log-prob "
            "log(c) - 14 log 2, 0 at padding; entries with p < 2^-15 are moved into the tail; the kept entries are in "
            "ascending id order (not most likely first); topk_tail = 1 - the kept entries' exact probabilities")
    return {"compact_topk": notes}


def _check_shape(precision, mass, enabled: bool) -> None:
    """The compact form's settings: checked alike for a job's options and a table's recorded parameters."""
    if (precision is not None or mass is not None) and not enabled:
        raise ConfigError(_SHAPES)
    if precision is not None and precision not in PRECISIONS:
        raise ConfigError(f"--topk-precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if mass is not None and not (isinstance(mass, (int, float)) and 0 <= mass < 1):
        raise ConfigError(f"--topk-mass must be in [0, 1), got {mass!r}")


def _check_job(job, enabled: bool) -> None:
    if enabled and not (job.top_k and 1 <= job.top_k <= MAX_K):
        raise ConfigError(f"--top-k must be between 1 and {MAX_K} with --store topk, got {job.top_k}")
    _check_shape(job.topk_precision, job.topk_mass, enabled)


def _check_params(params) -> None:
    if "topk" in params.stores and params.top_k is None:
        raise ConfigError("the topk store needs top_k (--top-k)")
    _check_shape(params.topk_precision, params.topk_mass, "topk" in params.stores)


def _encode(sc, params) -> dict:
    return {"topk_ids": sc.topk_ids, "topk_logprobs": sc.topk_logprobs}


_RECIPE = ("import numpy as np\n"
           "ids = np.asarray(row['topk_ids'])  # [tokens, top_k], -1 = no entry\n"
           "logprobs = {decode}\n"
           "kept = ids != -1\n"
           "entries = [dict(zip(i[k].tolist(), lp[k].tolist())) for i, lp, k in zip(ids, logprobs, kept)]\n"
           "tail = np.asarray(row['topk_tail'])  # probability outside the kept entries")
RECIPES = {
    "float16": _RECIPE.format(decode="np.asarray(row['topk_logprobs'], dtype=np.uint16).view(np.float16).astype(np.float32)"),
    "float32": _RECIPE.format(decode="np.asarray(row['topk_logprobs'], dtype=np.float32)"),
    "prob14": _RECIPE.format(decode="np.log(np.asarray(row['topk_logprobs'], dtype=np.float64) * 2.0 ** -14)  "
                                    "# uint16 codes: probability c x 2^-14"),
}
"""Decoding a compact top-k row into {token id: log-prob} per position (shown in the card, run by a test)."""


def _card(config: str, entry: dict) -> list[str]:
    params = entry["params"]
    if not (params.get("topk_precision") or params.get("topk_mass") is not None):
        return []
    d = (entry.get("topk") or {}).get("distortion") or {}
    precision = params.get("topk_precision") or "float32"
    return [f"### Decoding the compact top-k in `{config}` (format v{PRECISION_SINCE.get(precision, 3)}: {precision}, residual mass "
            f"{params.get('topk_mass')})", "",
            "Each position keeps the teacher's most likely tokens until the probability left out is at most the "
            "residual mass (at most `top_k`), most likely first; the remaining slots hold id `-1` (and log-prob "
            "`-inf`). `topk_tail` is the probability outside the kept entries."
            + (" The log-probs are IEEE float16 bit patterns in `uint16`." if precision == "float16" else "")
            + (" The values are probabilities as `uint16` codes c (probability c x 2^-14, to within 2^-15; entries "
               "below 2^-15 are in the tail), and the kept entries are in ascending id order, not most likely first."
               if precision == "prob14" else "")
            + (f" Measured when written, against the exact top-k: |log-prob error| at most {d['max_abs_logprob_error']:.2e}, "
               f"{d['mean_entries']:.1f} entries a position, at most {d['max_moved_mass']:.2e} of the probability moved into "
               "the tail." if d else ""), "", "Decode a row like this:", "",
            "```python", RECIPES[precision], "```", ""]


def _compact(setting) -> bool:
    return setting.get("topk_precision") is not None or setting.get("topk_mass") is not None


def _label(setting) -> str:
    if not _compact(setting):
        return f"top-{setting['top_k']} exact"
    mass = setting.get("topk_mass")
    return f"top-{setting['top_k']} {setting.get('topk_precision') or 'float32'}" + (f" mass {mass:g}" if mass is not None else "")


def _flags(setting) -> str:
    out = f"--store topk --top-k {setting['top_k']}"
    if _compact(setting):
        mass = setting.get("topk_mass")
        out += f" --topk-precision {setting.get('topk_precision') or 'float32'}" + (f" --topk-mass {mass:g}" if mass is not None else "")
    return out


def _defaults(hidden_size: int, vocab_size: int) -> list:
    """Top-k widths, and the compact top-128 in float16 at two masses and as prob14 (the smallest top-k store:
    BENCHMARKS.md)."""
    k = min(128, vocab_size - 1)
    return ([{"top_k": w} for w in (20, 128, 512) if w < vocab_size]
            + [{"top_k": k, "topk_precision": "float16", "topk_mass": mass} for mass in (1e-4, 1e-3)]
            + [{"top_k": k, "topk_precision": "prob14", "topk_mass": 1e-4}])


def _implied(setting, block) -> Implied:
    """q* = the stored entries renormalised with the tail bin, the tail spread evenly over the rest (the maximum-entropy
    completion, opdcache/format/fidelity.py); the exact store's tail is the mass outside, summed directly."""
    import math

    import torch

    from opdcache.stores import compact

    p_lp = block.p_lp.double()
    k = setting["top_k"]
    ids, lps = block.stats["topk_ids"][:, :k], block.stats["topk_logprobs"][:, :k]
    if not _compact(setting):
        kept_k, stored = torch.ones(ids.shape, dtype=torch.bool), lps
        outside = torch.ones(p_lp.shape, dtype=torch.bool).scatter_(1, ids.long(), False)
        tail = (p_lp.exp() * outside).sum(-1)
    else:
        enc = compact.compact_topk(ids.numpy(), lps.numpy(), setting.get("topk_precision") or "float32", setting.get("topk_mass"))
        kept_k = torch.as_tensor(enc["ids"] != -1)
        ids = torch.as_tensor(enc["ids"]).long().clamp_min(0)
        stored = torch.as_tensor(enc["logprobs"])
        tail = torch.as_tensor(enc["tail"]).double()
    tail = tail.clamp_min(1e-30)  # a tail rounded to 0 while the teacher still has mass there: a finite, large KL
    B, V = p_lp.shape
    stored64 = torch.where(kept_k, stored.double(), torch.full_like(stored.double(), -math.inf))
    z = stored64.exp().sum(-1) + tail
    r, c = kept_k.nonzero(as_tuple=True)  # only kept slots: a padding slot's id (clamped to 0) must not touch token 0
    kept = torch.zeros((B, V), dtype=torch.bool)
    kept[r, ids[r, c]] = True
    q_star = torch.log((tail / z) / (V - kept_k.sum(-1)).clamp_min(1).double())[:, None].expand(B, V).clone()
    q_star[r, ids[r, c]] = (stored64 - torch.log(z)[:, None])[r, c]
    return Implied(log_q=q_star, kept=kept, tail=tail / z)


def _report(setting, records) -> dict:
    import numpy as np

    if not _compact(setting):
        return {}
    return {"mean_entries": float(np.mean([(r["topk_ids"] != -1).sum(1).mean() for r in records])) if records else 0.0}


def _reencode(params, options, where: str) -> dict:
    """An exact top-k as a compact one (``opdcache upgrade``)."""
    if params.topk_compact:
        raise ConfigError(f"{where} is already a compact top-k ({params.topk_precision}, mass {params.topk_mass}); "
                          "compact an exact top-k table instead")
    if options.get("topk_precision") is None and options.get("topk_mass") is None:
        raise ConfigError("give --topk-precision and/or --topk-mass: the exact top-k is already what the source holds")
    _check_shape(options.get("topk_precision"), options.get("topk_mass"), True)
    return {"top_k": params.top_k, "topk_precision": options.get("topk_precision"), "topk_mass": options.get("topk_mass")}


def _rules(values, vocab: int | None, params) -> list:
    """The rows' top-k rules (opdcache/stores/rowrules.py) at the layout its precision stores, and the sampled token's
    log-prob against its top-k entry."""
    from opdcache.stores import rowrules

    ids, lps = values["topk_ids"], values["topk_logprobs"]
    precision = (params.get("dtypes") or {}).get("topk_logprobs")  # as the shard stores it
    tol, order = rowrules.topk_layout(precision, ids.shape[1] if ids.ndim == 2 else 1)
    out = rowrules.topk_rules("topk", ids, lps, vocab, values.get("topk_tail"), tol, order)
    if "response_ids" in values and "logprobs" in values and ids.ndim == 2:
        out += rowrules.against_topk("logprobs", values["response_ids"], values["logprobs"], ids, lps,
                                     rel_tol=2.0 ** -10 if precision == "float16" else 0.0,
                                     prob_tol=PROB14_STEP / 2 + 1e-6 if order == "ids" else None)
    return out


class _CompactEncoder:
    """A shard's rows in the compact form, and the sums of its distortion against the exact top-k (the footer's)."""

    def __init__(self, params) -> None:
        self.params, self.sums = params, []

    def pack(self, sc, row) -> tuple[dict, dict]:
        from opdcache.stores import compact

        enc = compact.compact_topk(sc.topk_ids, sc.topk_logprobs, self.params.topk_precision or "float32", self.params.topk_mass)
        self.sums.append(compact.distortion_sums(enc))
        return {"topk_ids": enc["ids"], "topk_logprobs": enc["stored"], "topk_tail": enc["tail"]}, enc

    def footer(self) -> dict:
        import json

        from opdcache.stores import compact

        return {DISTORTION_META: json.dumps(compact.merge_sums(self.sums), sort_keys=True).encode()}


def _fidelity(sc, params, enc, vocab_size: int) -> dict:
    """The mass outside the stored support and KL(p || q*) to its maximum-entropy completion, per position."""
    import numpy as np

    from opdcache.stores.compact import kl_maxent

    k = sc.topk_logprobs
    if enc is None:
        r, kl = kl_maxent(sc.entropy, k, np.isfinite(k), k, None, vocab_size)
    else:
        r, kl = kl_maxent(sc.entropy, enc["exact"], enc["ids"] != -1, enc["logprobs"], enc["tail"], vocab_size)
    return {"topk_tail_mass": r, "topk_kl_maxent": kl}


def _record(metas: list, params) -> dict:
    """A compact top-k table's settings and its distortion against the exact top-k, merged from the sums every shard's
    footer carries (opdcache/stores/compact.py)."""
    from opdcache.errors import ManifestError
    from opdcache.stores import compact
    from opdcache.untrusted import loads

    sums = [loads(meta[DISTORTION_META], "a shard footer's top-k distortion", ManifestError) for meta in metas]
    return {"precision": params.topk_precision or "float32", "mass": params.topk_mass,
            "distortion": compact.distortion_summary(compact.merge_sums(sums))}


def _record_schema(version: int) -> dict | None:
    """A compact top-k's record (format v3; v4 added the prob14 precision)."""
    if version < 3:
        return None
    return {
        "type": "object",
        "description": "a compact top-k store (format v3): its precision and residual-mass support, and the distortion against the exact top-k measured when each shard was written (opdcache/stores/compact.py)",
        "required": ["precision", "mass", "distortion"],
        "properties": {
            "precision": {"enum": [p for p in PRECISIONS if PRECISION_SINCE[p] <= version]},
            "mass": {"type": ["number", "null"], "minimum": 0, "maximum": 1},
            "distortion": {"type": "object", "required": ["positions", "mean_entries", "max_abs_logprob_error", "mean_abs_logprob_error",
                                                          "max_kl_exact_to_compact", "mean_kl_exact_to_compact", "max_moved_mass", "mean_moved_mass"]},
        },
    }


def _describe(c) -> list[str]:
    d = c["distortion"]
    return [f"compact top-k: {c['precision']} log-probs, residual mass {c['mass']}, {d['mean_entries']:.1f} entries a "
            f"position; against the exact top-k: |log-prob error| max {d['max_abs_logprob_error']:.2e} mean "
            f"{d['mean_abs_logprob_error']:.2e}, KL(exact || compact) max {d['max_kl_exact_to_compact']:.2e} mean "
            f"{d['mean_kl_exact_to_compact']:.2e}, mass moved into the tail max {d['max_moved_mass']:.2e} mean "
            f"{d['mean_moved_mass']:.2e}"]


FRONTIER = Frontier(
    defaults=_defaults,
    scored=lambda p: [{"top_k": p.top_k, "topk_precision": p.topk_precision, "topk_mass": p.topk_mass}] if p.top_k else [],
    label=_label,
    flags=_flags,
    implied=_implied,
    fits=lambda setting, hidden_size, vocab_size: setting["top_k"] < vocab_size,
    exact=lambda setting: {"top_k": setting["top_k"]} if _compact(setting) else None,
    report=_report,
)


STORE = Store(
    name="topk",
    gives=("top_k",),
    summary="topk: the teacher's own top-k (--top-k; compact with --topk-precision/--topk-mass)",
    columns=(
        Column("topk_ids", "token_vector", "int32", "topk", "Teacher's own k most likely next tokens at temperature 1, most likely first.", width="top_k", requires=("top_k",)),
        Column("topk_logprobs", "token_vector", "topk", "topk", "Teacher temperature-1 log-probs of topk_ids, descending.", width="top_k", requires=("top_k",),
               precision=_precision, dtype_doc=_dtype_doc),
        Column("topk_tail", "token", "float32", "topk",
               "Compact top-k (v3): the teacher's probability outside the kept entries, 1 - sum(exp(topk_logprobs over ids "
               "!= -1)), summed in float64 from the float32 log-probs before any rounding; an estimator with one extra tail "
               "bin sums to 1 on what is kept.", requires=("topk_compact",), since=3),
    ),
    check_job=_check_job,
    check_params=_check_params,
    params=lambda job, facts: {"top_k": job.top_k},
    needs=("topk_ids", "topk_logprobs"),
    encode=_encode,
    version=lambda params: PRECISION_SINCE[params.topk_precision or "float32"] if params.topk_compact else 1,
    reencode=_reencode,
    format_notes=_format_notes,
    shard_encoder=lambda params: _CompactEncoder(params) if params.topk_compact else None,
    fidelity=_fidelity,
    fidelity_means={"topk_kl_maxent": "KL(teacher || stored top-k with its tail spread evenly), nats",
                    "topk_tail_mass": "teacher mass outside the stored top-k support"},
    rules=_rules,
    rules_read=("response_ids", "logprobs"),
    record=_record,
    record_meta=DISTORTION_META,
    record_when=lambda params: bool(params.topk_compact),
    record_schema=_record_schema,
    describe=_describe,
    card=_card,
    frontier=FRONTIER,
)
