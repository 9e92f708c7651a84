"""A minimal Lightning-OPD trainer over a cache (and the standard-OPD ``online`` baseline).

Each step: forward the student on prompt + response of a cached batch, take its log-probs at the
response tokens (and at the mc / top-k ids) from one fused pass over vocabulary slices (opdcache/training/student.py,
opdcache/logits/logprobs.py), apply the chosen estimator (opdcache/training/losses.py) and corrections, and update with AdamW
(papers/000 Table 6 defaults: lr 2e-6 constant, weight decay 0.1, betas 0.9/0.98). No teacher runs: its
signals come from the cache. ``online=True`` instead samples fresh rollouts from the current student and
scores them with a live teacher every step, with the same estimator and settings.

Logged every step (metrics.jsonl): loss; mean and std of the per-token importance weight
pi_theta/pi_ref = exp(s - r) (papers/000 Fig. 3a); advantage (T - s) mean and std; ``clip_fraction`` (lightning: tokens with |T - s| > tau;
with several teachers the mix's, the teachers' clipped terms weighted as in the loss, and each teacher's own as
``<table>/clip_fraction``, over the tokens routed to it or, when mixed, all of them);
K1 = mean(r - s) and K3 = mean(exp(s - r) - 1 - (s - r)), estimates of KL(pi_ref || pi_theta) from pi_ref's samples.
Online, r is pi_ref's log-prob scored live when ``kl_coef > 0`` (the weight is then pi_theta/pi_ref on the student's own
samples), and the sampler's own log-prob otherwise (weight 1, K1 0 by construction);
``tokens``, response tokens in the step; ``grad_norm``, the total gradient norm before clipping; ``lr``; ``seconds``,
wall-clock since this invocation started. With corrections (l = r_train - r_rollout, r_train the trainer's float32
pi_ref, r_rollout the cached ``ref_logprobs``): ``tis_clip_fraction``, response tokens whose exp(l) exceeded the TIS cap;
``rejected_fraction``, sequences dropped by K1/K3 rejection; ``band_rejected_fraction``, sequences outside the trust band.
With ``kl_coef > 0``: ``kl_penalty``, the chosen estimator's mean (opdcache/training/losses.py; the cached or the online form), added
to the loss times ``kl_coef``. With ``--loss sampled-fkl``: ``sampled_stderr``, the mean per-position standard error of the
forward-KL estimate from the m teacher draws (what the sampled store's few bytes cost in noise). Token statistics are means over response tokens, averaged over micro-batches; sequence fractions are over the batch.
On a CUDA device: ``gpu_peak_allocated_gib``, torch's caching allocator's peak of allocated memory since the run
started, GiB. With ``--eval-every N``, at every N-th step: ``eval/accuracy``, the mean verifier score of the student's
responses to ``--eval-prompts`` (greedy at ``--eval-temperature 0``, else sampled at that temperature from the run's
seed), and ``eval/pass@k`` for k = 1 .. ``--eval-samples`` (opdcache/evaluation/evaluate.py).

Memory: the model, its gradients and AdamW's two moments in float32 (16 bytes per parameter; divided by the
number of processes with ``--fsdp``), activations of one micro-batch [batch, length, hidden] per layer (one layer's
with ``--gradient-checkpointing``), the streamed head's [rows, chunk] float32 logit blocks (64 MiB whatever the
tokens) and one [vocabulary, hidden] head gradient: it grows with tokens x hidden, never with tokens x vocabulary.
The full-vocabulary losses add two [220, vocabulary] float32 blocks (opdcache/logits/divergence.py's uniform path; 256 MiB
at 151,936). Measured (BENCHMARKS.md, hidden 1,024, 8 layers, float32, CPU): torch's live tensors grow by about 680
KiB a response token (~85 a layer) and by 70 with checkpointing. On a CPU with checkpointing, train fixes glibc's mmap
threshold at 128 KiB (opdcache/training/allocator.py), so that the freed recompute buffers leave the process's RSS, for about
5% more time (under glibc's defaults the RSS grew by 300 KiB a token, the heap keeping them; a ``MALLOC_MMAP_THRESHOLD_``
in the environment is kept instead). No term in length squared (SDPA's memory-efficient attention). Launch several processes with ``torchrun --nproc-per-node N -m
opdcache.cli.main train ...``: DDP by default, FSDP2 with ``--fsdp``.

Checkpoints hold model weights (safetensors), optimizer state (safetensors + JSON), loader position and
RNG state -- no pickle -- and a resumed run reproduces an uninterrupted one exactly (deterministic CPU).
"""

