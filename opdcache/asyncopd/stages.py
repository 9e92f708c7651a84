"""The three stages of an async run. Each runs alone in its own process (or Ray task) and shares only the cache.

* rollout: batch b <- snapshot v(b) = max(0, b - K) sampling the prompts PromptSchedule deals to batch b;
  memory: the student and its KV cache [batch, prompt + response] per layer, as build-rollouts.
* teacher: scores of batch b <- the teacher over prompt + response of rollout shard b; memory: the teacher, its
  activations of one scoring batch, [positions, chunk] logit blocks (never [tokens, vocabulary]), as score-teacher.
* learner: the offline trainer's loop (opdcache/training/train.py) over batches read from the queue in order, logging each
  batch's staleness and publishing the snapshots the rollout worker waits for; memory: as `opdcache train`.

Each stage resumes where its files end: the rollout and teacher workers write only missing shards (the table jobs of
opdcache/format/cache.py), and the learner resumes from its newest complete checkpoint, truncating the ledger to the batches
that checkpoint has consumed, so no batch is consumed twice or skipped.
"""

from __future__ import annotations

import json
import time
from contextlib import closing

from opdcache import storage
from opdcache.asyncopd import queue as Q
from opdcache.asyncopd.config import AsyncConfig
from opdcache.backends import EngineConfig, make_backend
from opdcache.backends.base import GenerateRequest
from opdcache.errors import InputError, SchemaError
from opdcache.format import schema as S, shards
from opdcache.format.cache import JOB_FILE, TableJob
from opdcache.inputs.fingerprint import tokenizer_fingerprint
from opdcache.inputs.models import load_tokenizer, resolve_model
from opdcache.training.schedule import PromptSchedule

STAGES = ("rollout", "teacher", "learner")


def teacher_slug(cfg: AsyncConfig) -> str:
    from opdcache.teacher.scoring import ScoreJob

    return ScoreJob(cache=cfg.cache_root, teacher=cfg.teacher).table_slug


def table_paths(cfg: AsyncConfig, batch: int):
    """(rollout shard, teacher shard) of ``batch`` in the cache."""
    root = storage.as_path(cfg.cache_root)
    name = shards.shard_name(batch, cfg.learner.steps)
    return root / "rollouts" / name, root / "teachers" / teacher_slug(cfg) / name


def _engine(cfg: AsyncConfig) -> EngineConfig:
    return EngineConfig(device=cfg.device, exact=cfg.learner.exact)


# ---------------------------------------------------------------- rollout


