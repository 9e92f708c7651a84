"""Peak memory of every command at a real vocabulary, against response length: nothing may grow with tokens x V.

Builds, in a temporary directory, two random-weight Qwen3-architecture models (vocabulary 151,936, hidden ``--hidden``,
1,024 by default, 2 layers; student and teacher) and a WordLevel tokenizer of 151,936 tokens, then for each response
length R:

* build-rollouts: 16 prompts x 1 sample, exactly R new tokens (temperature 1; a random model almost never ends);
* score-teacher: every store (logprob, topk k=128, hidden, svd rank 128, importance) on that cache;
* validate: the full row-level check (hidden states rebuilt through the head);
* a train step (batch 4, lightning and full-rkl): opdcache's fused path (``Trainer.loss_and_stats``, backward,
  AdamW step) against the plain full-logits path in the same run -- what a competent user writes:
  ``model(..., logits_to_keep=...)`` from the first response position on, a float32 log_softmax over [batch,
  response tokens, vocabulary], the same loss (the teacher's log-probs under ``no_grad``), backward, AdamW step.

Each command runs in its own process, started by a parent that never imports torch. Its peak is the process's
anonymous RSS (``RssAnon`` of /proc/PID/status, sampled by the parent every millisecond: the model, the work and the
allocator's kept memory, not the page cache of the model file that ``ru_maxrss`` also counts; ``ru_maxrss`` is kept in
the JSON beside it). The growth per extra response token is (peak at the longest R - peak at the shortest R) / (extra
response tokens the command holds: 16 x dR for the cache commands, 4 x dR for a train step). Acceptance:
every growth below a quarter of one float32 vocabulary row (151,936 x 4 / 4 = 152 KB), and the fused train step's
peak at least 5x below the full-logits path's at R = 1,024, at no more than 1.3x its time. The full-logits step runs
where it fits this machine's 24 GiB (``PLAIN_MAX``). Run:

    python benchmarks/bench_scale.py [--lengths 256 1024 4096] [--hidden 1024] [--json out.json]
    python benchmarks/bench_scale.py --train-memory --hidden 1024 --layers 8 --lengths 128 512 2048   # train memory vs length
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from harness import PeakAnon, anon_kib  # noqa: E402  (anonymous RSS: not the model file's page cache)

V = 151_936
HIDDEN = 256
PROMPTS = 16
PROMPT_TOKENS = 16
TRAIN_BATCH = 4
PLAIN_MAX = {"lightning": 1024, "full-rkl": 256}
"""Longest response the full-logits train step runs at: it holds several [4, R, V] float32 tensors (R x 2.4 MB each;
full-rkl's teacher distribution and its product terms besides the student's), above the model's 16 bytes a parameter."""
ROW_BUDGET = V * 4 / 4  # a quarter of one float32 vocabulary row, in bytes


