"""The sampled teacher store (RS-KD, "Sparse Logit Sampling", arXiv 2503.16870): m draws per position from the
teacher's temperature-1 distribution, kept as the distinct ids with their counts and teacher log-probs.

Why: a top-k store is a biased estimate of the forward KL (the tail is cut), a sampled one is unbiased. With counts
c_v of m draws, (1/m) sum_v c_v (log p_v - log q_v) has expectation sum_v p_v (log p_v - log q_v) = KL(p || q), and
its gradient -(1/m) sum_v c_v grad log q_v is the full forward-KL gradient in expectation (losses.sampled_fkl_terms).

Draws are reproducible and batch-invariant: the uniforms of a row come from (seed, row id) alone (``opdcache.backends.base.row_uniforms``),
and the scorer maps each to a token by inverse CDF over the vocabulary order (backends/streamed.py ``_draw_from_slices``).

This file is the store whole: its columns and checks, and the draws' encoding (:func:`store_columns`).
"""

from __future__ import annotations

import numpy as np

from opdcache.errors import ConfigError
from opdcache.stores.base import Column, Frontier, Implied, PAD_ID, Store
from opdcache.stores.rowrules import sampled_rules

MAX_DRAWS = 255


def store_columns(draw_ids: np.ndarray, draw_lps: np.ndarray) -> dict:
    """[T, m] draws -> the sampled store's three columns as written (log-probs as float16 bits)."""
    ids, counts, lps = collapse(draw_ids, draw_lps)
    return {"sampled_ids": ids, "sampled_counts": counts, "sampled_logprobs": lps.astype(np.float16).view(np.uint16)}


