"""``build-sft`` and ``build-rollouts``: sample responses with log-probs into a sharded cache.

Both are the same stage with a different role for the model: ``build-sft`` samples the *teacher* on SFT
prompts (papers/000 eq. 5; the table is ``sft/``), ``build-rollouts`` samples *pi_ref* on OPD prompts
(papers/000 eq. 7; the table is ``rollouts/`` and carries pi_ref's SFT-teacher lineage).

Prompts are split into ``num_shards`` contiguous blocks; a shard holds every sample of its prompts. Consecutive
shards are decoded together until a generation batch is full (:func:`generation_groups`), and a worker owns whole
groups. Each sample draws from its own random stream, seeded from (seed, prompt ids, sample index), so the tokens
sampled do not depend on worker count, batch size or order; a group is always decoded whole, so a resumed job or
another worker count reproduces every shard bit for bit. Another ``--batch-size`` changes the batch composition,
and with it the last bits of the stored log-probs (float rounding of batched kernels, ~1e-5), so the transformers
engine's batch size is part of the config fingerprint and a resume with another one is refused.

Memory (transformers engine): the model, its KV cache [batch, prompt + response length] per layer, and per decode
step a few [batch, vocabulary] float32 buffers reused across steps; the stored values of one group of shards.
"""

from __future__ import annotations

import hashlib
import json
from contextlib import closing
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from opdcache import storage, threads
from opdcache.backends import EngineConfig, make_backend
from opdcache.backends.base import GenerateRequest, Generation, SamplingConfig
from opdcache.errors import ConfigError
from opdcache.format import schema as S, shards
from opdcache.format.cache import run_table_job, TableJob
from opdcache.format.workers import worker_from_env
from opdcache.inputs import verifiers
from opdcache.inputs.fingerprint import row_id, tokenizer_fingerprint
from opdcache.inputs.lineage import check_vocab_sizes, model_info, resolve_sft_teacher, undecodable_reason
from opdcache.inputs.models import load_tokenizer, resolve_model
from opdcache.inputs.prompts import check_local_prompts, PromptConfig, PromptSet, read_prompts, write_errors

QUARANTINE_FILE = "quarantine.jsonl"
VERIFIER_ERRORS_FILE = "verifier_errors.jsonl"  # rows whose verifier failed (reward left empty), with the reason


