"""The sampled store (RS-KD, arXiv 2503.16870): m draws per position from the teacher's temperature-1 distribution,
kept as the distinct ids with their counts and teacher log-probs: an unbiased estimate of the forward KL
(opdcache/sampled.py holds the draws and their estimator)."""

from __future__ import annotations

from opdcache.errors import ConfigError
from opdcache.stores.base import Column, Store

MAX_DRAWS = 255


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


def _pack(sc, params) -> dict:
    from opdcache.sampled import store_columns

    return store_columns(sc.sampled_ids, sc.sampled_logprobs)


def _rules(values, vocab: int | None, params) -> list:
    from opdcache.rowrules import sampled_rules  # rowrules reads this package's base: imported when rules run

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


STORE = Store(
    name="sampled",
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
    encode=_encode,
    pack=_pack,
    rules=_rules,
    info=_info,
    card=_card,
)
