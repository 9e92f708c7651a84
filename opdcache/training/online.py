"""The standard-OPD baseline's batch source: fresh rollouts of the current student, scored by a live teacher.

Used by ``opdcache train --online --teacher-model MODEL`` for side-by-side comparison with Lightning OPD
(the same estimator and settings; only where the rollouts and teacher log-probs come from differs).
Prompts are the cache's prompts, drawn in a seeded order.
"""

from __future__ import annotations

import time

import numpy as np

from opdcache.backends.base import GenerateRequest, SamplingConfig, ScoreRequest
from opdcache.backends import EngineConfig, backend_from_model, make_backend
from opdcache.format import shards
from opdcache.format.cache import Cache
from opdcache.inputs.models import resolve_model
from opdcache.training.data import collate
from opdcache.training.estimators import FULL_VOCABULARY
from opdcache.training.schedule import PromptSchedule


class OnlineSource:
    def __init__(self, cfg, model, device):
        cache = Cache(cfg.cache)
        seen, prompts = set(), []
        for path in cache.shard_paths(cache.base_table):
            for p in shards.read_table(path, ["prompt_ids"])["prompt_ids"].to_pylist():
                if tuple(p) not in seen:
                    seen.add(tuple(p))
                    prompts.append(p)
        self.prompts = prompts
        self.cfg = cfg
        self.model = model
        self.student = backend_from_model(model)
        reference = EngineConfig(dtype="float32", device=str(device))  # the reference engine, as the cache was scored
        self.teacher = make_backend(resolve_model(cfg.teacher_model, what="--teacher-model").path, reference)
        self.want_hidden = cfg.loss in FULL_VOCABULARY  # the live teacher's final hidden states
        # with a KL penalty, a frozen pi_ref scores the fresh samples, so ref_logprobs are pi_ref's (as in a cache) and the
        # logged importance weight is pi_theta / pi_ref; without one, ref_logprobs are the sampler's own (weight 1)
        self.ref = make_backend(resolve_model(cfg.model).path, reference) if cfg.kl_coef > 0 else None
        self.schedule = PromptSchedule(len(prompts), cfg.batch_size, cfg.seed)
        self.calls = 0  # batches drawn so far
        self.seconds = {"sampling": 0.0, "teacher": 0.0, "pi_ref": 0.0}  # wall-clock spent in each, over all batches

    def next_batch(self) -> dict:
        idx, seeds = self.schedule.batch(self.calls)
        self.calls += 1
        reqs = [GenerateRequest(self.prompts[i], seed=seed) for i, seed in zip(idx, seeds)]
        was_training = self.model.training
        self.model.eval()
        t0 = time.perf_counter()
        gens = self.student.generate(reqs, SamplingConfig(temperature=self.cfg.temperature, max_new_tokens=self.cfg.max_new_tokens))
        t1 = time.perf_counter()
        self.model.train(was_training)
        scored = [ScoreRequest(r.prompt_ids, g.response_ids) for r, g in zip(reqs, gens)]
        scores = self.teacher.score(scored, hidden=self.want_hidden)
        self.seconds["sampling"] += t1 - t0
        t2 = time.perf_counter()
        self.seconds["teacher"] += t2 - t1
        ref = [g.ref_logprobs for g in gens]
        if self.ref is not None:
            ref = [sc.logprobs for sc in self.ref.score(scored)]
            self.seconds["pi_ref"] += time.perf_counter() - t2
        rows = [{"prompt_ids": np.asarray(r.prompt_ids), "response_ids": g.response_ids, "sampling_logprobs": g.sampling_logprobs,
                 "ref_logprobs": lp, "teacher_logprobs": sc.logprobs} for r, g, sc, lp in zip(reqs, gens, scores, ref)]
        if self.want_hidden:
            for row, sc in zip(rows, scores):
                row["teacher_hidden"] = sc.hidden.float().numpy()
        return collate(rows)  # the hidden states as float32

    def state_dict(self) -> dict:
        return {"batches": self.calls}

    def load_state_dict(self, state: dict) -> None:
        self.calls = int(state.get("batches", 0))  # a resumed run draws the batches an uninterrupted one would
