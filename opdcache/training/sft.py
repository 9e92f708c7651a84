"""Supervised fine-tuning on (prompt ids, response ids) pairs: the minimal SFT stage of the pipeline.

The loss is the mean token cross-entropy over response tokens only (papers/000 eq. 6). Used to train
the demo teacher on ground-truth traces and, by ``opdcache sft``, to turn a base student into pi_ref on
teacher trajectories.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class SFTConfig:
    """Settings of a supervised fine-tuning run."""

    steps: int = 500
    """Optimizer steps."""
    batch_size: int = 64
    """Sequences per step."""
    lr: float = 3e-3
    """Peak AdamW learning rate (linear warm-up, cosine decay to 10%)."""
    warmup: int = 20
    """Warm-up steps."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    seed: int = 0
    """Seed of the batch order and dropout."""
    label_smoothing: float = 0.0
    """Mix the target with the uniform distribution over the vocabulary: loss (1 - e) CE(target) + e CE(uniform),
    CE(uniform) = log-partition - mean logit (exact, without [tokens, vocabulary] logits). A model trained with it keeps
    every token's log-prob above about log(e / V) instead of driving wrong tokens toward -inf."""

    def __post_init__(self) -> None:
        from opdcache.errors import ConfigError

        if self.steps < 1:
            raise ConfigError(f"--steps must be at least 1, got {self.steps}")
        if self.batch_size < 1:
            raise ConfigError(f"--batch-size must be at least 1, got {self.batch_size}")
        if not self.lr > 0:
            raise ConfigError(f"--lr must be positive, got {self.lr}")
        if not 0 <= self.label_smoothing < 1:
            raise ConfigError(f"--label-smoothing must be in [0, 1), got {self.label_smoothing}")


def collate_pairs(pairs: Sequence[tuple[Sequence[int], Sequence[int]]], pad_id: int):
    """Right-padded input ids [B, L], attention mask [B, L] and labels [B, L] (-100 outside responses)."""
    import torch

    length = max(len(p) + len(r) for p, r in pairs)
    input_ids = torch.full((len(pairs), length), pad_id, dtype=torch.long)
    labels = torch.full((len(pairs), length), -100, dtype=torch.long)
    mask = torch.zeros((len(pairs), length), dtype=torch.long)
    for i, (p, r) in enumerate(pairs):
        seq = np.concatenate([np.asarray(p, dtype=np.int64), np.asarray(r, dtype=np.int64)])
        input_ids[i, : len(seq)] = torch.from_numpy(seq)
        mask[i, : len(seq)] = 1
        labels[i, len(p): len(seq)] = torch.from_numpy(np.asarray(r, dtype=np.int64))
    return input_ids, mask, labels


