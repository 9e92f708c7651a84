"""Train with TRL from an opdcache cache: a TRL trainer whose batches come from ``CacheLoader`` and whose loss is one of
opdcache's estimators. No teacher runs: its signals are read from the cache.

    python examples/trl_cache_trainer.py --model MODEL --cache CACHE --out RUN [--loss full-rkl|lightning] [--steps 20]

How it plugs in: TRL's trainers are transformers ``Trainer``s; this one (a subclass of TRL's ``SFTTrainer``, with no
dataset of its own) replaces two methods. ``get_train_dataloader`` returns a ``CacheLoader`` (it shuffles and splits rows over ranks by
itself, and resumes exactly), and ``compute_loss`` runs ``opdcache.training.student.StudentForward`` (the fused head pass:
no [tokens, vocabulary] tensor) and an estimator from ``opdcache.training.losses`` / ``opdcache.logits.divergence``. Everything else
(optimizer, schedule, logging, checkpoints, accelerate, DeepSpeed/FSDP configs) is TRL's and transformers' own.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")  # TRL reports usage to the Hub; keep a training run offline

import torch
from transformers import AutoModelForCausalLM
from trl import SFTConfig, SFTTrainer

from opdcache.format.cache import Cache
from opdcache.stores.head import load_head
from opdcache.training import losses as L
from opdcache.training.data import CacheLoader, CacheLoaderConfig
from opdcache.training.estimators import ESTIMATORS, FULL_VOCABULARY
from opdcache.training.student import StudentForward
from opdcache.training.train import stores_for


class CacheTrainer(SFTTrainer):
    """A TRL trainer over an opdcache cache with one of opdcache's estimators (lightning or a full-vocabulary one)."""

    def __init__(self, model, args: SFTConfig, cache: Path, loss: str = "full-rkl", tau: float = 1.0, teacher: str | None = None):
        if loss != "lightning" and loss not in FULL_VOCABULARY:
            raise ValueError(f"this example supports lightning, {', '.join(FULL_VOCABULARY)}; got {loss!r}")
        table = Cache(cache).teacher_table(teacher)
        stores, rollout_stores = stores_for(loss)
        self.loader = CacheLoader(CacheLoaderConfig(cache=cache, teacher=table.split("/", 1)[1], stores=stores, rollout_stores=rollout_stores,
                                                    batch_size=args.per_device_train_batch_size, seed=args.seed))
        head = load_head(Path(cache) / table / "head.safetensors") if "hidden" in stores else None
        self.teacher_w = None if head is None else head.weight.float()
        self.teacher_b = None if head is None or head.bias is None else head.bias.float()
        self.loss_name, self.tau = loss, tau
        self.forward = StudentForward(model, chunk=8192)
        # SFTTrainer insists on a dataset at construction; the batches come from get_train_dataloader below, so a
        # one-row pre-tokenized placeholder (no tokenization happens) stands in for it
        from datasets import Dataset

        super().__init__(model=model, args=args, train_dataset=Dataset.from_dict({"input_ids": [[0, 1]]}))

    def get_train_dataloader(self):
        return self.loader

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mask = inputs["response_mask"]
        sel = mask.bool()
        full = ESTIMATORS[self.loss_name].full_vocabulary  # fkl, rkl or jsd; None for lightning
        lp, _, div = self.forward(inputs["input_ids"], inputs["attention_mask"], inputs["logit_positions"], sel,
                                  inputs["response_ids"][sel][:, None], full,
                                  inputs["teacher_hidden"][sel].float() if full else None,
                                  None if self.teacher_w is None else self.teacher_w.to(lp_device(model)),
                                  None if self.teacher_b is None else self.teacher_b.to(lp_device(model)))
        terms = lp.new_zeros(mask.shape, dtype=torch.float32)
        if full:
            terms[sel] = div.float()
        else:
            s = lp.new_zeros(mask.shape, dtype=torch.float32)
            s[sel] = lp[:, 0].float()
            terms, _ = L.lightning_terms(s, inputs["teacher_logprobs"], self.tau)
        loss = L.reduce(terms, mask)
        return (loss, {}) if return_outputs else loss


def lp_device(model) -> torch.device:
    return next(model.parameters()).device


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--cache", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--loss", default="full-rkl")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    args = ap.parse_args()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    training = SFTConfig(output_dir=str(args.out), max_steps=args.steps, per_device_train_batch_size=args.batch_size,
                                 learning_rate=args.lr, lr_scheduler_type="constant", logging_steps=1, save_strategy="no",
                                 report_to=[], use_cpu=not torch.cuda.is_available(), seed=0, disable_tqdm=True)
    trainer = CacheTrainer(model, training, args.cache, loss=args.loss)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    (args.out / "losses.json").write_text(json.dumps(losses))
    print(json.dumps({"steps": len(losses), "first": losses[0], "last": losses[-1]}))


if __name__ == "__main__":
    main()
