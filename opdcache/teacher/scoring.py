"""``score-teacher``: one teacher pass over prompt + response of every rollout, stored next to the rollouts.

The teacher table ``teachers/<slug>/`` is row-aligned 1:1 with the rollout shards. Before any work it
checks that the teacher shares the cache's tokenizer and, from lineage, that it is the teacher pi_ref was
fine-tuned on (papers/000 teacher consistency); a mismatch is refused unless allowed, and the decision is
recorded in the manifest. The hidden store saves the unembedding as ``head.safetensors``; the svd store
fits its projection on calibration positions drawn from every shard first and records its measured distortion. Every
table records its stores' error against the teacher's full vocabulary, measured while scoring (opdcache/format/fidelity.py).
"""

from __future__ import annotations

import json
import re
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path

from opdcache import stores as store_registry, threads
from opdcache.backends import EngineConfig, describe_statistic, engines_computing, make_backend
from opdcache.backends.base import STATISTICS, ScoreRequest
from opdcache.stores.base import Preparation
from opdcache.errors import ConfigError, ConsistencyError, SchemaError
from opdcache.format import schema as S, shards
from opdcache.format.cache import Cache, run_table_job, TableJob
from opdcache.format.workers import worker_from_env
from opdcache.inputs.lineage import check_same_tokenizer, model_info
from opdcache.inputs.models import load_tokenizer, resolve_model
from opdcache.inputs.prompts import PromptConfig