def train_sft(model, pairs: Sequence[tuple[Sequence[int], Sequence[int]]], config: SFTConfig, pad_id: int, progress: bool | None = None) -> list[float]:
    """Fine-tune ``model`` in place on ``pairs``; return the loss of every step."""
    import torch

    from opdcache.progress import bar
    from opdcache.training.student import StudentForward

    forward = StudentForward(model, chunk=8192)

    rng = random.Random(config.seed)
    torch.manual_seed(config.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay, betas=(0.9, 0.98))

    def lr_at(step: int) -> float:
        if step < config.warmup:
            return (step + 1) / config.warmup
        t = (step - config.warmup) / max(1, config.steps - config.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    model.train()
    order: list[int] = []
    losses = []
    with bar(total=config.steps, desc="sft", unit="step", enabled=progress) as pbar:
        for step in range(config.steps):
            if len(order) < config.batch_size:
                fresh = list(range(len(pairs)))
                rng.shuffle(fresh)
                order.extend(fresh)
            batch = [pairs[i] for i in order[: config.batch_size]]
            del order[: config.batch_size]
            input_ids, mask, labels = collate_pairs(batch, pad_id)
            targets = labels[:, 1:]  # position t predicts token t + 1
            select = targets != -100
            positions = torch.arange(targets.shape[1]).expand_as(targets)
            smooth = config.label_smoothing
            logprobs, _, uniform_ce = forward(input_ids, mask, positions, select, targets[select][:, None],
                                              divergence="uniform" if smooth else None)
            loss = -logprobs.mean()  # token-mean cross-entropy, from the fused head pass (no [B, L, V] logits)
            if smooth:
                loss = (1 - smooth) * loss + smooth * uniform_ce.mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            losses.append(loss.item())
            pbar.update(1)
            pbar.set_postfix(loss=f"{losses[-1]:.4f}")
    model.eval()
    return losses


def run_sft(model: Path, data: Path, out: Path, config: SFTConfig, only_correct: bool = False, progress: bool | None = None,
            overwrite: bool = False) -> dict:
    """``opdcache sft``: fine-tune ``model`` on an SFT cache's trajectories; record the SFT teacher as lineage.

    The output directory is a Hugging Face model whose ``opdcache_lineage.json`` names the teacher that
    produced the trajectories, the data's fingerprint and the SFT settings, so ``build-rollouts`` carries teacher
    consistency on. An ``out`` that already holds a model is never replaced without ``overwrite``: when its lineage
    records this base model, this data and these settings, the run is already done and nothing is written.
    """
    import torch
    from opdcache.inputs.models import load_causal_lm, load_tokenizer
    from transformers.utils import logging as hf_logging

    from opdcache.format import shards
    from opdcache.format.cache import Cache
    from opdcache.errors import ConfigError
    from opdcache.inputs.lineage import check_same_tokenizer, model_info, write_sft_lineage
    from opdcache.inputs.models import resolve_model

    hf_logging.disable_progress_bar()
    out = Path(out)
    cache = Cache(data)
    if cache.kind != "sft":
        raise ConfigError(f"--data {data} is a {cache.kind} cache; `opdcache sft` trains on an sft cache from `opdcache build-sft`")
    ref = resolve_model(model)
    tokenizer = load_tokenizer(ref.path)
    check_same_tokenizer(cache.manifest["tokenizer"]["fingerprint"], tokenizer, f"model {model}",
                         cache.tokenizer())
    pairs, skipped = [], 0
    for path in cache.shard_paths("sft"):
        t = shards.read_table(path, ["prompt_ids", "response_ids", "reward"])
        for p, r, reward in zip(t["prompt_ids"].to_pylist(), t["response_ids"].to_pylist(), t["reward"].to_pylist()):
            if only_correct and reward != 1.0:
                skipped += 1
                continue
            pairs.append((p, r))
    if not pairs:
        raise ConfigError(f"no trajectories to train on in {data}" + (" with --only-correct (no row has reward 1)" if only_correct else ""))
    import dataclasses

    settings = {**dataclasses.asdict(config), "only_correct": only_correct}
    base_info, data_fp = model_info(ref), cache.table("sft")["config_fingerprint"]
    if (out / "config.json").is_file() and not overwrite:
        from opdcache.inputs.lineage import LINEAGE_FILE, read_sft_lineage

        done = read_sft_lineage(out)
        if done and done.get("sft_settings") == settings and done.get("sft_data_fingerprint") == data_fp \
                and (done.get("base_model") or {}).get("fingerprint") == base_info["fingerprint"]:
            return {"out": str(out), "pairs": len(pairs), "skipped": skipped, "final_loss": None, "already_done": True,
                    "sft_teacher": done["sft_teacher"]["name_or_path"]}
        why = "was trained with other settings or data" if done else f"has no {LINEAGE_FILE}"
        raise ConfigError(f"--out {out} already holds a model that {why}; pass --overwrite to replace it, or give another --out "
                          "(models trained from it would no longer match their caches)")
    torch.manual_seed(config.seed)
    student = load_causal_lm(ref.path, torch.float32)
    losses = train_sft(student, pairs, config, pad_id=tokenizer.pad_token_id or 0, progress=progress)
    student.save_pretrained(out)
    tokenizer.save_pretrained(out)
    teacher = cache.table("sft")["model"]
    write_sft_lineage(out, teacher, data_fp, base_info, settings)
    return {"out": str(out), "pairs": len(pairs), "skipped": skipped, "final_loss": losses[-1], "sft_teacher": teacher["name_or_path"]}
