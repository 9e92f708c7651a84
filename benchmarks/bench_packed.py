"""Train steps on packed batches (``train --pack``) against padded ones (the default), same rows, on the harness.

Two length spreads:

* ``demo``: the demo student's own rollouts of the demo's OPD prompts (4 samples a prompt, up to 96 new tokens; written
  by build-rollouts and score-teacher --store logprob) and the demo student trained on them (the demo's shapes);
* ``spread``: responses of 8 to 512 tokens, log-uniform (most stop early, a few run to the cap, as reasoning rollouts
  do; papers/000 samples up to the cap), 64-token prompts, written with opdcache's writer, trained by a wider
  random-weight Llama (hidden 512, 4 layers, 8 heads, the demo's vocabulary) whose decoder, not its head, is most of
  a step, as at the papers' proportions on a GPU.

Both sides run ``Trainer.fit`` for ``--steps`` Lightning steps (batch ``--batch-size`` rows, float32, no checkpoint
written), each in a fresh process, interleaved over ``--rounds`` rounds after a warm-up; a step's tokens are its response
tokens. The padded side is what train does with --no-pack (and what a trainer without padding-free support does): every
row of a batch padded to its longest; the packed side is train's default. The padding share of the batches is printed beside the figures: packing can gain
at most 1 / (1 - that share) on the decoder's work.

``--exact`` runs both sides in the exact arithmetic (the packed side's values are the padded side's bits).

    python benchmarks/bench_packed.py [--steps 12 --batch-size 16 --rounds 3] [--max-batch-tokens N] [--exact] [--cases spread]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import torch

DEMO = Path(__file__).parent.parent / "opdcache" / "demo" / "weights"


def build(root: Path, prompts: int) -> Path:
    from opdcache.backends.base import SamplingConfig
    from opdcache.demo.task import write_prompts
    from opdcache.inputs.prompts import PromptConfig
    from opdcache.teacher.rollouts import GenerateJob, run_generate
    from opdcache.teacher.scoring import ScoreJob, run_score

    cache = root / "cache"
    path = write_prompts(root / "opd.jsonl", "opd", prompts)
    run_generate(GenerateJob(model=DEMO / "student", prompts=PromptConfig(path), out=cache, num_shards=4, progress=False,
                             sampling=SamplingConfig(temperature=1.0, max_new_tokens=96, samples=4), sft_teacher=DEMO / "teacher"))
    run_score(ScoreJob(cache=cache, teacher=DEMO / "teacher", progress=False))
    return cache


def build_spread(root: Path, rows: int, vocab: int, seed: int = 0) -> Path:
    """A rollouts cache and a logprob teacher table with log-uniform response lengths in [8, 512]."""
    import numpy as np

    from opdcache.format import schema as S
    from opdcache.format.cache import TableJob, finalize_table, run_table_job

    rng = np.random.default_rng(seed)
    cache, shards = root / "spread", 4
    per = rows // shards
    data = {}
    for i in range(shards):
        data[i] = []
        for r in range(per):
            T = int(np.exp(rng.uniform(np.log(8), np.log(512))))
            data[i].append(dict(id=f"{i}-{r}", prompt_index=i * per + r, sample_index=0, prompt_ids=rng.integers(2, vocab, 64).astype(np.int32),
                                response_ids=rng.integers(2, vocab, T).astype(np.int32), finish_reason="stop",
                                sampling_logprobs=-rng.random(T).astype(np.float32), ref_logprobs=-rng.random(T).astype(np.float32)))
    job = TableJob(cache, "rollouts", "rollouts", S.StoreParams(stores=("base",)), {"bench": True}, shards)
    run_table_job(job, lambda i: data[i])
    finalize_table(job, tokenizer={"fingerprint": "0" * 64})
    tjob = TableJob(cache, "teachers/teacher", "teacher", S.StoreParams(stores=("logprob",)), {"bench": True}, shards,
                    parent_fingerprint=job.fingerprint)
    run_table_job(tjob, lambda i: [dict(id=row["id"], logprobs=-rng.random(len(row["response_ids"])).astype(np.float32),
                                        logsumexp=rng.random(len(row["response_ids"])).astype(np.float32)) for row in data[i]])
    finalize_table(tjob, model={"name_or_path": "bench", "fingerprint": "1" * 64})
    return cache


def wide_model(root: Path) -> Path:
    """A random-weight Llama at hidden 512 on the demo student's tokenizer and vocabulary: a copy of the demo student's
    directory with new weights (build-rollouts recorded the demo student, so train runs with --allow-other-model)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out = root / "wide"
    shutil.copytree(DEMO / "student", out)
    cfg = AutoConfig.from_pretrained(out)
    cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers = 512, 1408, 4
    cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.max_position_embeddings = 8, 8, 64, 1024
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    return out


