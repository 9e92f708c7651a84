"""A minimal Lightning-OPD trainer over a cache (and the standard-OPD ``online`` baseline).

Each step: forward the student on prompt + response of a cached batch, take its log-probs at the
response tokens (and at the mc / top-k ids) from one fused pass over vocabulary slices (opdcache/student.py,
opdcache/logprobs.py), apply the chosen estimator (opdcache/losses.py) and corrections, and update with AdamW
(papers/000 Table 6 defaults: lr 2e-6 constant, weight decay 0.1, betas 0.9/0.98). No teacher runs: its
signals come from the cache. ``online=True`` instead samples fresh rollouts from the current student and
scores them with a live teacher every step, with the same estimator and settings.

Logged every step (metrics.jsonl): loss; mean and std of the per-token importance weight
pi_theta/pi_ref = exp(s - r) (papers/000 Fig. 3a); advantage (T - s) mean and std; ``clip_fraction`` (lightning: tokens with |T - s| > tau);
K1 = mean(r - s) and K3 = mean(exp(s - r) - 1 - (s - r)), estimates of KL(pi_ref || pi_theta) from pi_ref's samples.
Online, r is pi_ref's log-prob scored live when ``kl_coef > 0`` (the weight is then pi_theta/pi_ref on the student's own
samples), and the sampler's own log-prob otherwise (weight 1, K1 0 by construction);
``tokens``, response tokens in the step; ``grad_norm``, the total gradient norm before clipping; ``lr``; ``seconds``,
wall-clock since this invocation started. With corrections (l = r_train - r_rollout, r_train the trainer's float32
pi_ref, r_rollout the cached ``ref_logprobs``): ``tis_clip_fraction``, response tokens whose exp(l) exceeded the TIS cap;
``rejected_fraction``, sequences dropped by K1/K3 rejection; ``band_rejected_fraction``, sequences outside the trust band.
With ``kl_coef > 0``: ``kl_penalty``, the chosen estimator's mean (opdcache/losses.py; the cached or the online form), added
to the loss times ``kl_coef``. With ``--loss sampled-fkl``: ``sampled_stderr``, the mean per-position standard error of the
forward-KL estimate from the m teacher draws (what the sampled store's few bytes cost in noise). Token statistics are means over response tokens, averaged over micro-batches; sequence fractions are over the batch.

Memory: the model, its gradients and AdamW's two moments in float32 (16 bytes per parameter; divided by the
number of processes with ``--fsdp``), activations of one micro-batch [batch, length, hidden] per layer (one layer's
with ``--gradient-checkpointing``), and [response tokens, chunk] float32 logit slices: it grows with tokens x hidden and
tokens x chunk, never with tokens x vocabulary. Launch several processes with ``torchrun --nproc-per-node N -m
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

from opdcache import checkpoint
from opdcache import losses as L
from opdcache.errors import OpdcacheError, SchemaError
from opdcache.errortokens import error_token_mask
from opdcache.models import load_causal_lm, load_tokenizer, resolve_model
from opdcache.progress import bar
from opdcache.quant import apply_scheme
from opdcache.schema import PAD_ID
from opdcache.shards import PADDED
from opdcache.student import StudentForward, autocast_dtype, enable_activation_checkpointing, full_tensor, init_distributed, shard_fsdp
from opdcache.trainconfig import LR_SCHEDULES, TrainConfig, learning_rate, stores_for  # noqa: F401 (the public names live here too)


class TrainingDiverged(OpdcacheError, FloatingPointError):
    """The optimisation produced non-finite numbers from finite inputs."""


PADDED_TEACHER = {"teacher_" + lp: "teacher_" + ids for lp, ids in PADDED.items()}


def _zero_outside_responses(batch: dict) -> dict:
    """Every float [B, T, ...] column set to 0 outside the response mask: what a padded position holds (even a NaN
    from a damaged row's padding) never reaches a loss term or its gradient."""
    keep = batch["response_mask"].bool()
    out = dict(batch)
    for name, v in batch.items():
        if name != "response_mask" and v.is_floating_point() and v.shape[:2] == keep.shape:
            out[name] = torch.where(keep.view(*keep.shape, *[1] * (v.dim() - 2)), v, torch.zeros((), dtype=v.dtype, device=v.device))
    return out


def _masked_mean_std(x: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    n = mask.sum().clamp_min(1)
    mean = (x * mask).sum() / n
    var = (((x - mean) ** 2) * mask).sum() / n
    return float(mean), float(var.sqrt())


class CacheSource:
    """The offline learner's batches: a CacheLoader over a finished cache, epoch after epoch.

    Every batch source of the Trainer has ``next_batch()``, ``state_dict()`` and ``load_state_dict()``; it may also have
    ``after_step(trainer, record)`` (called once a step is checkpointed: the async learner's ledger and snapshots) and
    ``after_resume(trainer)``.
    """

    def __init__(self, config):
        from opdcache.data import CacheLoader

        self.loader = CacheLoader(config)
        self._iter = None

    def next_batch(self) -> dict:
        if self._iter is None:
            self._iter = iter(self.loader)
        try:
            return next(self._iter)
        except StopIteration:
            self._iter = iter(self.loader)
            return next(self._iter)

    def state_dict(self) -> dict:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state)


class Trainer:
    def __init__(self, cfg: TrainConfig, source=None):
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        self.cfg = cfg
        torch.manual_seed(cfg.seed)
        if cfg.deterministic:
            torch.use_deterministic_algorithms(True)
        self.ddp, self.rank, self.world, self.device, self.owns_process_group = init_distributed()
        self.autocast = autocast_dtype(cfg.dtype, self.device)
        # float32 master weights whatever --dtype says: autocast computes in bfloat16, AdamW updates in float32
        self.model_path = resolve_model(cfg.model).path  # a local directory or a Hub id
        self.model = load_causal_lm(self.model_path, torch.float32).to(self.device)
        if cfg.gradient_checkpointing:
            enable_activation_checkpointing(self.model)
        self.model.train()
        self.scheme = self._rollout_scheme() if cfg.rollout_aligned else None
        if self.scheme is not None:  # QaRL: the learner computes as the rollout engine did, from float32 masters
            apply_scheme(self.model, self.scheme, "train")
        # --exact: the decoder and head in the exact arithmetic, in the compute dtype (bfloat16 rounds as the engine's did)
        self.exact_dtype = (self.autocast or torch.float32) if cfg.exact else None
        self.ref_forward = None
        if cfg.corrections.active:  # r_train: the trainer-side pi_ref, frozen (in the rollouts' arithmetic when aligned)
            ref = load_causal_lm(self.model_path, torch.float32).to(self.device).eval()
            if self.scheme is not None:
                apply_scheme(ref, self.scheme, "inference")
            self.ref_forward = StudentForward(ref, cfg.chunk, self.exact_dtype)
        self.forward = StudentForward(self.model, cfg.chunk, self.exact_dtype)
        if cfg.fsdp:
            self.forward = shard_fsdp(self.forward, self.device, self.world)
        elif self.ddp:
            self.forward = torch.nn.parallel.DistributedDataParallel(self.forward)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(cfg.beta1, cfg.beta2))
        self.step = 0
        head = None  # the teacher's unembedding, for the full-vocabulary losses
        if source is not None:  # the async learner's queue (opdcache/asyncopd), or any object with the BatchSource methods
            self.source = source
        elif cfg.online:
            from opdcache.online import OnlineSource

            self.source = OnlineSource(cfg, self.model, self.device)
            if self.source.want_hidden:
                from opdcache.heads import head_of

                head = head_of(self.source.teacher.model)
        else:
            from opdcache.cache import Cache
            from opdcache.data import CacheLoaderConfig

            cache = Cache(cfg.cache)
            self._check_rollout_model(cache)
            table = cache.teacher_table(cfg.teacher)  # the only teacher when not named
            stores, rstores = stores_for(cfg.loss, cfg.topk_support)
            self.source = CacheSource(CacheLoaderConfig(cache=cfg.cache, teacher=table.split("/", 1)[1], stores=stores, rollout_stores=rstores,
                                                        batch_size=cfg.batch_size, seed=cfg.seed, num_workers=cfg.num_loader_workers,
                                                        max_length=getattr(self.model.config, "max_position_embeddings", None),
                                                        vocab_size=int(self.model.get_output_embeddings().weight.shape[0])))
            if "hidden" in stores:
                from opdcache.heads import load_head

                head = load_head(cache.side_file(table, "head.safetensors"))  # hash-checked first, like every shard
        # moved to the device in float32 once, not at every step
        self.teacher_w = None if head is None else head.weight.to(self.device, torch.float32)
        self.teacher_b = None if head is None or head.bias is None else head.bias.to(self.device, torch.float32)

    def _rollout_scheme(self):
        """The low-bit scheme the cache's rollouts were computed in (``--rollout-aligned``), from the manifest."""
        from opdcache.cache import Cache
        from opdcache.quant import aligned_scheme

        return aligned_scheme(Cache(self.cfg.cache).table("rollouts").get("model") or {}, f"{self.cfg.cache}'s rollouts")

    def _check_rollout_model(self, cache) -> None:
        """Lightning OPD trains pi_ref on pi_ref's own rollouts: refuse another --model unless told (the importance
        weights, the KL penalty and the cached ref_logprobs would all describe a different policy)."""
        from opdcache.fingerprint import model_fingerprint

        sampler = (cache.table(cache.base_table).get("model") or {}) if cache.base_table == "rollouts" else {}
        if not sampler.get("fingerprint") or self.cfg.allow_other_model:
            return
        mine = model_fingerprint(self.model_path)
        if mine != sampler["fingerprint"]:
            from opdcache.errors import ConfigError

            raise ConfigError(f"--model {self.cfg.model} (fingerprint {mine[:12]}) is not the model that sampled the cache's rollouts, "
                              f"{sampler.get('name_or_path')} ({sampler['fingerprint'][:12]}); train that model, or pass "
                              "--allow-other-model to train this one on them anyway")

    # ------------------------------------------------------------ one step

    def _support(self, batch: dict, sel: torch.Tensor) -> torch.Tensor | None:
        """[N, K] ids besides the sampled token at which the estimator needs the student's log-probs (mc, topk-*)."""
        cfg = self.cfg
        if cfg.loss == "mc":
            return batch["mc_ids"][sel]
        if cfg.loss.startswith("topk"):
            return (batch["teacher_topk_ids"] if cfg.topk_support == "teacher" else batch["ref_topk_ids"])[sel]
        if cfg.loss == "sampled-fkl":
            return batch["teacher_sampled_ids"][sel]
        return None

    def _check_finite(self, batch: dict) -> None:
        """Refuse a batch whose cached values are NaN or infinite at response positions (a damaged cache), before
        they reach the loss: no estimator may train through them."""
        mask = batch["response_mask"].bool()
        names = [n for n, v in batch.items() if v.is_floating_point() and n != "response_mask"]
        counts = torch.stack([(~torch.isfinite(batch[n][mask] if batch[n].shape[:2] == mask.shape else batch[n])).sum() for n in names])
        for name, bad in zip(names, counts.tolist()):  # one device sync per batch, not one per column
            if bad:
                raise SchemaError(f"the cache holds {bad} non-finite values in {name} at response positions of this batch; "
                                  f"run `opdcache validate {self.cfg.cache}` to find the rows, then rebuild those shards")

    def loss_and_stats(self, batch: dict) -> tuple[torch.Tensor, dict]:
        cfg = self.cfg
        batch = {k: v.to(self.device) for k, v in batch.items()}
        for lp_name, id_name in PADDED_TEACHER.items():  # v3 padding slots (id -1, log-prob -inf): finite, and no mass
            if lp_name in batch:
                batch[lp_name] = batch[lp_name].masked_fill(batch[id_name] == PAD_ID, L.PAD_LOGPROB)
        self._check_finite(batch)
        batch = _zero_outside_responses(batch)
        mask = batch["response_mask"]
        sel = mask.bool()
        B, T = mask.shape
        support = self._support(batch, sel)
        ids_NK = batch["response_ids"][sel][:, None]  # column 0: the sampled token
        if support is not None:
            valid = support != PAD_ID  # [N, K]: False at v3 padding slots
            ids_NK = torch.cat([ids_NK, support.long().clamp(min=0)], 1)
        full = cfg.loss.replace("full-", "") if cfg.loss in L.FULL_VOCABULARY else None
        inputs = (batch["input_ids"], batch["attention_mask"], batch["logit_positions"], sel)
        with torch.autocast(self.device.type, dtype=self.autocast or torch.bfloat16, enabled=self.autocast is not None):
            lp_NK, _, div_N = self.forward(*inputs, ids_NK, full, batch["teacher_hidden"][sel] if full else None, self.teacher_w, self.teacher_b)
        lp_NK = lp_NK.float()
        s = lp_NK.new_zeros(B, T)
        s[sel] = lp_NK[:, 0]  # the student's log-prob of each sampled token, [B, T]
        teacher = batch.get("teacher_logprobs")
        stats: dict = {}
        if cfg.loss == "lightning":
            terms, st = L.lightning_terms(s, teacher, cfg.tau)
            stats["clip_fraction"] = float((st["clipped"] * mask).sum() / mask.sum())
        elif cfg.loss == "is":
            terms, st = L.is_terms(s, batch["sampling_logprobs"], teacher, cfg.importance_weights)
        elif cfg.loss == "ppo":
            terms, st = L.ppo_terms(s, batch["sampling_logprobs"], teacher, batch["ref_logprobs"], cfg.ppo_clip)
            stats["clip_fraction"] = float((st["clipped"] * mask).sum() / mask.sum())
        elif support is not None:
            s_K = lp_NK.new_zeros(B, T, support.shape[1])
            s_K[sel] = lp_NK[:, 1:]  # [B, T, K] at the support ids
            if cfg.loss == "mc":
                terms, st = L.mc_terms(s_K, batch["mc_sampling_logprobs"], batch["teacher_mc_logprobs"], cfg.importance_weights)
            elif cfg.loss == "sampled-fkl":
                terms, st = L.sampled_fkl_terms(s_K, batch["teacher_sampled_logprobs"], batch["teacher_sampled_counts"])
            else:
                t_lp = batch["teacher_topk_logprobs"] if cfg.topk_support == "teacher" else batch["teacher_ref_topk_logprobs"]
                valid_K = torch.ones_like(s_K, dtype=torch.bool)
                valid_K[sel] = valid
                tail = batch.get("teacher_topk_tail") if cfg.topk_support == "teacher" else None
                terms, st = L.topk_terms(s_K, t_lp, cfg.loss.split("-")[1], cfg.tail, valid_K, tail)
        else:
            terms = s.new_zeros(B, T)
            terms[sel] = div_N.float()
            st = {"kl": div_N.detach()}
        advantage = (teacher - s).detach() if teacher is not None else torch.zeros_like(s)
        weights = None
        if cfg.corrections.active:
            with torch.no_grad():
                r_train = s.new_zeros(B, T)
                r_train[sel] = self.ref_forward(*inputs, ids_NK[:, :1])[0][:, 0].float()
            weights, cstats = L.correction_weights(cfg.corrections, s, r_train, batch["ref_logprobs"], advantage, mask)
            stats.update({k: float(v) for k, v in cstats.items()})
        loss = L.reduce(terms, mask, weights)
        if cfg.kl_coef > 0:  # cached: on pi_ref's samples, from the cached ref_logprobs; online: on the student's, pi_ref scored live
            penalty = L.reduce(L.kl_penalty_terms(s, batch["ref_logprobs"], cfg.kl_estimator, "student" if cfg.online else "ref",
                                                  cfg.kl_cap), mask)
            stats["kl_penalty"] = float(penalty.detach())
            loss = loss + cfg.kl_coef * penalty
        if "ref_logprobs" in batch:
            log_ratio = (s - batch["ref_logprobs"]).detach()
            stats["is_weight_mean"], stats["is_weight_std"] = _masked_mean_std(log_ratio.exp(), mask)
            stats["k1"] = float(((-log_ratio) * mask).sum() / mask.sum())
            stats["k3"] = float(((log_ratio.exp() - 1 - log_ratio) * mask).sum() / mask.sum())
        if "stderr" in st:  # the sampled store's per-position standard error of its forward-KL estimate, averaged
            stats["sampled_stderr"] = float((st["stderr"] * mask).sum() / mask.sum().clamp_min(1))
        if "rho" in st:  # the old-to-current ratio pi_theta / pi_old = exp(s - b) on the sampled (or mc) tokens
            stats["rho_mean"], stats["rho_std"] = _masked_mean_std(st["rho"], mask)
            stats["rho_max"] = float(st["rho"][mask.bool()].max()) if mask.any() else 1.0
        if teacher is not None:
            stats["advantage_mean"], stats["advantage_std"] = _masked_mean_std(advantage, mask)
        # papers/004's error tokens, by opdcache/errortokens.py's rule, on the learner's forward: both sides at temperature
        # 1 (the engine's ref_logprobs, as mismatch-report compares them; an sft table has only its sampling log-probs)
        rollout_lp = batch.get("ref_logprobs", batch.get("sampling_logprobs"))
        if rollout_lp is not None:
            stats["error_token_share"] = float((error_token_mask(s.detach(), rollout_lp) & sel).sum() / mask.sum().clamp_min(1))
        stats["tokens"] = int(mask.sum())
        if self.ddp:  # normalise by every rank's tokens: the gradient average over ranks is then the whole batch's gradient
            tokens = mask.sum().float()
            total = tokens.clone()
            torch.distributed.all_reduce(total)
            loss = loss * (tokens * self.world / total.clamp_min(1))
        return loss, stats

    def _global_mean(self, value: float) -> float:
        """The mean over ranks of a per-rank number (the logged loss: each rank's share, times the world, averaged)."""
        if not self.ddp:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)  # NCCL reduces device tensors only
        torch.distributed.all_reduce(t)
        return float(t) / self.world

    # ------------------------------------------------------------ checkpoints (opdcache/checkpoint.py)

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
            kept = [l for l in metrics_path.read_text().splitlines() if json.loads(l)["step"] <= self.step] if metrics_path.exists() and resumed else []
            metrics_path.write_text("".join(l + "\n" for l in kept))
        writer = None
        if cfg.tensorboard and self.rank == 0:
            from torch.utils.tensorboard import SummaryWriter

            writer = SummaryWriter(str(cfg.out / "tensorboard"))
        start, done_now, last = time.perf_counter(), 0, {}
        with bar(total=cfg.steps, desc=f"train {cfg.loss}", unit="step", enabled=cfg.progress) as pbar, \
                (open(metrics_path, "a") if self.rank == 0 else contextlib.nullcontext()) as mf:
            pbar.update(self.step)
            while self.step < cfg.steps:
                self.opt.zero_grad(set_to_none=True)
                agg: dict = {}
                for _ in range(cfg.grad_accum):
                    loss, stats = self.loss_and_stats(self.source.next_batch())
                    (loss / cfg.grad_accum).backward()
                    for k, v in {"loss": self._global_mean(loss.item()), **stats}.items():
                        agg[k] = agg.get(k, 0.0) + v / cfg.grad_accum
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
                if self.rank == 0:
                    mf.write(json.dumps(last) + "\n")
                    mf.flush()
                    if writer:
                        for k, v in last.items():
                            writer.add_scalar(k, v, self.step)
                pbar.set_postfix(loss=f"{agg['loss']:.4f}")  # before update: a line printed by update shows this step's loss
                pbar.update(1)
                saved = bool(cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0)
                if saved:
                    self.save_checkpoint()
                if hasattr(self.source, "after_step"):  # after the checkpoint: what it publishes is never ahead of it
                    self.source.after_step(self, last, saved)
                if cfg.stop_after is not None and done_now >= cfg.stop_after:
                    return {"stopped_at": self.step, "last": last, "resumed": resumed}
        model_sd = self.save_checkpoint()
        if self.rank == 0:
            self._save_final(model_sd)
        if writer:
            writer.close()
        result = {"steps": self.step, "last": last, "resumed": resumed, "seconds": time.perf_counter() - start}
        if cfg.online:  # wall-clock seconds of this invocation sampling the student, in the live teacher's forward, in pi_ref's (KL)
            result["online_seconds"] = dict(self.source.seconds)
        return result

    def release(self) -> None:
        """Drop the model, its wrappers, the optimizer and the batch source (the trainer cannot step afterwards)."""
        import gc

        self.forward = self.model = self.ref_forward = self.opt = self.source = None
        gc.collect()

    def _save_final(self, model_sd: dict | None) -> None:
        self.model.save_pretrained(self.cfg.out / "model", state_dict=model_sd)
        load_tokenizer(self.model_path).save_pretrained(self.cfg.out / "model")
        from opdcache.lineage import read_sft_lineage
        from opdcache.storage import write_text_atomic

        lineage = read_sft_lineage(self.model_path)
        if lineage:  # the OPD student keeps its SFT lineage
            write_text_atomic(self.cfg.out / "model" / "opdcache_lineage.json", json.dumps(lineage, indent=2, sort_keys=True))


def run_train(cfg: TrainConfig) -> dict:
    trainer = Trainer(cfg)
    try:
        return trainer.fit()
    finally:
        # an undestroyed gloo group can abort the process at exit ("terminate called without an active exception")
        if trainer.owns_process_group and torch.distributed.is_initialized():
            torch.distributed.barrier()  # rank 0 may still be writing the final model
            trainer.release()  # FSDP's state holds its collectives' work and tensors: free them while Python is whole
            torch.distributed.destroy_process_group()
