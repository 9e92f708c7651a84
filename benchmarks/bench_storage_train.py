"""The storage ablation trained on a real teacher: does a smaller store cost what training learns?

Setting (QaRL-style, as README "Your first real model"): SmolLM2-135M-Instruct in full precision is the teacher; the
same model served in w4a16 (group 64, the compressed-tensors grid) is pi_ref and samples the rollouts; training
pulls the w4a16-served policy toward the teacher (``train --rollout-aligned``, float32 masters). The rollouts are
scored once into one teacher table per store, and pi_ref is trained from each with the forward KL that store
supports, every other setting equal (seed, steps, batch, learning rate):

* ``exact-topk128``: ``topk-fkl --topk-tail`` on the exact top-128 (format v1);
* ``prob14-topk128``: the same on the prob14 top-128 at residual mass 1e-4 (format v4);
* ``sampled12``: ``sampled-fkl`` on 12 teacher draws a position (RS-KD; unbiased for the full forward KL);
* ``hidden-bf16``: ``full-fkl`` from hidden states rounded to bfloat16 (the exact full-vocabulary forward KL, up to
  the rounding the table records);
* ``svd512``: ``full-fkl`` from the rank-512 svd store in bfloat16 (the teacher's logits rebuilt from the stored
  vectors and the projection's decoder; the table records the reconstruction's KL on held-out positions).

Each trained student is then measured, in its served precision (w4a16), against the teacher on held-out rollouts
(other prompts, sampled by pi_ref): the mean full-vocabulary KL(teacher || student) per response position, both
distributions at temperature 1, summed in float64, with its standard error over positions, beside pi_ref's before
training. One measurement per store (no two sides timed, so no harness rounds); the train times in the JSON are one
run each, on whatever load the machine had. Each store's bytes per response token are those on disk
(``opdcache info``'s figure). Every command runs as a user would run it (the CLI, one process each).

    python benchmarks/bench_storage_train.py [--steps 16 --batch-size 8 --lr 2e-5]   # ~30 min on 2 cores (finished runs are kept and reused)

Results: benchmarks/results/storage_train.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

SCHEME = "w4a16:g64"
TABLES = {  # teacher table -> score-teacher flags (besides --store logprob)
    "exact-topk128": ["--store", "logprob,topk", "--top-k", "128"],
    "prob14-topk128": ["--store", "logprob,topk", "--top-k", "128", "--topk-precision", "prob14", "--topk-mass", "1e-4"],
    "sampled12": ["--store", "logprob,sampled", "--samples-per-position", "12"],
    "hidden-bf16": ["--store", "logprob,hidden", "--hidden-dtype", "bfloat16"],
    "svd512": ["--store", "logprob,svd", "--svd-rank", "512"],
}
RUNS = {  # run -> (teacher table, train flags, the store whose bytes it reads)
    "exact-topk128": ("exact-topk128", ["--loss", "topk-fkl", "--topk-tail"], "topk"),
    "prob14-topk128": ("prob14-topk128", ["--loss", "topk-fkl", "--topk-tail"], "topk"),
    "sampled12": ("sampled12", ["--loss", "sampled-fkl"], "sampled"),
    "hidden-bf16": ("hidden-bf16", ["--loss", "full-fkl"], "hidden"),
    "svd512": ("svd512", ["--loss", "full-fkl"], "svd"),
}


def cli(*args: str) -> str:
    """One opdcache command in its own process; its output, or the run stops with the command's own message."""
    proc = subprocess.run([sys.executable, "-m", "opdcache.cli.main", *args], capture_output=True, text=True,
                          env={**os.environ, "OPDCACHE_PROGRESS": "0"})
    if proc.returncode != 0:
        raise SystemExit(f"opdcache {' '.join(args[:3])} ... failed ({proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    return proc.stdout


def rollouts(model: Path, prompts: Path, out: Path, samples: int, max_new_tokens: int) -> None:
    if not (out / "opdcache.json").is_file():
        cli("build-rollouts", "--model", str(model), "--prompts", str(prompts), "--messages-field", "messages", "--quantize", SCHEME,
            "--samples", str(samples), "--max-new-tokens", str(max_new_tokens), "--temperature", "1.0", "--num-shards", "4",
            "--out", str(out), "--no-progress")


def served_kl(teacher_dir: Path, student_dir: Path, heldout: Path) -> dict:
    """Mean KL(teacher || student served in SCHEME) per response position on the held-out rollouts, in float64 over the
    full vocabulary (the head in [positions, vocabulary] blocks of one sequence: SmolLM2's 49,152 x ~128)."""
    import torch

    from opdcache.backends.hf import TransformersBackend
    from opdcache.format.cache import Cache
    from opdcache.teacher.frontier import Model
    from opdcache.teacher.scoring import score_requests

    teacher = Model(TransformersBackend(teacher_dir, dtype="float32"), "teacher")
    student = Model(TransformersBackend(student_dir, dtype="float32", quantize=SCHEME), "student")
    cache = Cache(heldout)
    total, sq, n = 0.0, 0.0, 0
    with torch.no_grad():
        for i in range(len(cache.shard_paths("rollouts"))):
            for req in score_requests(cache.read_shard("rollouts", i, ["id", "prompt_ids", "response_ids"])):
                p = teacher.log_probs(teacher.hidden(req)).double()
                q = student.log_probs(student.hidden(req)).double()
                kl = (p.exp() * (p - q)).sum(-1)
                total, sq, n = total + float(kl.sum()), sq + float((kl * kl).sum()), n + kl.numel()
    mean = total / max(n, 1)
    return {"kl_mean": mean, "kl_sem": ((sq / max(n, 1) - mean * mean) / max(n - 1, 1)) ** 0.5, "positions": n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--heldout", type=int, default=24)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--workdir", type=Path, default=Path(os.environ.get("OPDCACHE_BENCH_DATA", Path.home() / ".cache" / "opdcache" / "bench"))
                    / "storage-train")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "storage_train.json")
    args = ap.parse_args()

    from opdcache.demo import real

    start = time.perf_counter()
    W = args.workdir
    W.mkdir(parents=True, exist_ok=True)
    model = real.smollm2()
    train_prompts = real.write_math_prompts(W / "train.jsonl", args.prompts, seed=0)
    heldout_prompts = real.write_math_prompts(W / "heldout.jsonl", args.heldout, seed=1)
    cache, heldout = W / f"cache-{args.prompts}x{args.samples}", W / f"heldout-{args.heldout}"
    rollouts(model, train_prompts, cache, args.samples, args.max_new_tokens)
    rollouts(model, heldout_prompts, heldout, 1, args.max_new_tokens)
    print(f"rollouts ready ({time.perf_counter() - start:.0f} s)", flush=True)
    manifest = json.loads((cache / "opdcache.json").read_text())
    for slug, flags in TABLES.items():
        if f"teachers/{slug}" not in manifest["tables"]:
            cli("score-teacher", str(cache), "--teacher", str(model), "--name", slug, *flags, "--no-progress")
            print(f"scored {slug} ({time.perf_counter() - start:.0f} s)", flush=True)

    from opdcache.format.cache import Cache
    from opdcache.format.info import store_bytes

    c = Cache(cache)
    tokens = sum(s["tokens"] for s in c.table("rollouts")["shards"])
    report = {"command": "python benchmarks/bench_storage_train.py " + " ".join(sys.argv[1:]), "scheme": SCHEME, "teacher": "SmolLM2-135M-Instruct",
              "settings": {k: v for k, v in vars(args).items() if k not in ("workdir", "out")}, "response_tokens": tokens,
              "fidelity": {slug: c.table(f"teachers/{slug}").get("fidelity") for slug in TABLES},
              "pi_ref": served_kl(model, model, heldout), "runs": {}}
    print(f"pi_ref (w4a16) KL(teacher || pi_ref) on held-out: {report['pi_ref']['kl_mean']:.4f} nats a position", flush=True)
    earlier = json.loads(args.out.read_text()).get("runs", {}) if args.out.is_file() else {}
    for name, (table, flags, store) in RUNS.items():
        run = W / f"run-{name}-{args.steps}x{args.batch_size}-lr{args.lr:g}"
        t0 = time.perf_counter()
        if not (run / "model" / "config.json").is_file():
            cli("train", "--model", str(model), "--cache", str(cache), "--teacher", table, *flags, "--rollout-aligned", "--steps", str(args.steps),
                "--batch-size", str(args.batch_size), "--lr", str(args.lr), "--kl-coef", "0",  # as recorded: no penalty
                "--out", str(run), "--no-progress")
            seconds = time.perf_counter() - t0
        else:  # a run kept from an earlier invocation: its train time is the one that invocation recorded
            seconds = earlier.get(name, {}).get("train_seconds")
        metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        result = served_kl(model, run / "model", heldout)
        result.update(bytes_per_token=store_bytes(c, f"teachers/{table}")[store] / tokens, store=store, train_seconds=seconds,
                      loss_first=metrics[0]["loss"], loss_last=metrics[-1]["loss"])
        if "sampled_stderr" in metrics[-1]:
            result["sampled_stderr"] = metrics[-1]["sampled_stderr"]
        report["runs"][name] = result
        print(f"{name:<16} {result['bytes_per_token']:>8.1f} B/token  KL {result['kl_mean']:.4f} +- {result['kl_sem']:.4f}  "
              f"(pi_ref {report['pi_ref']['kl_mean']:.4f}; train {seconds or 0:.0f} s)", flush=True)
    report["seconds"] = time.perf_counter() - start
    print(f"\nheld-out KL(teacher || student in {SCHEME}) per position, {report['pi_ref']['positions']} positions; "
          f"{args.steps} steps x {args.batch_size} sequences at lr {args.lr:g} from each store")
    print(f"{'run':<16} {'store':<8} {'B/token':>9} {'KL':>8} {'+-':>7} {'KL cut':>8}")
    base = report["pi_ref"]["kl_mean"]
    print(f"{'pi_ref':<16} {'':<8} {'':>9} {base:>8.4f} {report['pi_ref']['kl_sem']:>7.4f}")
    for name, r in report["runs"].items():
        print(f"{name:<16} {r['store']:<8} {r['bytes_per_token']:>9.1f} {r['kl_mean']:>8.4f} {r['kl_sem']:>7.4f} {base - r['kl_mean']:>8.4f}")
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.out} ({report['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