def padding_share(cache: str, batch_size: int) -> float:
    from opdcache.training.data import CacheLoader, CacheLoaderConfig

    real = padded = 0
    for b in CacheLoader(CacheLoaderConfig(cache=cache, teacher="teacher", batch_size=batch_size, seed=0)):
        real += int(b["attention_mask"].sum())
        padded += b["attention_mask"].numel()
    return 1 - real / padded


def setup(cache: str, model: str, steps: int, batch_size: int, pack: bool, out: str, max_batch_tokens: int | None = None,
          exact: bool = False) -> dict:
    from opdcache.training.train import TrainConfig, Trainer

    torch.set_num_threads(2)
    torch.manual_seed(0)
    cfg = TrainConfig(model=Path(model), cache=cache, out=Path(tempfile.mkdtemp(prefix="bench-packed-", dir=out)), steps=steps,
                      batch_size=batch_size, dtype="float32", checkpoint="none", pack=pack, allow_other_model=True, progress=False,
                      max_batch_tokens=max_batch_tokens, exact=exact)
    return {"trainer": Trainer(cfg)}


def run_fit(st: dict) -> dict:
    trainer = st["trainer"]
    trainer.fit()
    lines = (trainer.cfg.out / "metrics.jsonl").read_text().splitlines()
    return {"tokens": sum(json.loads(line)["tokens"] for line in lines)}


def main() -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from harness import Side, compare, report

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--spread-rows", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-batch-tokens", type=int, default=None,
                        help="also time train --pack --max-batch-tokens N on the spread case (its peak memory beside the others)")
    parser.add_argument("--exact", action="store_true", help="both sides with --exact (the exact arithmetic: bit-equal values)")
    parser.add_argument("--cases", default="demo,spread", help="which of the demo and spread cases to run")
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "packed.json")
    args = parser.parse_args()
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        cases = (("demo", str(build(root, args.prompts)), DEMO / "student"),
                 ("spread", str(build_spread(root, args.spread_rows, 64)), wide_model(root)))
        flag = " --exact" if args.exact else ""
        for label, cache, model in cases:
            if label not in args.cases.split(","):
                continue
            share = padding_share(cache, args.batch_size)
            common = {"cache": cache, "model": str(model), "steps": args.steps, "batch_size": args.batch_size, "out": tmp, "exact": args.exact}
            sides = [Side(f"train{flag} (packed, the default)", "run_fit", "setup", common | {"pack": True},
                          note="the rows end to end with position ids; the losses on the same numbers"),
                     Side(f"train --no-pack{flag} (padded)", "run_fit", "setup", common | {"pack": False}, baseline=True,
                          note="every row padded to the batch's longest")]
            if args.max_batch_tokens and label == "spread":
                sides.insert(1, Side(f"train --max-batch-tokens {args.max_batch_tokens} (packed)", "run_fit", "setup",
                                     common | {"pack": True, "max_batch_tokens": args.max_batch_tokens},
                                     note="each batch cut into groups within the token budget, one forward and backward a group"))
            result = compare(f"{args.steps} Lightning steps, batch {args.batch_size}, {label} model; padding {share:.0%} of the "
                             f"padded batches' tokens", sides,
                             __file__, rounds=args.rounds,
                             meta={"command": f"python benchmarks/bench_packed.py --steps {args.steps} --batch-size {args.batch_size} "
                                              f"--rounds {args.rounds}" + (f" --max-batch-tokens {args.max_batch_tokens}"
                                                                           if args.max_batch_tokens else "") + flag
                                              + (f" --cases {args.cases}" if args.cases != "demo,spread" else ""),
                                   "padding_share": share})
            report(result)
            out[label] = result
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