@dataclass(frozen=True)
class GenerateJob:
    """A build-sft or build-rollouts job."""

    model: Path
    """The model to sample: the teacher (build-sft) or pi_ref (build-rollouts); a local directory or a Hub id (org/name[@rev])."""
    prompts: PromptConfig
    """Where the prompts come from and how they are read."""
    out: Path | str
    """The cache to write: a local directory or an object-store URL (s3://bucket/prefix, gs://...)."""
    kind: str = "rollouts"
    """sft or rollouts."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """How responses are sampled."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """Which engine runs the model."""
    num_shards: int = 8
    """Shards of the table: the unit of resume and of parallel work (fixed for the life of the cache)."""
    reward: str | None = None
    """Verifier for the `reward` column, where a row has an answer: exact (normalised text equals the answer), math
    (the last \\boxed{} is equivalent to the answer; opdcache[math]), math-fallback (math, else the last number), a
    registered plugin (the demo's addition), or module:function (opdcache/inputs/verifiers.py). Default: none (no reward
    column)."""
    keep: str = "all"
    """build-sft: keep every sample (all) or only those the --reward verifier scores 1.0 (correct: rejection
    sampling)."""
    credit_truncated: bool = False
    """Let the verifier judge responses cut at --max-new-tokens (default: they score 0, whatever they end with)."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) when ``model`` is a Hub id."""
    sft_teacher: Path | None = None
    """build-rollouts: the teacher pi_ref was fine-tuned on (a directory or a Hub id org/name[@revision]), when pi_ref
    has no opdcache lineage file. Default: none (pi_ref's own lineage, if any)."""
    num_workers: int | None = None
    """Workers sharing the job (default from SLURM / torchrun variables, else 1)."""
    worker_index: int | None = None
    """This worker's index."""
    progress: bool | None = None
    """Show progress bars (default: only on a terminal)."""
    finalize: bool = True
    """Write the manifest when this worker finds every shard present (a Ray driver finalizes itself instead)."""

    def __post_init__(self) -> None:
        if self.kind not in ("sft", "rollouts"):
            raise ConfigError(f"kind must be sft or rollouts, got {self.kind!r}")
        if self.kind == "sft" and self.sft_teacher is not None:
            raise ConfigError("--sft-teacher applies to build-rollouts only")
        if self.num_shards < 1:
            raise ConfigError(f"--num-shards must be at least 1, got {self.num_shards}")
        if not self.engine.capabilities.generates:
            raise ConfigError(f"--backend {self.engine.backend} does not generate; build rollouts with another engine")
        self.engine.check_sampling(self.sampling.temperature)
        if self.sampling.mc_samples and not self.engine.capabilities.monte_carlo:
            raise ConfigError(f"--mc-samples draws extra samples at every position, which --backend {self.engine.backend} "
                              "does not; build these rollouts with the default engine")
        if self.reward is not None:
            verifiers.resolve(self.reward)  # an unknown name or an unimportable module:function fails here, before any work
        if self.engine.runs_transformers_models and self.engine.quantize is not None:
            from opdcache.backends.quant import QuantScheme, check_config

            check_config(QuantScheme.parse(self.engine.quantize), self.model)  # from config.json, before the model loads
        if self.keep not in ("all", "correct"):
            raise ConfigError(f"--keep must be all or correct, got {self.keep!r}")
        if self.keep == "correct" and (self.kind != "sft" or self.reward is None):
            raise ConfigError("--keep correct is rejection sampling for build-sft: it needs --reward (a verifier)")


@dataclass
class GenerateResult:
    out: Path
    written: list[int]
    finished: bool
    prompts: PromptSet
    quarantined: int
    rejected: int = 0  # build-sft --keep correct: samples the verifier did not score 1.0 (this invocation's shards)

    def summary(self) -> str:
        state = "cache complete" if self.finished else "shards written; other workers still to finish (then run finalize)"
        rejected = f"; {self.rejected} samples rejected by the verifier (--keep correct)" if self.rejected else ""
        return (f"{self.out}: wrote shards {self.written or 'none (all present)'}; {state}. {self.prompts.summary()}; "
                f"{self.quarantined} rows quarantined{rejected}")


