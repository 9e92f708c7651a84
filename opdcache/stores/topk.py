"""The topk store: the teacher's own k most likely next tokens and their log-probs, exact (format v1), or compact
(v3/v4: a residual-mass support, float16 log-probs or prob14 codes, and the tail's mass; opdcache/stores/compact.py)."""

from __future__ import annotations

from opdcache.errors import ConfigError
from opdcache.stores.base import Column, Store

PRECISIONS = ("float32", "float16", "prob14")
"""Precisions of the compact top-k store's values: float32 or float16 log-probs (v3), or ``prob14`` (v4): each kept
entry's probability as a uint16 code c = round(p x 2^14), decoded p = c x 2^-14 (|error| <= 2^-15), entries whose code
would be 0 (p < 2^-15) moved into the tail, the kept entries in ascending id order (their ids then compress to half:
bench_storage.py, BENCHMARKS.md). opdcache/stores/compact.py measures q8 too: on bench_storage.py's data, 44x float16's
forward-KL error for 6 B/token less at mass 1e-3, so it is not offered."""
PRECISION_SINCE = {"float32": 3, "float16": 3, "prob14": 4}
MAX_K = 1024

_SHAPES = "--topk-precision and --topk-mass shape the topk store: add --store topk"


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


STORE = Store(
    name="topk",
    gives=("top_k",),
    summary="topk: the teacher's own top-k (--top-k; compact with --topk-precision/--topk-mass)",
    columns=(
        Column("topk_ids", "token_vector", "int32", "topk", "Teacher's own k most likely next tokens at temperature 1, most likely first.", width="top_k", requires=("top_k",)),
        Column("topk_logprobs", "token_vector", "topk", "topk", "Teacher temperature-1 log-probs of topk_ids, descending.", width="top_k", requires=("top_k",)),
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
    card=_card,
)
