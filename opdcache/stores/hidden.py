"""The hidden store: the teacher's final hidden state at every position, bit-exact in its compute dtype (or rounded to
a narrower one, with the rounding's KL recorded), and the unembedding beside it in ``head.safetensors``, so that the
trainer recomputes the teacher's full distribution."""

from __future__ import annotations

from opdcache.errors import ConfigError
from opdcache.stores.base import Column, Frontier, hidden_to_numpy, Implied, Store

DTYPES = ("float32", "bfloat16", "float16")
REBUILD_TOL = {"float32": 1e-3, "float16": 2e-2, "bfloat16": 1e-1}
"""The stored log-prob rebuilt from the stored state through the head (a float32 matmul) against the teacher's own
kernels in its dtype: validate's tolerance per stored dtype."""


def _check_job(job, enabled: bool) -> None:
    if job.hidden_dtype is not None and job.hidden_dtype not in DTYPES:
        raise ConfigError(f"--hidden-dtype must be one of {', '.join(DTYPES)}, got {job.hidden_dtype!r}")
    if job.hidden_dtype is not None and not enabled:
        raise ConfigError("--hidden-dtype sets the hidden store's precision: add --store hidden")


def _check_params(params) -> None:
    if params.hidden_dtype is not None and params.hidden_dtype not in DTYPES:
        raise ConfigError(f"hidden_dtype must be one of {', '.join(DTYPES)}, got {params.hidden_dtype!r}")
    if "hidden" in params.stores and (params.hidden_size is None or params.hidden_dtype is None):
        raise ConfigError("the hidden store needs hidden_size and hidden_dtype")


def _encode(sc, params) -> dict:
    import torch

    return {"hidden": hidden_to_numpy(sc.hidden.to(getattr(torch, params.hidden_dtype)))}


RECIPES = {
    "bfloat16": "import numpy as np, torch\n"
                "bits = np.asarray(row['hidden'], dtype=np.uint16)  # [tokens, hidden] raw bfloat16 bits\n"
                "hidden = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)",
    "float16": "import numpy as np\n"
               "hidden = np.asarray(row['hidden'], dtype=np.uint16).view(np.float16)  # [tokens, hidden]",
}
"""How to turn a row's 16-bit ``hidden`` bit patterns back into numbers, per stored dtype (shown in the card, run by a test)."""


def _card(config: str, entry: dict) -> list[str]:
    dtype = entry["params"].get("hidden_dtype")
    if dtype not in RECIPES:
        return []
    return [f"### Decoding `hidden` in `{config}` ({dtype})", "",
            f"The column stores the teacher's {dtype} hidden states bit-exact, as their raw 16-bit patterns in `uint16` "
            "(Parquet has no bfloat16): every client (datasets, DuckDB, Polars, pandas) returns integers, and the field's "
            "`opdcache.dtype` metadata is lost once loaded. Decode a row like this:", "",
            "```python", RECIPES[dtype], "```", ""]


def _prepare(prep) -> None:
    """The unembedding beside the states, once (a resumed job keeps the one it wrote)."""
    from opdcache.stores.head import head_of, save_head

    path = prep.table_dir / STORE.side_file
    if not path.is_file():
        save_head(head_of(prep.backend.model), path)


def _head(cache, table, params):
    from opdcache.stores.head import load_head

    path = cache.side_file(table, "head.safetensors")  # hash-checked first, like every shard
    return load_head(path), params.hidden_size, path


def _implied(setting, block) -> Implied:
    """q* = softmax of the logits of the states rounded to the stored dtype."""
    import torch

    h = block.hidden
    return Implied(log_q=block.log_probs(h.to(getattr(torch, setting["hidden_dtype"])).to(h.dtype)))


FRONTIER = Frontier(
    defaults=lambda hidden_size, vocab_size: [{"hidden_dtype": d} for d in ("float32", "bfloat16")],
    scored=lambda p: [{"hidden_dtype": p.hidden_dtype or "float32"}] if (p.hidden_dtype or "float32") in ("float32", "bfloat16") else [],
    label=lambda setting: f"hidden {setting['hidden_dtype']}",
    flags=lambda setting: f"--store hidden --hidden-dtype {setting['hidden_dtype']}",
    implied=_implied,
    params=lambda setting, hidden_size: {**setting, "hidden_size": hidden_size},
)


STORE = Store(
    name="hidden",
    gives=("vectors",),
    head=_head,
    summary="hidden: the teacher's final hidden states (the full distribution, recomputed)",
    columns=(
        Column("hidden", "token_vector", "hidden", "hidden",
               "Teacher final hidden state after the final norm: the exact input of the unembedding in head.safetensors, so "
               "logits = hidden @ weight.T (+ bias). Stored bit-exact in the teacher's compute dtype: float32 as float32; "
               "bfloat16 and float16 as their raw 16-bit patterns in uint16 (field metadata opdcache.dtype names which).",
               width="hidden_size", requires=("hidden_size",),
               precision=lambda params: (params.hidden_dtype, params.hidden_dtype)),
    ),
    check_job=_check_job,
    check_params=_check_params,
    params=lambda job, facts: {"hidden_size": facts["hidden_size"], "hidden_dtype": job.hidden_dtype or facts["dtype"]},
    needs=("hidden",),
    encode=_encode,
    prepare=_prepare,
    side_file="head.safetensors",
    side_tensors=("weight",),  # its shapes are checked where validate loads it to rebuild the log-probs
    rebuilds=REBUILD_TOL,
    fidelity=lambda sc, params, enc, vocab_size: {} if sc.rounding_kl is None else {"hidden_rounding_kl": sc.rounding_kl},
    fidelity_means={"hidden_rounding_kl": "KL(teacher || teacher rebuilt from the stored hidden states), nats"},
    format_notes=lambda version: {"hidden_dtypes": list(DTYPES)},
    card=_card,
    flat=(),
    frontier=FRONTIER,
)
