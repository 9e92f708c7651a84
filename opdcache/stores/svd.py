"""The svd store: the teacher's final hidden state projected to rank r (papers/002), with the projection and decoder
fitted on calibration positions and kept in ``svd.safetensors``, its measured distortion in the manifest. The scoring
module writes its column (the projection is fitted over the whole table first: opdcache/stores/svdprojection.py)."""

from __future__ import annotations

from opdcache.errors import ConfigError
from opdcache.stores.base import Column, Frontier, Implied, Store


def _check_job(job, enabled: bool) -> None:
    if job.svd_dtype not in ("bfloat16", "float32"):
        raise ConfigError(f"--svd-dtype must be bfloat16 or float32, got {job.svd_dtype!r}")
    if enabled and not (job.svd_rank and job.svd_rank >= 1):
        raise ConfigError(f"--svd-rank must be a positive integer with --store svd, got {job.svd_rank}")
    if job.svd_min_positions is not None and (not enabled or job.svd_min_positions < 1):
        raise ConfigError(f"--svd-min-positions sets the svd fit's minimum calibration size: a positive integer with --store svd, got {job.svd_min_positions}")
    from opdcache.stores.svdprojection import METHODS  # torch: imported only when a job is checked

    if job.svd_method not in METHODS:
        raise ConfigError(f"--svd-method must be one of {', '.join(METHODS)}, got {job.svd_method!r}")


def _check_params(params) -> None:
    if "svd" in params.stores and params.svd_rank is None:
        raise ConfigError("the svd store needs svd_rank (--svd-rank)")
    if params.svd_dtype not in (None, "bfloat16"):
        raise ConfigError(f"svd_dtype must be bfloat16 or unset (float32), got {params.svd_dtype!r}")


def _check_model(job, facts) -> None:
    if job.svd_min_positions and facts.get("positions") is not None and facts["positions"] < job.svd_min_positions:
        raise ConfigError(f"--svd-min-positions {job.svd_min_positions}: the {facts['base']} table has only "
                          f"{facts['positions']:,} response positions to fit the svd projection on; add rollouts or lower "
                          "--svd-min-positions")
    hidden = facts.get("hidden_size")
    if hidden is not None and job.svd_rank > hidden:  # the rank of a projection of the hidden state
        raise ConfigError(f"--svd-rank {job.svd_rank} is above the teacher's hidden size {hidden} ({facts['where']}): the svd "
                          f"store projects the hidden state, so its rank is at most {hidden}; pass --svd-rank {hidden} or "
                          "less, or --store hidden for the states themselves")


def _prepare(prep):
    """Fit (or reload) the projection over the whole table first; the rows are its codes of the hidden states."""
    from opdcache.stores.svdprojection import fit_for_table

    proj, prep.meta["svd"] = fit_for_table(prep, prep.table_dir / STORE.side_file)
    return encoding_with(proj, prep.job.svd_dtype == "bfloat16")


def encoding_with(proj, rounded: bool) -> Store:
    """The store, its rows encoded with the projection ``proj`` (an ``SVDProjection``), as bfloat16 bits when
    ``rounded``."""
    from dataclasses import replace

    def encode(sc, params) -> dict:
        return {"svd": proj.encode(sc.hidden).numpy()}

    def pack(sc, params, row) -> dict:  # rounded after the finiteness check, as its bits
        import torch

        from opdcache.stores.base import hidden_to_numpy

        return {"svd": hidden_to_numpy(torch.from_numpy(row["svd"]).to(torch.bfloat16))} if rounded else {}

    return replace(STORE, encode=encode, pack=pack)


def _side_file_problem(path) -> str | None:
    from opdcache.errors import SchemaError
    from opdcache.stores.svdprojection import load

    try:
        load(path)
    except SchemaError as exc:
        return str(exc)
    return None


def _side_record(path) -> dict:
    from opdcache.stores.svdprojection import read_metadata

    return read_metadata(path)["info"]  # the fit's record