@dataclass(frozen=True)
class ScoreJob:
    """A score-teacher job."""

    cache: Path | str
    """A finished rollouts (or sft) cache: a directory or an object-store URL (the teacher's tables are written there)."""
    teacher: Path
    """The teacher: a local model directory or a Hub id (org/name[@rev])."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) when ``teacher`` is a Hub id."""
    stores: tuple[str, ...] = store_registry.ALWAYS
    """Teacher stores (opdcache/stores/): logprob (always), topk, hidden, svd, sampled, entropy, aligned."""
    top_k: int | None = None
    """Width of the teacher's own top-k store. Default: none (required with --store topk)."""
    svd_rank: int | None = None
    """Rank of the svd store. Default: none (required with --store svd)."""
    svd_method: str = "prob-weighted"
    """naive, importance or prob-weighted (papers/002; prob-weighted had less KL than importance at equal rank on
    SmolLM2: BENCHMARKS.md)."""
    hidden_dtype: str | None = None
    """Precision of the hidden store: float32, bfloat16 or float16 (default: the teacher's compute dtype). Narrower
    than the compute dtype, the states are rounded (bfloat16 from a float32 teacher halves the bytes) and the
    rounding's KL to the full distribution is recorded (SmolLM2's: BENCHMARKS.md)."""
    svd_min_positions: int | None = None
    """Refuse to fit the svd projection on fewer calibration positions than this (default: fit on what there is, with
    a warning naming the count, when the rollouts hold fewer than max(32 x rank, 2,048); the positions are drawn from
    all shards)."""
    svd_seed: int = 0
    """Seed of the svd calibration sample (rows drawn over all shards)."""
    svd_dtype: str = "bfloat16"
    """Precision of the stored svd states: bfloat16 (format v3; its rounding is inside the recorded distortion) or
    float32 (v1)."""
    topk_precision: str | None = None
    """Compact top-k: float32, float16 (|error| <= |log-prob| x 2^-11; format v3), or prob14 (probabilities as uint16
    codes to within 2^-15, ids ascending: the smallest, format v4; SmolLM2's figures in BENCHMARKS.md). Default: none
    (and no --topk-mass): the exact v1 store."""
    topk_mass: float | None = None
    """Compact top-k (format v3): keep entries until the teacher mass left out is at most this (at most --top-k), the
    rest kept as one tail column: a smaller mass keeps more entries. What each setting costs and loses on your
    teacher's rollouts: `opdcache plan` (measured figures: BENCHMARKS.md, Storage). Default: none (every entry of
    --top-k)."""
    samples_per_position: int | None = None
    """The sampled store (RS-KD): teacher draws per position (1-255), kept as distinct ids and counts; an unbiased
    forward KL (train --loss sampled-fkl). Costs the head rows of the drawn slices again. Default: none (no sampled
    store)."""
    sample_seed: int = 0
    """Seed of the sampled store's draws (each row's uniforms come from (seed, row id) alone)."""
    prompts: PromptConfig | None = None
    """For a teacher with its own tokenizer: the prompts file the rollouts were built from (with their --prompt-field /
    --messages-field). The teacher renders them with its chat template, scores its own tokenization of pi_ref's text,
    and the table stores its log-prob of each group of tokens both tokenizations cut at the same byte (the aligned
    store; train --loss span or lightning). Default: none (the teacher must share the cache's tokenizer)."""
    slug: str | None = None
    """Teacher table name (default: the teacher directory's name)."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """Which engine runs the teacher."""
    allow_inconsistent_teacher: bool = False
    """Score even when the teacher is not pi_ref's SFT teacher (recorded in the manifest)."""
    num_workers: int | None = None
    """Workers sharing the job."""
    worker_index: int | None = None
    """This worker's index."""
    progress: bool | None = None
    """Show progress bars (default: only on a terminal)."""
    finalize: bool = True
    """Write the manifest when this worker finds every shard present (a Ray driver finalizes itself instead)."""
    prepare_only: bool = False
    """Write the side files (head, fitted svd projection) and the job record, then stop: a distributed driver runs this
    once first, so every worker reads one projection instead of fitting its own."""

    def __post_init__(self) -> None:
        stores = store_registry.enabled(self.stores, self.prompts is not None)
        wrong = store_registry.needing_own_tokenizer(stores) if self.prompts is None else []
        if wrong:
            raise ConfigError(f"--store {wrong[0]} is written for a teacher with its own tokenizer: pass --prompts with the "
                              "prompts file the rollouts were built from")
        object.__setattr__(self, "stores", stores)
        unknown = set(stores) - set(S.TEACHER_STORES)
        if unknown:
            raise ConfigError(f"--store takes {', '.join(S.TEACHER_STORES)}; got {', '.join(sorted(unknown))}")
        store_registry.check_job(self, stores)
        caps = self.engine.capabilities
        if not caps.scores:
            raise ConfigError(f"--backend {self.engine.backend} does not score given tokens; score with another engine")
        for name in stores:  # what the reference engine computes in its stead is not missing (run_score hands it over)
            missing = [n for n in caps.missing(store_registry.REGISTRY[name].needs) if not STATISTICS[n].on_reference]
            if missing:
                raise ConfigError(f"--store {name} needs {describe_statistic(missing[0])}, which --backend "
                                  f"{self.engine.backend} does not compute: score this table with an engine that does "
                                  f"({', '.join(engines_computing(missing))})")
        if self.top_k is not None and caps.max_top_k is not None and self.top_k > caps.max_top_k:
            raise ConfigError(f"--top-k {self.top_k} is more than --backend {self.engine.backend} returns "
                              f"({caps.max_top_k}); lower --top-k")
        if self.slug is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", self.slug):
            raise ConfigError(f"--name must be letters, digits, '.', '_' or '-', got {self.slug!r}")

    @property
    def table_slug(self) -> str:
        """--name, else the teacher directory's name, else the Hub repo's name (org/name@rev -> name)."""
        if self.slug:
            return self.slug
        text = str(self.teacher)
        local = Path(text).expanduser()
        base = local.resolve().name if local.exists() else text.split("@", 1)[0].rstrip("/").rsplit("/", 1)[-1]
        return re.sub(r"[^A-Za-z0-9._-]+", "-", base).strip("-") or "teacher"