def sample_indices(schedule: PromptSchedule, batch: int) -> list[int]:
    """How many times each prompt of ``batch`` was drawn before (its sample_index), in O(batch size): the schedule is a
    sequence of whole permutations of the prompts, so the prompt at position p of it has been drawn p // N times before
    (once in each earlier permutation). tests/test_async.py checks it against counting every earlier batch."""
    idx, _ = schedule.batch(batch)
    start = batch * schedule.batch_size
    return [(start + j) // schedule.num_prompts for j in range(len(idx))]


def rollout_stage(cfg: AsyncConfig, waiter: Q.Waiter, out=None) -> list[int]:
    """Sample every missing batch with the snapshot its staleness prescribes; return the batches written."""
    from dataclasses import asdict

    from opdcache.inputs.lineage import check_vocab_sizes, model_info, resolve_sft_teacher, undecodable_reason
    from opdcache.inputs.prompts import read_prompts, write_errors
    from opdcache.teacher.rollouts import QUARANTINE_FILE, rollout_record

    ref = resolve_model(cfg.learner.model, what="--model")
    tokenizer = load_tokenizer(ref.path)
    engine = _engine(cfg)
    backend = make_backend(ref.path, engine, max_logprobs=1)
    adapters = cfg.learner.lora_rank > 0
    if adapters:  # a LoRA learner publishes its adapters alone: this copy of the frozen base takes the same ones
        from opdcache.training import lora

        lora.apply(backend.model, cfg.learner)  # every lora_B starts at 0: until a snapshot loads, the base itself
        backend.model.eval()
    decodable = check_vocab_sizes(tokenizer, backend.vocab_size, ref.name)
    prompts = read_prompts(cfg.prompts, tokenizer, backend.max_length - cfg.sampling.max_new_tokens)
    if not prompts.prompts:
        raise InputError(f"no usable prompt in {cfg.prompts.path} ({prompts.summary()}); check --prompts and --prompt-field")
    root = storage.as_path(cfg.cache_root)
    if not storage.folder_complete(root / "tokenizer"):
        storage.save_tokenizer(tokenizer, root / "tokenizer")
    write_errors(root / "rollouts_errors.jsonl", prompts)
    params = S.StoreParams(stores=("base", "task", "version") + (("mc",) if cfg.sampling.mc_samples else ()),
                           mc_samples=cfg.sampling.mc_samples)
    model = model_info(ref, **backend.model_info())
    config = {
        "model": model["fingerprint"], "tokenizer": tokenizer_fingerprint(tokenizer), "prompts": prompts.fingerprint,
        "chat_template_sha256": prompts.chat_template_sha256, "sampling": asdict(cfg.sampling),
        "prompt_settings": {"chat_template": cfg.prompts.chat_template, "system_prompt": cfg.prompts.system_prompt,
                            "chat_template_kwargs": cfg.prompts.chat_template_kwargs},
        "engine": engine.fingerprint_view() | {"engine_version": backend.version}, "vocab_size": backend.vocab_size,
        # which snapshot samples which batch, and which prompts a batch holds: the content of every shard
        "async": {"staleness": cfg.staleness, "steps": cfg.learner.steps, "batch_size": cfg.learner.batch_size, "seed": cfg.learner.seed,
                  "loss": cfg.learner.loss, "lr": cfg.learner.lr, "importance_weights": cfg.learner.importance_weights},
    }
    tok_info = {"fingerprint": config["tokenizer"], "name_or_path": ref.name, "chat_template_sha256": prompts.chat_template_sha256}
    meta = {"tokenizer": tok_info, "lineage": {"sft_teacher": resolve_sft_teacher(ref, None), "parent_fingerprint": None},
            "model": model, "stats": {"prompts": len(prompts.prompts), "malformed": prompts.malformed, "too_long": prompts.too_long}}
    job = TableJob(root, "rollouts", "rollouts", params, config, cfg.learner.steps, meta=meta)
    job.begin()
    schedule = PromptSchedule(len(prompts.prompts), cfg.learner.batch_size, cfg.learner.seed)
    loaded, written = 0, []
    with closing(backend):
        for b in job.pending():
            version = cfg.version_for(b)
            if version != loaded:
                waiter.for_file(Q.snapshot_path(root, version), f"student snapshot v{version}")
                Q.load_snapshot(backend.model, root, version, adapters)
                loaded = version
            start = time.time()
            idx, seeds = schedule.batch(b)
            gens = backend.generate([GenerateRequest(prompts.prompts[i].prompt_ids, seed) for i, seed in zip(idx, seeds)], cfg.sampling)
            records, bad = [], []
            for i, k, g in zip(idx, sample_indices(schedule, b), gens):
                rec = rollout_record("rollouts", prompts.prompts[i], k, g, None) | {"student_version": version}
                reason = shards.first_non_finite(rec) or undecodable_reason(g.response_ids, decodable, backend.vocab_size)
                (bad if reason else records).append(rec if not reason else {"id": rec["id"], "batch": b, "reason": reason})
            if bad:
                storage.append_text(root / "rollouts" / QUARANTINE_FILE, "".join(json.dumps(e) + "\n" for e in bad))
            if not records:
                raise SchemaError(f"every row of batch {b} was quarantined ({bad[0]['reason']}); see rollouts/{QUARANTINE_FILE}")
            job.write_shard(b, records)
            written.append(b)
            if out is not None:
                Q.append_busy(out, "rollout", b, start, time.time())
            if not cfg.keep_snapshots:  # versions only grow with b: no later batch needs an older snapshot
                for old in range(max(1, version - 2), version):
                    path = Q.snapshot_path(root, old)
                    if path.is_file():
                        path.unlink()
    return written


# ---------------------------------------------------------------- teacher


def teacher_stage(cfg: AsyncConfig, waiter: Q.Waiter, out=None) -> list[int]:
    """Score every rollout batch as soon as it lands; return the batches written."""
    from opdcache.inputs.lineage import check_same_tokenizer, model_info
    from opdcache.teacher.scoring import consistency_verdict, score_requests, teacher_columns, teacher_records, teacher_table_config

    root = storage.as_path(cfg.cache_root)
    waiter.for_file(root / "rollouts" / JOB_FILE, "the rollout worker's job record")
    rollouts = TableJob.from_job_file(root, "rollouts")
    ref = resolve_model(cfg.teacher, what="--teacher")
    check_same_tokenizer(rollouts.config["tokenizer"], load_tokenizer(ref.path), f"teacher {ref.name}")
    params = S.StoreParams(stores=cfg.teacher_stores(), top_k=cfg.top_k if cfg.reads_top_k() else None,
                           mc_samples=rollouts.params.mc_samples)
    engine = _engine(cfg)
    backend = make_backend(ref.path, engine, max_logprobs=max(params.top_k or 0, 1))
    info = model_info(ref, **backend.model_info())
    # online OPD needs no teacher consistency (papers/000's assumption is for the offline cache); the verdict is recorded
    verdict = consistency_verdict(rollouts.meta.get("lineage") or {}, info, allow=True)
    config = teacher_table_config(info, engine, backend)  # the stores online OPD scores have no settings of their own
    job = TableJob(root, f"teachers/{teacher_slug(cfg)}", "teacher", params, config, cfg.learner.steps,
                   parent_fingerprint=rollouts.fingerprint, meta={"model": info, "consistency": verdict})
    job.begin()
    written = []
    with closing(backend):
        for b in job.pending():
            waiter.for_file(rollouts.shard_path(b), f"rollout batch {b}")
            start = time.time()
            rows = shards.read_table(rollouts.shard_path(b), teacher_columns(params))
            scores = backend.score(score_requests(rows), top_k=params.top_k)
            job.write_shard(b, teacher_records(rows["id"].to_pylist(), scores, params, None, f"batch {b}"))
            written.append(b)
            if out is not None:
                Q.append_busy(out, "teacher", b, start, time.time())
    return written


# ---------------------------------------------------------------- learner


class QueueSource:
    """The learner's batches: batch b = rollout shard b + teacher shard b, in order, each read once it exists."""

    def __init__(self, cfg: AsyncConfig, waiter: Q.Waiter, out=None):
        self.cfg, self.waiter, self.out = cfg, waiter, out  # out: where busy intervals go (None: not recorded)
        self.busy_since = 0.0
        self.root = storage.as_path(cfg.cache_root)
        self.next = 0  # the batch the next step consumes
        self.current: dict = {}
        self._fingerprints: dict[str, str] = {}  # table: its job's config fingerprint
        self.ledger = cfg.out / Q.LEDGER
        self.rollout_cols = ["prompt_ids", "response_ids", "sampling_logprobs", "ref_logprobs"] + (
            ["mc_ids", "mc_sampling_logprobs"] if "mc" in cfg.rollout_stores() else [])
        self.teacher_cols = ["logprobs"] + (["mc_logprobs"] if "mc" in cfg.rollout_stores() else []) + (
            ["topk_ids", "topk_logprobs"] if cfg.reads_top_k() else [])

    def next_batch(self) -> dict:
        from opdcache.training.data import collate
        from opdcache.training.decoded import DecodedShard

        b = self.next
        rollout, teacher = table_paths(self.cfg, b)
        self.waiter.for_file(teacher, f"the teacher's scores of batch {b}")
        for path in (rollout, teacher):  # a planted shard (another run's, or a stranger's) is never trained on
            self._check_written_by_run(path)
        versions = set(shards.read_table(rollout, ["student_version"])["student_version"].to_pylist())
        if versions != {self.cfg.version_for(b)}:
            raise SchemaError(f"{rollout} was sampled by snapshot(s) {sorted(versions)}, the run's staleness prescribes "
                              f"v{self.cfg.version_for(b)}; the cache belongs to another run")
        shard = DecodedShard(rollout, teacher, self.rollout_cols, self.teacher_cols, where=str(rollout))  # checks the alignment
        batch = collate([shard.row(i) for i in range(len(shard.offsets) - 1)])
        version = self.cfg.version_for(b)
        self.current = {"batch": b, "student_version": version, "staleness": b - version}
        self.next += 1
        self.busy_since = time.time()  # busy from here to the end of the step: the wait above is idle time
        return batch

    def _check_written_by_run(self, path) -> None:
        """``path``'s footer carries the config fingerprint of this run's job for its table (rollouts, or the
        teacher's): what the run's own workers wrote, never a shard put there by something else."""
        from opdcache.format.cache import TableJob
        from opdcache.format.schema import META_CONFIG_FP

        table = "rollouts" if path.parent.name == "rollouts" else f"teachers/{path.parent.name}"
        if table not in self._fingerprints:
            self._fingerprints[table] = TableJob.from_job_file(self.root, table).fingerprint
        fp = (shards.read_schema(storage.confined(self.root, path)).metadata or {}).get(META_CONFIG_FP, b"").decode(errors="replace")
        if fp != self._fingerprints[table]:
            raise SchemaError(f"{path} was not written by this run's {table} job (its config fingerprint {fp[:12]!r} is not "
                              f"the job's {self._fingerprints[table][:12]}...); refusing to train on it. Delete it (the "
                              "run's worker writes it again) or start the run in a new cache")

    def step_stats(self) -> dict:
        return dict(self.current)

    def after_step(self, trainer, record: dict, saved: bool) -> None:
        """Ledger line for the batch just consumed, then the snapshot the rollout worker waits for (after the checkpoint:
        nothing published is ahead of what a resume can reproduce)."""
        entry = {**self.current, "consumed_at_step": trainer.step, "tokens": record.get("tokens"), "time": time.time(),
                 "checkpointed": saved}
        with open(self.ledger, "a") as f:
            f.write(json.dumps(entry) + "\n")
        if self.cfg.needed_snapshot(trainer.step):
            Q.publish_snapshot(trainer.model, self.root, trainer.step, trainer.lora)
        if self.out is not None:
            Q.append_busy(self.out, "learner", self.current["batch"], self.busy_since, time.time())

    def after_resume(self, trainer) -> None:
        """Keep the ledger lines of the batches the checkpoint has consumed (a crash after the checkpoint may have lost
        the last line, one before it left lines the learner will redo), and republish a snapshot a crash lost."""
        self.next = trainer.step
        kept = [e for e in Q.read_jsonl(self.ledger) if e["batch"] < trainer.step]
        if len(kept) != trainer.step and trainer.step:
            missing = sorted(set(range(trainer.step)) - {e["batch"] for e in kept})
            kept += [{"batch": b, "student_version": self.cfg.version_for(b), "staleness": b - self.cfg.version_for(b),
                      "consumed_at_step": b + 1, "tokens": None, "time": None, "checkpointed": True, "recovered": True} for b in missing]
            kept.sort(key=lambda e: e["batch"])
        storage.write_text_atomic(self.ledger, "".join(json.dumps(e) + "\n" for e in kept))
        if self.cfg.needed_snapshot(trainer.step) and not Q.snapshot_path(self.root, trainer.step).is_file():
            Q.publish_snapshot(trainer.model, self.root, trainer.step, trainer.lora)

    def state_dict(self) -> dict:
        return {"next_batch": self.next}

    def load_state_dict(self, state: dict) -> None:
        self.next = int(state["next_batch"])


def learner_stage(cfg: AsyncConfig, waiter: Q.Waiter, out=None) -> dict:
    from opdcache.training.train import Trainer

    return Trainer(cfg.learner, source=QueueSource(cfg, waiter, out)).fit()


def run_stage(name: str, cfg: AsyncConfig, parent_pid: int | None = None) -> object:
    """Run one stage to its end (the entry of a stage process or Ray task)."""
    waiter = Q.Waiter(parent_pid)
    fn = {"rollout": rollout_stage, "teacher": teacher_stage, "learner": learner_stage}[name]
    return fn(cfg, waiter, cfg.out)