def _head(cache, table, params):
    """Teacher logits = z D^T + bias: the projection's decoder stands in for the head."""
    from opdcache.stores import svdprojection
    from opdcache.stores.head import Head

    path = cache.side_file(table, "svd.safetensors")  # hash-checked first, like every shard
    projection = svdprojection.load(path)
    return Head(projection.decoder, projection.bias), params.svd_rank, path


def _fit(setting, teacher, calibration) -> tuple:
    """The frontier's projection: the prob-weighted fit of the setting's rank on the calibration states."""
    from opdcache.stores import svdprojection

    proj = svdprojection.fit(teacher.W, teacher.b, calibration, min(setting["svd_rank"], int(teacher.W.shape[1])), "prob-weighted")
    return proj, encoding_with(proj, setting.get("svd_dtype") == "bfloat16")


def _implied(setting, block) -> Implied:
    """q* = softmax of the rank-r reconstruction's logits (its codes rounded to the stored dtype)."""
    import torch

    proj = block.fitted
    z = proj.encode(block.hidden)
    if setting.get("svd_dtype") == "bfloat16":
        z = z.to(torch.bfloat16).float()
    return Implied(log_q=block.log_probs(z, proj.decoder, proj.bias))


def _describe(record) -> list[str]:
    """The fit's distortion, per method measured (the fitted one and its comparisons)."""
    return [f"svd {method:<13} rank {d['rank']}: KL(teacher || rank-{d['rank']} reconstruction) {d['mean_kl']:.2e}"
            + (f" ± {d['kl_stderr']:.1e}" if "kl_stderr" in d else "") + " nats/position "
            f"(mean over {d['positions']} positions of {record.get('heldout', 'held-out rows')}, temperature 1), "
            f"top-1 agreement {d['top1_agreement']:.1%}" for method, d in record["distortion"].items()]


FRONTIER = Frontier(
    defaults=lambda hidden_size, vocab_size: [{"svd_rank": r, "svd_dtype": "bfloat16"} for r in (64, 256, 512) if r < hidden_size],
    scored=lambda p: [{"svd_rank": p.svd_rank, "svd_dtype": p.svd_dtype}] if p.svd_rank else [],
    label=lambda setting: f"svd r={setting['svd_rank']} {setting.get('svd_dtype') or 'float32'}",
    flags=lambda setting: f"--store svd --svd-rank {setting['svd_rank']} --svd-dtype {setting.get('svd_dtype') or 'float32'}",
    implied=_implied,
    fits=lambda setting, hidden_size, vocab_size: setting["svd_rank"] < hidden_size,
    fit=_fit,
)


STORE = Store(
    name="svd",
    gives=("vectors",),
    head=_head,
    summary="svd: the teacher's hidden states at rank r (--svd-rank)",
    columns=(
        Column("svd", "token_vector", "svd", "svd",
               "Teacher final hidden state projected to rank r by the encoder in svd.safetensors (z = hidden @ encoder); "
               "approximate logits = z @ decoder.T (+ bias).", width="svd_rank", requires=("svd_rank",),
               precision=lambda params: (params.svd_dtype or "float32", params.svd_dtype),  # v3: bfloat16 as its raw bits
               dtype_doc=lambda version: "float32" if version < 3 else
               "float32, or bfloat16 bits in uint16 (v3 svd_dtype, field metadata opdcache.dtype)"),
    ),
    check_job=_check_job,
    check_params=_check_params,
    check_model=_check_model,
    params=lambda job, facts: {"svd_rank": job.svd_rank, "svd_dtype": "bfloat16" if job.svd_dtype == "bfloat16" else None},
    version=lambda params: 3 if params.svd_dtype else 1,
    rescored=False,
    config=lambda job: {"svd_method": job.svd_method},
    config_default={"svd_method": None},  # recorded by every teacher table since the store came
    needs=("hidden",),
    prepare=_prepare,
    side_file="svd.safetensors",
    side_tensors=("encoder", "decoder"),
    side_file_problem=_side_file_problem,
    side_record=_side_record,
    record_schema=lambda version: {"type": "object"},  # the fit's record, kept since v1
    describe=_describe,
    flat=(),
    frontier=FRONTIER,
)