def sample_seed(seed: int, prompt_ids, sample_index: int) -> int:
    h = hashlib.sha256(f"{seed}:{row_id(prompt_ids, sample_index)}".encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


def _store_params(kind: str, s: SamplingConfig) -> S.StoreParams:
    if kind == "sft":
        return S.StoreParams(stores=("base", "task"))
    stores = ["base", "task"] + (["ref_topk"] if s.ref_top_k else []) + (["mc"] if s.mc_samples else [])
    return S.StoreParams(stores=tuple(stores), ref_top_k=s.ref_top_k, mc_samples=s.mc_samples)


def rollout_record(kind: str, prompt, sample_index: int, gen: Generation, reward: float | None) -> dict:
    """One row of a rollouts (or sft) table from a generation: ids, the prompt's fields, the per-token values, the reward."""
    rec = {
        "id": row_id(prompt.prompt_ids, sample_index), "prompt_index": prompt.index, "sample_index": sample_index,
        "prompt_ids": np.asarray(prompt.prompt_ids, dtype=np.int32), "response_ids": gen.response_ids,
        "finish_reason": gen.finish_reason, "sampling_logprobs": gen.sampling_logprobs,
        "answer": prompt.answer, "metadata": prompt.metadata, "reward": reward,
    }
    if kind == "rollouts":
        rec["ref_logprobs"] = gen.ref_logprobs
        if gen.ref_topk_ids is not None:
            rec["ref_topk_ids"], rec["ref_topk_logprobs"] = gen.ref_topk_ids, gen.ref_topk_logprobs
        if gen.mc_ids is not None:
            rec["mc_ids"], rec["mc_sampling_logprobs"] = gen.mc_ids, gen.mc_sampling_logprobs
    return rec


def _append_jsonl(path, entries: list[dict]) -> None:
    storage.append_text(path, "".join(json.dumps(e) + "\n" for e in entries))


def generation_groups(items_per_shard: Sequence[int], batch_size: int) -> list[list[int]]:
    """Consecutive shards decoded together: each group gathers shards until it holds at least ``batch_size`` samples,
    so small shards still fill a generation batch. Groups depend only on the shard sizes and the batch size, never on
    the worker count or on which shards a resumed job still lacks, so every run batches every sample alike."""
    groups: list[list[int]] = []
    count = 0
    for i, n in enumerate(items_per_shard):
        if not groups or count >= batch_size:
            groups.append([])
            count = 0
        groups[-1].append(i)
        count += n
    return groups


def run_generate(job: GenerateJob) -> GenerateResult:
    """Run (or resume) a build-sft / build-rollouts job; the last worker to finish writes the manifest."""
    num_workers, worker_index = worker_from_env(job.num_workers, job.worker_index)
    check_local_prompts(Path(job.prompts.path), must_exist=True)  # before the model: its lookup may be minutes (or the Hub)
    ref = resolve_model(job.model, job.revision, "--model" if job.kind == "rollouts" else "--teacher")
    tokenizer = load_tokenizer(ref.path)
    backend = make_backend(ref.path, job.engine, max_logprobs=max(job.sampling.ref_top_k or 0, 1))
    decodable = check_vocab_sizes(tokenizer, backend.vocab_size, ref.name)
    prompts = read_prompts(job.prompts, tokenizer, backend.max_length - job.sampling.max_new_tokens)
    out = storage.as_path(job.out)
    if not storage.folder_complete(out / "tokenizer"):  # the cache carries its tokenizer: decode and compare without the model
        storage.save_tokenizer(tokenizer, out / "tokenizer")
    model = model_info(ref, **backend.model_info())
    sft_teacher = resolve_sft_teacher(ref, job.sft_teacher) if job.kind == "rollouts" else None
    params = _store_params(job.kind, job.sampling)
    config = {
        "model": model["fingerprint"], "tokenizer": tokenizer_fingerprint(tokenizer), "prompts": prompts.fingerprint,
        "chat_template_sha256": prompts.chat_template_sha256, "sampling": asdict(job.sampling),
        # what decides the prompt ids besides the tokenizer (also covered, row by row, by the prompts fingerprint)
        "prompt_settings": {"chat_template": job.prompts.chat_template, "system_prompt": job.prompts.system_prompt,
                            "chat_template_kwargs": job.prompts.chat_template_kwargs},
        "engine": job.engine.fingerprint_view() | {"engine_version": backend.version}, "vocab_size": backend.vocab_size,
        "sft_teacher": sft_teacher["fingerprint"] if sft_teacher else None, "reward": job.reward, "keep": job.keep,
        **({"credit_truncated": True} if job.credit_truncated else {}),  # absent when off: older caches keep their fingerprint
        # batch composition changes the last bits of batched kernels' outputs (~1e-5): a resume must keep it
        "generate_batch_size": job.engine.generate_batch_size if job.engine.capabilities.batch_size_changes_bits else None,
    }
    tok_info = {"fingerprint": config["tokenizer"], "name_or_path": ref.name, "chat_template_sha256": prompts.chat_template_sha256}
    # the manifest's table stats: prompts kept; samples_drawn = prompts x --samples (rows = samples_drawn - quarantined
    # - those --keep correct rejected); prompt rows skipped as malformed or too long; prompt_tokens over kept prompts,
    # unknown_tokens of them the tokenizer's unknown token; duplicate_rows beyond the first copy of a prompt (kept)
    stats = {"prompts": len(prompts.prompts), "samples_drawn": len(prompts.prompts) * job.sampling.samples, "keep": job.keep,
             "malformed": prompts.malformed, "too_long": prompts.too_long,
             "prompt_tokens": prompts.prompt_tokens, "unknown_tokens": prompts.unknown_tokens,
             "duplicate_rows": sum(len(v) - 1 for v in prompts.duplicates.values())}
    meta = {"tokenizer": tok_info, "lineage": {"sft_teacher": sft_teacher, "parent_fingerprint": None}, "model": model, "stats": stats,
            "compute": threads.record()}  # recorded, not hashed: see opdcache/threads.py
    num_shards = min(job.num_shards, len(prompts.prompts))
    n = len(prompts.prompts)
    bounds = np.linspace(0, n, num_shards + 1).astype(int)
    samples_per_shard = [int(bounds[i + 1] - bounds[i]) * job.sampling.samples for i in range(num_shards)]
    groups = generation_groups(samples_per_shard, job.engine.generate_batch_size)
    table = TableJob(job.out, job.kind, job.kind, params, config, num_shards, meta=meta, groups=groups)
    if table.pending(num_workers, worker_index):  # work to do: the weights load now, before the job writes anything
        backend.load()
    table.begin()  # refuses changed inputs or settings before anything of the existing cache is touched
    write_errors(out / f"{job.kind}_errors.jsonl", prompts)
    group_of = {i: group for group in groups for i in group}
    generated: dict[int, list] = {}  # shard -> its (prompt, sample index, generation), for the rest of the current group
    quarantined = rejected = 0
    verify = verifiers.resolve(job.reward) if job.reward else None

    def items_of(index: int) -> list[tuple]:
        return [(p, k) for p in prompts.prompts[bounds[index]: bounds[index + 1]] for k in range(job.sampling.samples)]

    def make_shard(index: int) -> list[dict]:
        nonlocal quarantined, rejected
        if index not in generated:  # decode the whole group together: one batch spans its shards
            generated.clear()
            members = [(i, items_of(i)) for i in group_of[index]]
            flat = [item for _, items in members for item in items]
            gens = iter(backend.generate([GenerateRequest(p.prompt_ids, sample_seed(job.sampling.seed, p.prompt_ids, k)) for p, k in flat],
                                         job.sampling))
            generated.update({i: [(p, k, next(gens)) for p, k in items] for i, items in members})
        records, bad, failed = [], [], []
        for p, k, g in generated.pop(index):
            reward = None
            if verify is not None and p.answer is not None:
                task = {"answer": p.answer, "metadata": json.loads(p.metadata) if p.metadata else {}, "prompt_index": p.index,
                        "finish_reason": g.finish_reason}
                verdict = verifiers.score(verify, tokenizer.decode(g.response_ids, skip_special_tokens=True), task, job.credit_truncated)
                reward = verdict.score
                if verdict.score is None:
                    failed.append({"id": row_id(p.prompt_ids, k), "prompt_index": p.index, "sample_index": k, "reason": verdict.reason})
            rec = rollout_record(job.kind, p, k, g, reward)
            reason = shards.first_non_finite(rec) or undecodable_reason(g.response_ids, decodable, backend.vocab_size)
            if reason:
                bad.append({"id": rec["id"], "prompt_index": p.index, "sample_index": k, "reason": reason})
            elif job.keep == "all" or reward == 1.0:
                records.append(rec)
            else:
                rejected += 1
        if bad:
            quarantined += len(bad)
            _append_jsonl(out / job.kind / QUARANTINE_FILE, bad)
        if failed:
            _append_jsonl(out / job.kind / VERIFIER_ERRORS_FILE, failed)
        return records

    with closing(backend):
        written = run_table_job(table, make_shard, num_workers, worker_index, desc=f"build-{job.kind}", progress=job.progress, finalize=job.finalize,
                                rows_of=samples_per_shard.__getitem__)
    finished = table.all_done()
    return GenerateResult(job.out, written, finished, prompts, quarantined, rejected)