def build_models(root: Path, hidden: int | None = None, layers: int = 2) -> tuple[Path, Path]:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(V)}, unk_token="t2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t1", pad_token="t0", unk_token="t2")
    paths = []
    for role, seed in (("student", 0), ("teacher", 1)):
        torch.manual_seed(seed)
        h = hidden or HIDDEN
        cfg = Qwen3Config(vocab_size=V, hidden_size=h, intermediate_size=2 * h, num_hidden_layers=layers, num_attention_heads=max(4, h // 64),
                          num_key_value_heads=max(2, h // 128), head_dim=64, max_position_embeddings=8192, tie_word_embeddings=False,
                          eos_token_id=1, pad_token_id=0, bos_token_id=None)
        model = Qwen3ForCausalLM(cfg)
        model.generation_config.eos_token_id = 1
        path = root / role
        model.save_pretrained(path)
        fast.save_pretrained(path)
        paths.append(path)
    return paths[0], paths[1]


def run_measured(cmd: list[str], env: dict | None = None) -> dict:
    """Run a command; return its wall time, CPU-seconds, peak anonymous RSS (bytes, sampled every millisecond from
    /proc while it runs) and ru_maxrss (bytes: the page cache of files it mapped included)."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=env)
        peak, done = [0], threading.Event()

        def sample():
            while not done.is_set():
                peak[0] = max(peak[0], anon_kib(proc.pid))
                time.sleep(0.001)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        _, status, usage = os.wait4(proc.pid, 0)  # this process's own rusage (ru_maxrss)
        done.set()
        sampler.join()
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0), err.seek(0)
        stdout, stderr = out.read(), err.read()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:4])} ... failed ({proc.returncode}):\n{stderr[-3000:]}")
    return {"seconds": time.perf_counter() - t0, "cpu_seconds": usage.ru_utime + usage.ru_stime, "peak_anon": peak[0] * 1024,
            "peak_rss": usage.ru_maxrss * 1024, "stdout": stdout}


def full_logits_loss(trainer, batch: dict, loss: str):
    """The plain step's loss: the model's logits from the first response position on (``logits_to_keep``, in the
    trainer's autocast), a float32 log_softmax over the response positions [B, T, V], the same lightning, full-rkl or
    full-fkl loss."""
    import torch

    from opdcache.training import losses as L

    b = {k: v.to(trainer.device) for k, v in batch.items()}
    with torch.autocast(trainer.device.type, dtype=torch.bfloat16, enabled=trainer.autocast is not None):
        real = b["response_mask"] > 0
        first = int(b["logit_positions"][real].min())  # logits before it predict no response token
        logits = trainer.model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                               logits_to_keep=b["input_ids"].shape[1] - first).logits
    pos = (b["logit_positions"] - first).clamp(min=0)  # padding positions (0) point anywhere: masked out by the loss
    logp = torch.log_softmax(logits.gather(1, pos[..., None].expand(-1, -1, logits.shape[-1])).float(), -1)  # [B, T, V]
    s = logp.gather(-1, b["response_ids"][..., None]).squeeze(-1)
    if loss == "lightning":
        terms, _ = L.lightning_terms(s, b["teacher_logprobs"], trainer.cfg.tau)
    else:  # the teacher's full distribution under no_grad, as a user of kl_div writes it
        if loss not in ("full-rkl", "full-fkl"):
            raise ValueError(f"the full-logits baseline has no {loss!r} loss")
        with torch.no_grad():
            t_logp = torch.log_softmax(b["teacher_hidden"].float() @ trainer.teacher_w.T, -1)
        terms = ((logp.exp() * (logp - t_logp)) if loss == "full-rkl" else (t_logp.exp() * (t_logp - logp))).sum(-1)
    return L.reduce(terms, b["response_mask"])


def child_train(student: str, cache: str, loss: str, path: str, out: str, batch: str = str(TRAIN_BATCH)) -> None:
    """One train step in this process (nothing before it but loading): print JSON {seconds, fb_seconds, step_peak and
    fb_peak (bytes of anonymous memory above the level before the step, over the whole step and over its forward +
    backward alone), forward_peak (the same over the forward alone), saved (what the forward left resident for the
    backward: the saved activations), tokens (response tokens of the batch), loss}. ``path``: fused, fused+ckpt (activation
    checkpointing) or plain."""
    import torch

    from opdcache.training.train import TrainConfig, Trainer

    torch.manual_seed(0)
    trainer = Trainer(TrainConfig(model=Path(student), cache=Path(cache), out=Path(out), loss=loss, batch_size=int(batch), lr=1e-5, kl_coef=0.0,  # the main loss alone, as the baseline
                                  gradient_checkpointing=path.endswith("+ckpt"), pack=False))  # padded rows, as the baseline's
    batch = trainer.source.next_batch()

    # the step's own memory: peak RSS during it, minus the RSS just before it; and the forward + backward's apart
    # (what grows with length: activations, gradients), since AdamW's first step allocates both moments, a fixed 2x
    # the parameters that can hide the activations at short lengths
    whole = PeakAnon().__enter__()
    fb = PeakAnon().__enter__()
    fwd = PeakAnon().__enter__()
    t0 = time.perf_counter()
    if path.startswith("fused"):
        loss_value, _ = trainer.loss_and_stats(batch)
    else:  # the plain full-logits step
        loss_value = full_logits_loss(trainer, batch, loss)
    fwd.__exit__(None, None, None)
    kept = PeakAnon().__enter__()  # what the forward left for the backward (saved activations), sampled once
    kept.__exit__(None, None, None)
    loss_value.backward()
    fb_seconds = time.perf_counter() - t0
    fb.__exit__(None, None, None)
    trainer.opt.step()
    seconds = time.perf_counter() - t0
    whole.__exit__(None, None, None)
    print(json.dumps({"seconds": seconds, "fb_seconds": fb_seconds, "step_peak": whole.delta, "fb_peak": fb.delta,
                      "forward_peak": fwd.delta, "saved": (kept.peak - fwd.base) * 1024,
                      "tokens": int(batch["response_mask"].sum()), "loss": float(loss_value)}))


def train_memory(args) -> None:
    """The train step's own peak (anonymous memory) at hidden ``--hidden`` against response length,
    with and without activation checkpointing, for lightning and full-fkl; the per-token slope between each pair of
    lengths (a quadratic term shows as a slope that grows with length)."""
    global HIDDEN
    HIDDEN = args.hidden
    root = args.workdir or Path(tempfile.mkdtemp(prefix="bench-train-memory-"))
    root.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, __file__, "_build", str(root), str(args.hidden), str(args.layers)], check=True, capture_output=True)
    student, teacher = root / "student", root / "teacher"
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": " ".join(f"t{3 + (13 * i + 7 * j) % 5000}" for j in range(PROMPT_TOKENS))}) + "\n"
                               for i in range(args.batch)))
    env = {**os.environ, "OPDCACHE_PROGRESS": "0"}
    cli = [sys.executable, "-m", "opdcache.cli.main"]
    rows = {}
    for R in args.lengths:
        cache = root / f"cache-{R}"
        if not (cache / "opdcache.json").is_file() or "teachers/teacher" not in (cache / "opdcache.json").read_text():
            run_measured(cli + ["build-rollouts", "--model", str(student), "--prompts", str(prompts), "--out", str(cache), "--max-new-tokens",
                                str(R), "--temperature", "1.0", "--no-chat-template", "--num-shards", "1", "--batch-size", str(args.batch),
                                "--no-progress"], env)
            run_measured(cli + ["score-teacher", str(cache), "--teacher", str(teacher), "--store", "logprob,hidden", "--no-progress"], env)
        for loss in ("lightning", "full-fkl"):
            for path in ("fused", "fused+ckpt"):
                m = run_measured([sys.executable, __file__, "_train", str(student), str(cache), loss, path, str(root / f"run-{R}-{loss}-{path}"),
                                  str(args.batch)], env)
                m.update(json.loads(m.pop("stdout").strip().splitlines()[-1]))
                rows.setdefault(f"{loss} {path}", {})[R] = m
                print(f"R={R} {loss} {path}: forward+backward peak {m['fb_peak'] / 2**20:.0f} MiB, step peak {m['step_peak'] / 2**20:.0f} MiB, "
                      f"{m['tokens']} tokens, {m['seconds']:.1f} s", flush=True)
    Rs = sorted(args.lengths)
    measures = {"fb_peak": "the forward + backward's own peak (AdamW's step apart)",
                "forward_peak": "the forward's own peak",
                "saved": "what the forward leaves resident for the backward (saved activations)"}
    summary = {}
    for key, what in measures.items():
        if not all(key in m for by_r in rows.values() for m in by_r.values()):
            continue  # rows reused from a run before the measure existed
        print(f"\n{what}: anonymous MiB at hidden {args.hidden}, {args.layers} layers, vocabulary {V:,}, batch {args.batch}, and its "
              "slope per response token (KiB) between lengths")
        print(f"{'step':<22}" + "".join(f"{f'R={R}':>9}" for R in Rs) + "".join(f"{f'{a}->{b}':>12}" for a, b in zip(Rs, Rs[1:])))
        for name, by_r in rows.items():
            slopes = [(by_r[b][key] - by_r[a][key]) / (by_r[b]["tokens"] - by_r[a]["tokens"]) / 1024 for a, b in zip(Rs, Rs[1:])]
            summary.setdefault(name, {})[key] = {"mib": {R: by_r[R][key] / 2**20 for R in Rs}, "slope_kib_per_token": slopes}
            print(f"{name:<22}" + "".join(f"{by_r[R][key] / 2**20:>9.0f}" for R in Rs) + "".join(f"{x:>12.1f}" for x in slopes))
    for name, by_r in rows.items():
        summary[name]["step_peak_mib"] = {R: by_r[R]["step_peak"] / 2**20 for R in Rs}
    if args.json:
        # the slope without checkpointing over the slope with it, per measure and pair of lengths
        ratio = {loss: {key: [a / b if b > 0 else None for a, b in zip(summary[f"{loss} fused"][key]["slope_kib_per_token"],
                                                                          summary[f"{loss} fused+ckpt"][key]["slope_kib_per_token"])]
                        for key in measures if key in summary[f"{loss} fused"]}
                 for loss in ("lightning", "full-fkl")}
        args.json.write_text(json.dumps({"hidden": args.hidden, "layers": args.layers, "batch": args.batch, "rows": rows, "summary": summary,
                                         "checkpointing_slope_cut": ratio,
                                         "allocator": "glibc M_MMAP_THRESHOLD fixed at 128 KiB by train in the +ckpt rows (opdcache/training/allocator.py)"},
                                        indent=2))


def cache_commands(cli: list[str], env: dict, student: Path, teacher: Path, prompts: Path, cache: Path, R: int) -> dict:
    """build-rollouts (R new tokens for each prompt), score-teacher (every store) and validate, each measured."""
    return {"build-rollouts": run_measured(cli + ["build-rollouts", "--model", str(student), "--prompts", str(prompts), "--out", str(cache),
                                                  "--max-new-tokens", str(R), "--temperature", "1.0", "--no-chat-template",
                                                  "--num-shards", "4", "--batch-size", "16", "--no-progress"], env),
            "score-teacher": run_measured(cli + ["score-teacher", str(cache), "--teacher", str(teacher), "--store", "logprob,topk,hidden,svd",
                                                 "--top-k", "128", "--svd-rank", "128", "--no-progress"], env),
            "validate": run_measured(cli + ["validate", str(cache)], env)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--workdir", type=Path)
    ap.add_argument("--train-memory", action="store_true", help="only the train step's memory against length")
    ap.add_argument("--train-only", action="store_true",
                    help="only the train steps, on the caches an earlier run left in --workdir (same --hidden and --lengths)")
    ap.add_argument("--hidden", type=int, default=1024, help="the models' hidden size")
    ap.add_argument("--summarize", type=Path, help="print (and write back) the summary of a saved run's --json from its rows")
    ap.add_argument("--batch", type=int, default=2, help="--train-memory: sequences per train step")
    ap.add_argument("--layers", type=int, default=2, help="--train-memory: decoder layers (activation checkpointing saves per layer)")
    args = ap.parse_args()
    if args.train_memory:
        train_memory(args)
        return
    if args.summarize:  # a saved run's JSON: its summary again, from its rows (and written back)
        saved = json.loads(args.summarize.read_text())
        results = {int(R): rows for R, rows in saved["results"].items()}
        saved["summary"] = summarize(results, sorted(results), saved["hidden"])
        args.summarize.write_text(json.dumps(saved, indent=2))
        return
    root = args.workdir or Path(tempfile.mkdtemp(prefix="bench-scale-"))
    root.mkdir(parents=True, exist_ok=True)
    # in a child process: the parent stays small (a forked child's ru_maxrss counts the parent's pages it started with)
    if not (args.train_only and (root / "student" / "config.json").is_file()):  # --train-only: the models its caches came from
        subprocess.run([sys.executable, __file__, "_build", str(root), str(args.hidden)], check=True, capture_output=True)
    student, teacher = root / "student", root / "teacher"
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": " ".join(f"t{3 + (13 * i + 7 * j) % 5000}" for j in range(PROMPT_TOKENS))}) + "\n"
                               for i in range(PROMPTS)))
    env = {**os.environ, "OPDCACHE_PROGRESS": "0"}
    cli = [sys.executable, "-m", "opdcache.cli.main"]
    results: dict[int, dict] = {}
    for R in args.lengths:
        cache = root / f"cache-{R}"
        r = results[R] = {}
        if args.train_only:
            if not (cache / "opdcache.json").is_file():
                raise SystemExit(f"--train-only: no cache at {cache}; run without it first (with the same --workdir and --hidden)")
        else:
            r.update(cache_commands(cli, env, student, teacher, prompts, cache, R))
        for loss in ("lightning", "full-rkl"):
            for path in ("fused", "plain") if R <= PLAIN_MAX[loss] else ("fused",):
                m = run_measured([sys.executable, __file__, "_train", str(student), str(cache), loss, path, str(root / f"run-{R}-{loss}-{path}")], env)
                m.update(json.loads(m.pop("stdout").strip().splitlines()[-1]))
                r[f"train {loss} {path}"] = m
        for m in r.values():
            m.pop("stdout", None)
        print(f"R={R}: " + ", ".join(f"{k} {v['peak_anon'] / 2**20:.0f} MiB" + (f" (the step's own {v['step_peak'] / 2**20:.0f})" if "step_peak" in v else "")
                                     + f" / {v['seconds']:.1f} s" for k, v in r.items()), flush=True)

    summary = summarize(results, args.lengths, args.hidden)
    if args.json:
        args.json.write_text(json.dumps({"hidden": args.hidden, "results": results, "summary": summary}, indent=2))


def summarize(results: dict, lengths: list[int], hidden: int) -> dict:
    """Print each command's peak per length and its growth per extra response token, and the fused train step against
    the full-logits one; return the summary. A cache command's peak is its process's; a train step's is its forward +
    backward's own (``fb_peak``): the step's and the process's peaks are AdamW's first step at every length here (its two
    moments, 8 bytes a parameter), which hides what grows with tokens."""
    lo = min(lengths)
    print(f"\npeak anonymous memory (MiB) at hidden {hidden}: a cache command's process, a train step's forward + backward; growth per "
          f"extra response token from R = {lo} to the longest R measured (KB); budget {ROW_BUDGET / 1024:.0f} KB/token")
    print(f"{'command':<26}" + "".join(f"{f'R={R}':>10}" for R in lengths) + f"{'KB/token':>10}{'ok':>5}")
    summary = {}
    for name in results[lo]:
        key, held = ("fb_peak", TRAIN_BATCH) if name.startswith("train") else ("peak_anon", PROMPTS)
        cells = "".join(f"{results[R][name][key] / 2**20:>10.0f}" if name in results[R] else f"{'-':>10}" for R in lengths)
        top = max(R for R in lengths if name in results[R])
        if top == lo:  # measured at one length only (the full-logits step where longer ones do not fit): no growth
            print(f"{name:<26}{cells}")
            continue
        # response tokens held: a train step reports its batch's; a cache command holds every prompt's R
        growth = (results[top][name][key] - results[lo][name][key]) / ((results[top][name].get("tokens") or held * top)
                                                                        - (results[lo][name].get("tokens") or held * lo))
        ok = growth < ROW_BUDGET if "plain" not in name else None
        summary[name] = {"measure": key, "growth_bytes_per_token": growth, "ok": ok, "between": [lo, top]}
        print(f"{name:<26}{cells}{growth / 1024:>10.1f}{'' if ok is None else ('yes' if ok else 'NO'):>5}")
    for loss in ("lightning", "full-rkl"):
        ran = [R for R in lengths if f"train {loss} plain" in results[R]]
        if not ran:
            continue
        at = 1024 if 1024 in ran else max(ran)
        f, p = results[at][f"train {loss} fused"], results[at][f"train {loss} plain"]
        mem, fb_mem, tim = p["peak_anon"] / f["peak_anon"], p["fb_peak"] / f["fb_peak"], f["seconds"] / p["seconds"]
        summary[f"train {loss}"] = {"at": at, "memory_ratio": mem, "fb_memory_ratio": fb_mem, "time_ratio": tim}
        print(f"train step {loss} at R={at}, batch {TRAIN_BATCH}, fused vs full logits: forward + backward peak {f['fb_peak'] / 2**20:.0f} vs "
              f"{p['fb_peak'] / 2**20:.0f} MiB ({fb_mem:.1f}x lower; target >= 5x); process peak {f['peak_anon'] / 2**20:.0f} vs "
              f"{p['peak_anon'] / 2**20:.0f} MiB ({mem:.1f}x); step {f['seconds']:.2f} vs {p['seconds']:.2f} s ({tim:.2f}x the time; "
              "target <= 1.3x)")
    return summary

if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_train":
        child_train(*sys.argv[2:8])
    elif len(sys.argv) > 1 and sys.argv[1] == "_build":
        build_models(Path(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else None, int(sys.argv[4]) if len(sys.argv) > 4 else 2)
    else:
        main()