def consistency_verdict(cache_lineage: dict, teacher: dict, allow: bool) -> dict:
    """Teacher consistency from lineage (papers/000 section 3.3): is this the teacher pi_ref was fine-tuned on?"""
    sft = cache_lineage.get("sft_teacher")
    if sft is None:
        verdict = "unknown"
        note = ("pi_ref has no recorded SFT teacher; `opdcache check-consistency` measures the per-token gap to this teacher "
                "(against an untrained baseline), and names the consistent teacher once a second one has scored the cache")
    elif sft["fingerprint"] == teacher["fingerprint"]:
        verdict, note = "consistent", "the scoring teacher is pi_ref's SFT teacher"
    else:
        verdict = "inconsistent"
        note = f"pi_ref was fine-tuned on {sft['name_or_path']} ({sft['fingerprint'][:12]}), not on this teacher"
        if not allow:
            raise ConsistencyError(
                f"teacher {teacher['name_or_path']} ({teacher['fingerprint'][:12]}) is not pi_ref's SFT teacher: {note}. "
                "Lightning OPD assumes they are the same model (papers/000 section 3.3); pass --allow-inconsistent-teacher "
                "to score anyway (the decision is recorded in the manifest)"
            )
        note += " (allowed by --allow-inconsistent-teacher)"
    return {"verdict": verdict, "note": note, "sft_teacher": sft["fingerprint"] if sft else None,
            "teacher": teacher["fingerprint"], "allowed": verdict != "inconsistent" or allow}


def score_requests(table, draws: int | None = None, seed: int = 0) -> list[ScoreRequest]:
    """One ScoreRequest per row of a rollout (or sft) table, with pi_ref's top-k and MC ids when the table has them,
    and with ``draws``, each row's uniforms for the sampled store (from the seed and the row id)."""
    from opdcache.backends.base import row_uniforms

    response = shards.row_values(table["response_ids"])
    ref = shards.row_values(table["ref_topk_ids"]) if "ref_topk_ids" in table.column_names else None
    mc = shards.row_values(table["mc_ids"]) if "mc_ids" in table.column_names else None
    row_ids = table["id"].to_pylist() if draws else None
    return [ScoreRequest(p, response[i], None if ref is None else ref[i], None if mc is None else mc[i],
                         None if not draws else row_uniforms(seed, row_ids[i], len(response[i]), draws))
            for i, p in enumerate(table["prompt_ids"].to_pylist())]


def teacher_columns(params: S.StoreParams) -> list[str]:
    """The rollout columns a teacher pass over a table with these store parameters reads."""
    return ["id", "prompt_ids", "response_ids"] + (["ref_topk_ids"] if params.ref_top_k else []) + (["mc_ids"] if params.mc_samples else [])


def teacher_records(ids: list[str], scores, params: S.StoreParams, prepared: dict | None = None, where: str = "",
                    vocab_size: int | None = None) -> shards.Records:
    """A teacher table's rows from the engine's scores of the rollout rows ``ids`` (row-aligned); refuses non-finite
    values. Each store encodes its columns (``Store.encode``, ``pack``; a shard encoder such as the compact top-k's
    writes what it measured into the footer). With
    ``vocab_size`` and an engine that streams the full distribution, the stores' error against it (opdcache/format/fidelity.py)
    goes into the footer too. ``prepared``: the stores as their ``prepare`` returned them for this job, by name."""
    from opdcache.format import fidelity

    enabled = [(prepared or {}).get(name) or store_registry.REGISTRY[name] for name in params.stores]
    encoders = {store.name: e for store in enabled if (e := store.shard_encoder(params)) is not None}
    records, errors = shards.Records(), []
    for row_id, sc in zip(ids, scores):
        rec = {"id": row_id}
        for store in enabled:
            if store.encode is not None:
                rec.update(store.encode(sc, params))
        reason = shards.first_non_finite(rec)  # on the exact values, before any padding
        if reason:
            raise SchemaError(f"teacher produced {reason} for rollout row {row_id} ({where}); "
                              "nothing was written for this shard. Check the teacher's dtype (try --dtype float32)")
        encoded = {}
        for name, encoder in encoders.items():  # the compact top-k, its distortion summed for the footer
            columns, encoded[name] = encoder.pack(sc, rec)
            rec.update(columns)
        if vocab_size:
            errors.append(fidelity.row_sums(sc, params, vocab_size, encoded))
        for store in enabled:
            if store.pack is not None:
                rec.update(store.pack(sc, params, rec))
        records.append(rec)
    for encoder in encoders.values():
        records.meta.update(encoder.footer())
    if vocab_size:
        records.meta[fidelity.META] = fidelity.encode(fidelity.merge(errors))
    return records