from __future__ import annotations

import contextlib
import json
import math
import time
import torch

from opdcache.backends.quant import apply_scheme
from opdcache.errors import ConfigError, OpdcacheError
from opdcache.inputs.models import check_facts, load_causal_lm, load_tokenizer, model_facts, resolve_model
from opdcache.progress import bar
from opdcache.storage import write_text_atomic
from opdcache.training import checkpoint, lora, losses as L, objective as O
from opdcache.training.allocator import map_large_buffers
from opdcache.training.runfolder import fresh_dir, metrics_lines, open_append, place_dir, writing
from opdcache.training.estimators import ESTIMATORS, group_ends
from opdcache.training.sources import check_teacher_table, open_cache, open_online
from opdcache.training.student import (StudentForward, autocast_dtype, enable_activation_checkpointing, enable_packed_attention, full_tensor,
                                       init_distributed, shard_fsdp)
from opdcache.training.trainconfig import LR_SCHEDULES, TrainConfig, learning_rate, stores_for  # noqa: F401 (the public names live here too)


class TrainingDiverged(OpdcacheError, FloatingPointError):
    """The optimisation produced non-finite numbers from finite inputs."""


class Trainer:
    def __init__(self, cfg: TrainConfig, source=None, announce=None):
        """``announce``: called once every check that needs no weights has passed, right before the student loads (the
        command line prints the teacher's lineage there, so a refused run prints only its error)."""
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        self.cfg = cfg
        torch.manual_seed(cfg.seed)
        if cfg.deterministic:
            torch.use_deterministic_algorithms(True)
        self.ddp, self.rank, self.world, self.device, self.owns_process_group = init_distributed()
        if cfg.max_batch_tokens and self.world > 1:
            raise ConfigError("--max-batch-tokens cuts a batch on one process; with several, lower --batch-size instead")
        self.autocast = autocast_dtype(self._compute_dtype(source), self.device)
        arithmetic = self._exact_arithmetic(source) if cfg.exact else None  # checked before the model loads
        if source is None:
            check_teacher_table(cfg)
        self.model_path = resolve_model(cfg.model).path  # a local directory or a Hub id
        facts = model_facts(self.model_path)
        # the cache's batches and the teacher's unembedding (the full-vocabulary losses), checked against the student's
        # configuration before its weights load: a damaged or mismatched cache is refused in seconds at any model size
        self.source, head = (source, None) if source is not None or cfg.online else open_cache(cfg, facts, self.model_path)
        if announce is not None:
            announce()
        # float32 master weights whatever --dtype says: autocast computes in bfloat16, AdamW updates in float32; a LoRA
        # student's frozen base in its dtype, its adapters in float32 (opdcache/training/lora.py)
        self.lora = cfg.lora_rank > 0
        self.scheme = self._rollout_scheme() if cfg.rollout_aligned else None  # refused before the model loads
        self.model = load_causal_lm(self.model_path, lora.base_dtype(self.device) if self.lora else torch.float32).to(self.device)
        check_facts(self.model, facts, self.model_path)
        if self.lora and self.scheme is not None:  # QaRL with LoRA: the frozen base in the rollouts' scheme, once
            apply_scheme(self.model, self.scheme, "inference")
        self.peft = lora.apply(self.model, cfg) if self.lora else None  # the adapters, float32, outside the scheme
        self.allocator = None
        if cfg.gradient_checkpointing:
            enable_activation_checkpointing(self.model)
            if self.device.type == "cpu":  # else the recomputed buffers stay in glibc's heap (opdcache/training/allocator.py)
                self.allocator = map_large_buffers()
        self.model.train()
        if self.scheme is not None and not self.lora:  # QaRL: the learner computes as the rollout engine did, from float32 masters
            apply_scheme(self.model, self.scheme, "train")
        # --exact: the decoder and head in the exact arithmetic, in the compute dtype (bfloat16 rounds as the engine's did)
        self.exact_dtype = (self.autocast or torch.float32) if cfg.exact else None
        self.ref_forward = None
        if cfg.corrections.active:  # r_train: the trainer-side pi_ref, frozen (in the rollouts' arithmetic when aligned)
            ref = load_causal_lm(self.model_path, torch.float32).to(self.device).eval()
            if self.scheme is not None:
                apply_scheme(ref, self.scheme, "inference")
            if cfg.pack:
                enable_packed_attention(ref)
            self.ref_forward = StudentForward(ref, cfg.chunk, self.exact_dtype, arithmetic)
        if cfg.pack:  # every forward of this run takes packed batches (opdcache/training/packing.py)
            enable_packed_attention(self.model)
        self.forward = StudentForward(self.model, cfg.chunk, self.exact_dtype, arithmetic)
        if cfg.fsdp:
            self.forward = shard_fsdp(self.forward, self.device, self.world)
        elif self.ddp:
            self.forward = torch.nn.parallel.DistributedDataParallel(self.forward)
        trainable = [p for p in self.model.parameters() if p.requires_grad]  # all of them, or a LoRA student's adapters
        self.opt = torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(cfg.beta1, cfg.beta2))
        self.step = 0
        if cfg.online and source is None:  # live rollouts of the student being trained
            self.source, head = open_online(cfg, self.model, self.device)
        # moved to the device in float32 once, not at every step
        self.teacher_w = None if head is None else head.weight.to(self.device, torch.float32)
        self.teacher_b = None if head is None or head.bias is None else head.bias.to(self.device, torch.float32)

    def _rollouts_record(self) -> dict:
        """The manifest's record of the model and arithmetic that computed the cache's rollouts."""
        from opdcache.format.cache import Cache

        return Cache(self.cfg.cache).table("rollouts").get("model") or {}

    def _compute_dtype(self, source) -> str:
        """--dtype, except under --exact on exact rollouts: their recorded dtype (what auto resolves to, on any device),
        since the learner recomputes their bits only in the arithmetic they were sampled in. A source (async's queue)
        brings its arithmetic with it: async passes one --dtype to every stage."""
        cfg = self.cfg
        if not cfg.exact or cfg.cache is None or source is not None:
            return cfg.dtype
        record = self._rollouts_record()
        if not record.get("exact"):
            return cfg.dtype
        recorded = record.get("dtype") if record.get("dtype") in ("float32", "bfloat16") else "float32"
        if cfg.dtype not in ("auto", recorded):
            raise ConfigError(f"--exact: {cfg.cache}'s rollouts were computed in the exact arithmetic in {recorded}, so the "
                              f"learner recomputes them only in {recorded}; pass --dtype {recorded} (or leave --dtype out)")
        return recorded

    def _exact_arithmetic(self, source) -> str:
        """--exact: the arithmetic the cache's exact rollouts were computed in (the learner recomputes their bits only
        in it), else the device's (opdcache/exact/__init__.py). Refused in one line where this device cannot run it."""
        from opdcache.exact import arithmetic_for_device, require

        name = arithmetic_for_device(self.device)
        if self.cfg.cache is not None and source is None:
            name = (self._rollouts_record().get("exact") or {}).get("arithmetic") or name
        require(name, self.device, f"--exact: {self.cfg.cache}'s rollouts", "train with the opdcache version that wrote them")
        return name

    def _rollout_scheme(self):
        """The low-bit scheme the cache's rollouts were computed in (``--rollout-aligned``), from the manifest."""
        from opdcache.backends.quant import aligned_scheme

        return aligned_scheme(self._rollouts_record(), f"{self.cfg.cache}'s rollouts")

    # ------------------------------------------------------------ one step (the objective: opdcache/training/objective.py)

    def loss_and_stats(self, batch: dict) -> tuple[torch.Tensor, dict]:
        cfg = self.cfg
        batch, packed = O.split_packed(batch)
        loaded_BT = batch["response_mask"].to(self.device).bool()  # the tokens the packed logit positions are listed for
        batch = O.prepare_batch(batch, self.device, cfg.cache)
        mask = batch["response_mask"]
        sel = mask.bool()  # within loaded_BT: prepare_batch drops tokens with no teacher signal (a row not aligned)
        B, T = mask.shape
        support = O.support_ids(cfg, batch, sel)
        ids_NK = batch["response_ids"][sel][:, None]  # column 0: the sampled token
        if support is not None:
            ids_NK = torch.cat([ids_NK, support.long().clamp(min=0)], 1)
        full = ESTIMATORS[cfg.loss].full_vocabulary  # fkl, rkl, jsd: computed with the student's forward
        if packed is None:
            inputs, packing = (batch["input_ids"], batch["attention_mask"], batch["logit_positions"], sel), {}
        else:  # the forward on the sequences end to end (no padding); the losses on the same [B, T] numbers
            positions_N = packed["logit_positions"].to(self.device)[sel[loaded_BT]]  # the selected tokens', row-major
            inputs = (packed["input_ids"].to(self.device), None, positions_N, sel)
            packing = {"position_ids_1L": packed["position_ids"].to(self.device), "packed_offsets": tuple(packed["cu_seqlens"].tolist())}
        with torch.autocast(self.device.type, dtype=self.autocast or torch.bfloat16, enabled=self.autocast is not None):
            # without corrections every token's divergence has the same weight in the loss (L.reduce's mean), so the
            # divergence's gradient is computed in its forward (4 head matmuls, not 6; opdcache/logits/divergence.py)
            # the teacher's vectors: hidden states with its head, or an svd store's rank-r z with the projection's decoder
            vectors = batch["teacher_hidden" if "teacher_hidden" in batch else "teacher_svd"][sel] if full else None
            lp_NK, _, div_N = self.forward(*inputs, ids_NK, full, vectors, self.teacher_w, self.teacher_b,
                                           uniform=not cfg.corrections.active, **packing)
        lp_NK = lp_NK.float()
        s = lp_NK.new_zeros(B, T)
        s[sel] = lp_NK[:, 0]  # the student's log-prob of each sampled token, [B, T]
        if cfg.lora_ref:  # pi_ref is the student with its adapters off: its log-probs recomputed, not read from the cache
            batch = {**batch, "ref_logprobs": self._adapters_off_logprobs(inputs, ids_NK[:, :1], packing, sel)}
        terms, st, stats = O.estimator_terms(cfg, batch, s, lp_NK, sel, support, div_N)
        teacher = O.teacher_logprobs(cfg, batch)
        advantage = (teacher - s).detach() if teacher is not None else torch.zeros_like(s)
        ends = group_ends(batch)
        if ends is not None:  # a teacher with its own tokenizer: its advantage is per group
            advantage = (L.span_sums(teacher, ends) - L.span_sums(s, ends)).detach()
        weights = None
        if cfg.corrections.active:
            with torch.no_grad():
                r_train = s.new_zeros(B, T)
                r_train[sel] = self.ref_forward(*inputs, ids_NK[:, :1], **packing)[0][:, 0].float()
            weights, cstats = L.correction_weights(cfg.corrections, s, r_train, batch["ref_logprobs"], advantage, mask)
            stats.update({k: float(v) for k, v in cstats.items()})
        loss = L.reduce(terms, mask, weights)
        if cfg.kl_coef > 0:  # cached: on pi_ref's samples, from the cached ref_logprobs; online: on the student's, pi_ref scored live
            penalty = L.reduce(L.kl_penalty_terms(s, batch["ref_logprobs"], cfg.kl_estimator, "student" if cfg.online else "ref",
                                                  cfg.kl_cap), mask)
            stats["kl_penalty"] = float(penalty.detach())
            loss = loss + cfg.kl_coef * penalty
        stats.update(O.step_stats(batch, s, st, advantage, sel))
        if self.ddp:  # normalise by every rank's tokens: the gradient average over ranks is then the whole batch's gradient
            tokens = mask.sum().float()
            total = tokens.clone()
            torch.distributed.all_reduce(total)
            loss = loss * (tokens * self.world / total.clamp_min(1))
        return loss, stats

    def evaluate(self) -> dict:
        """The student as it is now on --eval-prompts (`opdcache eval`'s figures, through the reference engine around
        the live weights): ``eval/accuracy`` and ``eval/pass@k``."""
        from opdcache.backends import backend_from_model
        from opdcache.backends.base import SamplingConfig
        from opdcache.evaluation.evaluate import EvalJob, evaluate
        from opdcache.inputs.prompts import PromptConfig, read_prompts

        cfg = self.cfg
        if not hasattr(self, "_eval"):
            job = EvalJob(model=self.model_path, prompts=PromptConfig(cfg.eval_prompts), reward=cfg.eval_reward,
                          sampling=SamplingConfig(temperature=cfg.eval_temperature, samples=cfg.eval_samples,
                                                  max_new_tokens=cfg.eval_max_new_tokens, seed=cfg.seed))
            tokenizer = load_tokenizer(self.model_path)
            backend = backend_from_model(self.model)
            self._eval = (job, tokenizer, read_prompts(job.prompts, tokenizer, backend.max_length - cfg.eval_max_new_tokens))
        job, tokenizer, prompts = self._eval
        self.model.eval()
        try:
            report = evaluate(backend_from_model(self.model), tokenizer, job, prompts)
        finally:
            self.model.train()
        return {"eval/accuracy": report["accuracy"], **{f"eval/pass@{k}": v for k, v in report["pass_at"].items()}}

    def _adapters_off_logprobs(self, inputs, ids_N1, packing: dict, sel) -> torch.Tensor:
        """[B, T] log-probs of the sampled tokens by the student with its LoRA adapters disabled (the frozen base, which
        is pi_ref), at the selected tokens; the same forward as the student's, without gradients."""
        with torch.no_grad(), self.peft.disable_adapter(), \
                torch.autocast(self.device.type, dtype=self.autocast or torch.bfloat16, enabled=self.autocast is not None):
            lp = self.forward(*inputs, ids_N1, **packing)[0][:, 0].float()
        r = lp.new_zeros(sel.shape)
        r[sel] = lp
        return r

    def _groups(self, batch: dict):
        """(loss, stats, share) of each group of rows ``--max-batch-tokens`` cuts the batch into, share being its part
        of the batch's response tokens (so the shares' weighted sum is the whole batch's mean); the batch at once
        without it."""
        if not self.cfg.max_batch_tokens:
            yield (*self.loss_and_stats(batch), 1.0)
            return
        from opdcache.training.packing import split_batch

        groups = split_batch(batch, self.cfg.max_batch_tokens)
        counts = [float(g["cu_response"][-1]) if "cu_response" in g else float(g["response_mask"].sum()) for g in groups]
        for group, count in zip(groups, counts):
            yield (*self.loss_and_stats(group), count / max(sum(counts), 1.0))

    def _global_mean(self, value: float) -> float:
        """The mean over ranks of a per-rank number (the logged loss: each rank's share, times the world, averaged)."""
        if not self.ddp:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)  # NCCL reduces device tensors only
        torch.distributed.all_reduce(t)
        return float(t) / self.world

    # ------------------------------------------------------------ checkpoints (opdcache/training/checkpoint.py)

    def save_checkpoint(self) -> dict | None:
        return checkpoint.save(self)

    def maybe_resume(self) -> bool:
        return checkpoint.resume(self)

    # ------------------------------------------------------------ the loop

    def fit(self) -> dict:
        cfg = self.cfg
        cfg.out.mkdir(parents=True, exist_ok=True)
        resumed = self.maybe_resume()
        if hasattr(self.source, "after_resume"):
            self.source.after_resume(self)
        metrics_path = cfg.out / "metrics.jsonl"
        if self.rank == 0:  # rank 0 alone owns the metrics file: another rank rewriting it could truncate what rank 0 appends
            kept = [l for l in metrics_lines(cfg.out) if l["step"] <= self.step] if resumed else []
            write_text_atomic(metrics_path, "".join(json.dumps(l) + "\n" for l in kept))
        tracking = None
        if self.rank == 0:  # the resolved settings beside the metrics, and every tracker besides metrics.jsonl
            from dataclasses import asdict

            from opdcache.training.trackers import Trackers

            settings = json.loads(json.dumps(asdict(cfg), default=str))
            write_text_atomic(cfg.out / "config.json", json.dumps(settings, indent=2, sort_keys=True) + "\n")
            tracking = Trackers(cfg.report_to, cfg.out, settings, cfg.out.name)
        start, done_now, last = time.perf_counter(), 0, {}
        with bar(total=cfg.steps, desc=f"train {cfg.loss}", unit="step", enabled=cfg.progress) as pbar, \
                (open_append(metrics_path) if self.rank == 0 else contextlib.nullcontext()) as mf:
            pbar.update(self.step)
            while self.step < cfg.steps:
                self.opt.zero_grad(set_to_none=True)
                parts = []
                for _ in range(cfg.grad_accum):
                    for loss, stats, share in self._groups(self.source.next_batch()):
                        (loss * share / cfg.grad_accum).backward()
                        parts.append(({"loss": self._global_mean(loss.item()), **stats}, share / cfg.grad_accum))
                agg = O.merge_stats(parts)  # as over the step's tokens at once, however --max-batch-tokens cut them
                grad_norm = full_tensor(torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm))
                if not math.isfinite(float(grad_norm)):
                    raise TrainingDiverged(f"non-finite gradient norm at step {self.step + 1} (the inputs were finite); lower --lr, "
                                           "or try --dtype float32")
                lr = learning_rate(cfg, self.step)
                for group in self.opt.param_groups:
                    group["lr"] = lr
                self.opt.step()
                self.step += 1
                done_now += 1
                last = {"step": self.step, **agg, "grad_norm": float(grad_norm), "lr": lr, "seconds": time.perf_counter() - start}
                if hasattr(self.source, "step_stats"):  # what the source knows of the batch (async: its staleness)
                    last.update(self.source.step_stats())
                if cfg.eval_every and self.step % cfg.eval_every == 0 and self.rank == 0:
                    last.update(self.evaluate())
                if self.device.type == "cuda":  # the allocator's own counter: no device synchronisation
                    last["gpu_peak_allocated_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
                if self.rank == 0:
                    mf.write(json.dumps(last) + "\n")
                    mf.flush()
                    tracking.log(last, self.step)
                pbar.set_postfix(loss=f"{agg['loss']:.4f}")  # before update: a line printed by update shows this step's loss
                pbar.update(1)
                saved = bool(cfg.checkpoint == "full" and cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0)
                if saved:
                    self.save_checkpoint()
                if hasattr(self.source, "after_step"):  # after the checkpoint: what it publishes is never ahead of it
                    self.source.after_step(self, last, saved)
                if cfg.stop_after is not None and done_now >= cfg.stop_after:
                    if tracking is not None:
                        tracking.finish()
                    return {"stopped_at": self.step, "last": last, "resumed": resumed}
        if cfg.checkpoint == "full":
            model_sd = self.save_checkpoint()
        elif cfg.checkpoint == "model":
            model_sd = checkpoint.full_model_state(self)
        if self.rank == 0 and cfg.checkpoint != "none":
            self._save_final(model_sd)
        if tracking is not None:
            tracking.finish()
        result = {"steps": self.step, "last": last, "resumed": resumed, "seconds": time.perf_counter() - start,
                  "save_dtype": str(self.save_dtype()).replace("torch.", "")}
        if self.allocator:
            result["allocator"] = self.allocator
        if cfg.online:  # wall-clock seconds of this invocation sampling the student, in the live teacher's forward, in pi_ref's (KL)
            result["online_seconds"] = dict(self.source.seconds)
        return result

    def release(self) -> None:
        """Drop the model, its wrappers, the optimizer and the batch source (the trainer cannot step afterwards)."""
        import gc

        self.forward = self.model = self.ref_forward = self.opt = self.source = None
        gc.collect()

    def save_dtype(self) -> torch.dtype:
        """The final model's dtype (--save-dtype; auto: the compute dtype)."""
        if self.cfg.save_dtype == "auto":
            return self.autocast or torch.float32
        return getattr(torch, self.cfg.save_dtype)

    def _save_final(self, model_sd: dict | None) -> None:
        """The final model, written whole into a fresh folder, then renamed onto ``--out/model``."""
        dtype = self.save_dtype()
        state = None
        if not self.lora:
            state = model_sd if model_sd is not None else self.model.state_dict()
            state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
        tmp = fresh_dir(self.cfg.out, ".model.tmp-")
        with writing(tmp, "the final model"):
            self._write_final(tmp, state, dtype)
        place_dir(tmp, self.cfg.out / "model")

    def _write_final(self, tmp, state, dtype) -> None:
        """The final model's files into ``tmp``: the model (or the LoRA adapter folder), its dtype stated in its
        config, the tokenizer, the SFT lineage."""
        from opdcache.inputs.lineage import read_sft_lineage

        if self.lora:
            base = None if self.scheme is None else (lambda: load_causal_lm(self.model_path, torch.float32))  # not the quantized one
            lora.save_final(self.peft, tmp, "merged" if self.cfg.save == "merged" else "adapter", dtype, base)
        else:
            self.model.save_pretrained(tmp, state_dict=state)
        config_path = tmp / "config.json"  # transformers writes the live model's dtype: state the weights'
        if config_path.is_file():
            config = json.loads(config_path.read_text())
            config["dtype"] = str(dtype).replace("torch.", "")
            config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        load_tokenizer(self.model_path).save_pretrained(tmp)
        lineage = read_sft_lineage(self.model_path)
        if lineage:  # the OPD student keeps its SFT lineage
            (tmp / "opdcache_lineage.json").write_text(json.dumps(lineage, indent=2, sort_keys=True))


def run_train(cfg: TrainConfig, announce=None) -> dict:
    """Train to ``cfg.steps``, resuming from ``cfg.out``'s checkpoint (one of other settings refused before anything
    loads); a run already finished there is reported, and nothing is loaded or written (``already_done``).
    ``announce``: :class:`Trainer`'s, called when the checks have passed, before the student loads."""
    step = checkpoint.prior_run(cfg)
    if step is not None:
        return {"already_done": True, "steps": step}
    trainer = Trainer(cfg, announce=announce)
    try:
        return trainer.fit()
    finally:
        # an undestroyed gloo group can abort the process at exit ("terminate called without an active exception")
        if trainer.owns_process_group and torch.distributed.is_initialized():
            torch.distributed.barrier()  # rank 0 may still be writing the final model
            trainer.release()  # FSDP's state holds its collectives' work and tensors: free them while Python is whole
            torch.distributed.destroy_process_group()