def collapse(draw_ids: np.ndarray, draw_lps: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[T, m] draws (ids and their teacher log-probs) -> the store's fixed-width columns, [T, m] each: the distinct ids
    most drawn first (ties: smaller id first) padded with -1, their counts (0 for padding), their log-probs (-inf for
    padding). Vectorised: memory O(T x m)."""
    T, m = draw_ids.shape
    order = np.lexsort((draw_lps, draw_ids), axis=-1) if T else np.zeros((0, m), np.int64)
    ids_sorted = np.take_along_axis(draw_ids, order, 1)
    lps_sorted = np.take_along_axis(draw_lps, order, 1)
    first = np.ones((T, m), bool)
    first[:, 1:] = ids_sorted[:, 1:] != ids_sorted[:, :-1]
    run = np.cumsum(first, 1) - 1  # index of each draw's distinct id
    counts = np.zeros((T, m), np.int32)
    np.add.at(counts, (np.repeat(np.arange(T), m), run.ravel()), 1)
    uniq_ids = np.full((T, m), PAD_ID, np.int64)
    uniq_lps = np.full((T, m), -np.inf, np.float32)
    rows, cols = np.nonzero(first)
    uniq_ids[rows, run[rows, cols]] = ids_sorted[rows, cols]
    uniq_lps[rows, run[rows, cols]] = lps_sorted[rows, cols]
    # most drawn first, ties by smaller id (padding, count 0, last)
    rank = np.lexsort((np.where(counts > 0, uniq_ids, np.iinfo(np.int64).max), -counts), axis=-1) if T else order
    return (np.take_along_axis(uniq_ids, rank, 1).astype(np.int32), np.take_along_axis(counts, rank, 1),
            np.take_along_axis(uniq_lps, rank, 1))


def _check_job(job, enabled: bool) -> None:
    if enabled and not (isinstance(job.samples_per_position, int) and 1 <= job.samples_per_position <= MAX_DRAWS):
        raise ConfigError(f"--samples-per-position must be between 1 and {MAX_DRAWS} with --store sampled, got {job.samples_per_position}")
    if job.samples_per_position is not None and not enabled:
        raise ConfigError("--samples-per-position sets the sampled store: add --store sampled")


def _check_params(params) -> None:
    m = params.samples_per_position
    if m is not None and not (isinstance(m, int) and 1 <= m <= MAX_DRAWS):
        raise ConfigError(f"--samples-per-position must be an integer in [1, {MAX_DRAWS}], got {m!r}")
    if "sampled" in params.stores and m is None:
        raise ConfigError("the sampled store needs samples_per_position (--samples-per-position)")


def _encode(sc, params) -> dict:
    return {"sampled_logprobs": sc.sampled_logprobs}  # the draws' exact log-probs, checked finite before _pack


def _pack(sc, params, row) -> dict:
    return store_columns(sc.sampled_ids, sc.sampled_logprobs)


def _rules(values, vocab: int | None, params) -> list:
    return sampled_rules(values["sampled_ids"], values["sampled_counts"], values["sampled_logprobs"],
                         params.get("samples_per_position") or 0, vocab)


def _info(params) -> str | None:
    m = params.get("samples_per_position")
    return f"sampled store: {m} teacher draws a position (RS-KD; train --loss sampled-fkl)" if m else None


RECIPE = ("import numpy as np\n"
          "ids, counts = np.asarray(row['sampled_ids']), np.asarray(row['sampled_counts'])  # [tokens, m]\n"
          "logprobs = np.asarray(row['sampled_logprobs'], dtype=np.uint16).view(np.float16).astype(np.float32)\n"
          "draws = [dict(zip(i[c > 0].tolist(), c[c > 0].tolist())) for i, c in zip(ids, counts)]  # {token id: count}")
"""Reading the sampled store's row into {token id: count} per position (shown in the card, run by a test)."""


def _card(config: str, entry: dict) -> list[str]:
    return [f"### Reading the sampled store in `{config}` (format v3, RS-KD)", "",
            f"At each position, {entry['params'].get('samples_per_position')} tokens were drawn from the teacher's temperature-1 "
            "distribution; `sampled_ids` holds the distinct ones, most drawn first, padded with `-1`; `sampled_counts` "
            "how often each was drawn; `sampled_logprobs` the teacher's log-prob of each, as float16 bits in `uint16`. "
            "(1/m) * sum(count * (teacher_logprob - student_logprob)) is an unbiased estimate of the forward KL.", "",
            "```python", RECIPE, "```", ""]


def _implied(setting, block) -> Implied:
    """No q*: the draws' counts (the estimate is unbiased) and its spread, sqrt(Var_p[log p] / m)."""
    import torch

    m = setting["samples_per_position"]
    p_lp = block.p_lp.double()
    p = p_lp.exp()
    var = (p * p_lp * p_lp).sum(-1) - ((p * p_lp).sum(-1)) ** 2
    ids = block.stats["sampled_ids"][:, :m]
    counts = torch.zeros_like(p_lp).scatter_add_(1, ids, torch.ones(ids.shape, dtype=torch.float64))
    return Implied(counts=counts, spread=torch.sqrt(var.clamp_min(0) / m))


FRONTIER = Frontier(
    defaults=lambda hidden_size, vocab_size: [{"samples_per_position": m} for m in (4, 12, 32)],
    scored=lambda p: [{"samples_per_position": p.samples_per_position}] if p.samples_per_position else [],
    label=lambda setting: f"sampled m={setting['samples_per_position']}",
    flags=lambda setting: f"--store sampled --samples-per-position {setting['samples_per_position']}",
    implied=_implied,
)


STORE = Store(
    name="sampled",
    gives=("draws",),
    summary="sampled: m teacher draws a position, RS-KD (--samples-per-position)",
    columns=(
        Column("sampled_ids", "token_vector", "int32", "sampled",
               "RS-KD (arXiv 2503.16870): the distinct tokens among m draws from the teacher's temperature-1 distribution at "
               "this position (m = samples_per_position), most drawn first (ties: smaller id first), padded with -1.",
               width="samples_per_position", requires=("samples_per_position",)),
        Column("sampled_counts", "token_vector", "int32", "sampled",
               "How many of the m draws gave each sampled_ids entry (0 for padding); a position's counts sum to m.",
               width="samples_per_position", requires=("samples_per_position",)),
        Column("sampled_logprobs", "token_vector", "float16", "sampled",
               "Teacher temperature-1 log-prob of each sampled_ids entry (-inf for padding), as IEEE float16 bits in uint16 "
               "(field metadata opdcache.dtype = float16; |error| <= |log-prob| x 2^-11): the estimator's gradient needs only "
               "ids and counts, the log-probs give its value.",
               width="samples_per_position", requires=("samples_per_position",)),
    ),
    since=3,
    check_job=_check_job,
    check_params=_check_params,
    config=lambda job: {"sample_seed": job.sample_seed},  # only with the store: older tables keep their fingerprints
    needs=("sampled_ids", "sampled_logprobs"),
    encode=_encode,
    pack=_pack,
    rules=_rules,
    info=_info,
    card=_card,
    fidelity=lambda sc, params, enc, vocab_size: {"sampled_stderr": np.sqrt(sc.variance.astype(np.float64) / params.samples_per_position)},
    fidelity_means={"sampled_stderr": "standard error of the sampled forward-KL estimate's teacher term, nats"},
    frontier=FRONTIER,
)