def _config_number(model_dir: Path, key: str = "hidden_size") -> int | None:
    """The integer ``key`` (the hidden size, the vocabulary) a model directory's config.json states (a multimodal
    config's text_config), else None."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(cfg, dict):
        return None
    text = cfg.get("text_config")
    size = cfg.get(key, text.get(key) if isinstance(text, dict) else None)
    return size if isinstance(size, int) and not isinstance(size, bool) else None


def _cross_plan(job: ScoreJob, cache: Cache, ref):
    """None for a teacher that shares the cache's tokenizer (refused otherwise, unless ``--prompts`` makes it a
    cross-tokenizer job, opdcache/teacher/crossteacher.py); checked before the teacher's weights load."""
    from opdcache.inputs.fingerprint import tokenizer_fingerprint

    tokenizer = load_tokenizer(ref.path)
    expected = cache.manifest["tokenizer"]["fingerprint"]
    if job.prompts is None:
        check_same_tokenizer(expected, tokenizer, f"teacher {ref.name}", cache.tokenizer(),
                             hint="; to score a teacher with its own tokenizer, pass --prompts with the prompts file the "
                                  "rollouts were built from")
        return None
    fingerprint = tokenizer_fingerprint(tokenizer)
    if fingerprint == expected:
        raise ConfigError(f"--prompts is for a teacher with its own tokenizer; teacher {ref.name} shares the cache's: "
                          "drop --prompts")
    from opdcache.teacher import crossteacher

    return crossteacher.prepare(cache, job.prompts, tokenizer, ref.name, fingerprint)


BATCHING_META = b"opdcache.batching"
"""A teacher shard's footer key: the engine's batching that decided its last bits (its ``batching()``), when it has one."""


def teacher_table_config(info: dict, engine: EngineConfig, backend, enabled=(), job=None) -> dict:
    """What a teacher table's config fingerprint covers: the teacher (``info``: its model record), the engine's
    settings that change numbers and its version, the vocabulary, every store's default entries and the enabled
    stores' own settings (``enabled``: their specs, read from ``job``)."""
    config = {"teacher": info["fingerprint"], "engine": engine.fingerprint_view() | {"engine_version": backend.version},
              "deterministic": engine.deterministic, "vocab_size": backend.vocab_size}
    for store in store_registry.REGISTRY.values():
        config.update(store.config_default)
    for store in enabled:
        config.update(store.config(job))
    return config


def run_score(job: ScoreJob) -> dict:
    """Run (or resume) score-teacher; return the verdict and what was written."""
    cache = Cache(job.cache)
    base = cache.base_table
    base_entry = cache.table(base)
    base_params = cache.params(base)
    num_workers, worker_index = worker_from_env(job.num_workers, job.worker_index)
    enabled = [store_registry.REGISTRY[name] for name in job.stores]
    facts = {"positions": sum(int(sh["tokens"]) for sh in base_entry["shards"]), "base": base}
    for store in enabled:  # from the manifest, before the teacher is even looked for
        store.check_model(job, facts)
    ref = resolve_model(job.teacher, job.revision, "--teacher")
    for store in enabled:  # from config.json, before the model loads; a config without it is checked once it has
        store.check_model(job, {"hidden_size": _config_number(ref.path), "where": "config.json"})
    plan = _cross_plan(job, cache, ref)
    teacher_fp_info = model_info(ref)
    verdict = consistency_verdict(cache.manifest["lineage"], teacher_fp_info, job.allow_inconsistent_teacher)
    want_hidden = store_registry.needing_hidden([store.name for store in enabled])  # score()'s hidden argument
    handed = {name: [n for n in store_registry.REGISTRY[name].needs if STATISTICS[n].on_reference] for name in job.stores}
    handed = {name: needs for name, needs in handed.items() if needs}
    engine = job.engine
    if handed:
        plural = len(handed) > 1
        engine, note = engine.with_statistics(sorted({n for needs in handed.values() for n in needs}),
                                              f"the {'/'.join(handed)} store{'s are' if plural else ' is'} scored")
        if note:
            print(note)
    limit = engine.capabilities.candidate_logprobs_vocab
    vocab = _config_number(ref.path, "vocab_size")
    candidates = not plan and (base_params.ref_top_k or base_params.mc_samples)
    if candidates and limit is not None and vocab is not None and vocab > limit:
        raise ConfigError(f"the {base} table holds pi_ref's top-k or MC ids, whose teacher log-probs --backend "
                          f"{engine.backend} returns only up to a vocabulary of {limit:,} (this teacher's: {vocab:,}); "
                          "score this cache with the default engine")
    backend = make_backend(ref.path, engine, max_logprobs=max(job.top_k or 0, base_params.ref_top_k or 0, 1))
    info = model_info(ref, **backend.model_info())
    engine_facts = {"hidden_size": backend.hidden_size if want_hidden else None, "dtype": backend.dtype if want_hidden else None}
    if want_hidden:  # the head's width (checked against the loaded head when the weights load)
        for store in enabled:
            store.check_model(job, {"hidden_size": backend.hidden_size, "where": "its output head"})
    store_fields = {key: value for store in enabled for key, value in store.params(job, engine_facts).items()}
    params = S.StoreParams(
        stores=job.stores, ref_top_k=None if plan else base_params.ref_top_k, mc_samples=None if plan else base_params.mc_samples,
        topk_precision=job.topk_precision, topk_mass=job.topk_mass, samples_per_position=job.samples_per_position,
        logsumexp=None if "logsumexp" in engine.capabilities.statistics else False,  # a served teacher: no log-partition returned
        **store_fields)
    slug = job.table_slug
    config = teacher_table_config(info, engine, backend, enabled, job)
    if plan is not None:
        config["teacher_tokenizer"] = plan.fingerprint
    table = TableJob(cache.root, f"teachers/{slug}", "teacher", params, config, len(base_entry["shards"]),
                     parent_fingerprint=base_entry["config_fingerprint"], meta={"model": info, "consistency": verdict, "compute": threads.record()})
    if table.pending(num_workers, worker_index):  # work to do: the weights load now, before the job writes anything
        backend.load()
    table.begin()
    prep = Preparation(job, cache, backend, table.dir, table.meta, score_requests)
    prepared = {name: store.prepare(prep) for name in job.stores
                if (store := store_registry.REGISTRY[name]).prepare is not None}  # side files, fits: before any row
    if job.prepare_only:  # the side files and the job record exist now: workers started after this share them
        backend.close()
        return {"slug": slug, "written": [], "finished": False, "consistency": verdict} | {name: table.meta.get(name) for name in job.stores}
    base_paths = cache.shard_paths(base)
    request_columns = teacher_columns(params)

    def make_shard(index: int) -> list[dict]:
        if plan is not None:  # a teacher with its own tokenizer (opdcache/teacher/crossteacher.py)
            from opdcache.teacher import crossteacher

            rows = shards.read_table(base_paths[index], ["id", "prompt_index", "response_ids"])
            aligned, requests = crossteacher.align_rows(plan, rows, backend.max_length)
            scores = backend.score(requests, top_k=params.top_k) if requests else []
            return crossteacher.records(rows["id"].to_pylist(), [len(r) for r in shards.row_values(rows["response_ids"])],
                                        aligned, scores, backend.vocab_size, f"shard {index}", plan.student_of, params.top_k)
        rows = shards.read_table(base_paths[index], request_columns)
        scores = backend.score(score_requests(rows, params.samples_per_position, job.sample_seed), top_k=params.top_k, hidden=want_hidden,
                               hidden_dtype=params.hidden_dtype)
        records = teacher_records(rows["id"].to_pylist(), scores, params, prepared, f"shard {index}", backend.vocab_size)
        batching = getattr(backend, "batching", lambda: None)()
        if batching is not None:  # what audit replays to reproduce this shard's bits
            records.meta[BATCHING_META] = json.dumps(batching, sort_keys=True).encode()
        return records

    with closing(backend):
        written = run_table_job(table, make_shard, num_workers, worker_index, desc=f"score-teacher {slug}", progress=job.progress, finalize=job.finalize,
                                rows_of=lambda i: base_entry["shards"][i]["rows"])
    finished = table.all_done()
    entry = Cache(job.cache).table(f"teachers/{slug}") if finished and job.finalize else {}
    records = {name: entry.get(name, table.meta.get(name)) for name in job.stores}  # what each store's record holds
    return {"slug": slug, "written": written, "finished": finished, "consistency": verdict, "fidelity": entry.get("fidelity")} | records


