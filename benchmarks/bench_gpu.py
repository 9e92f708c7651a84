"""The GPU suite: score-teacher, the fused train step and the full-vocabulary divergence on a CUDA
device in bf16, each against its plain baseline in the same run, written as one table. benchmarks/gpu_suite.sh runs it.

Models, built here with random weights (nothing is fetched; throughput does not depend on the weights' values):

* ``smollm2``: SmolLM2-135M-Instruct's own config.json and tokenizer (vocabulary 49,152, hidden 576, 30 layers), read from
  ``--smollm2 DIR`` (a converted model directory such as ``~/.cache/opdcache/real``; only its config and tokenizer
  files are read, so its 540 MB of weights need not travel to the device);
* ``qwen3``: Qwen3 at real width -- vocabulary 151,936, hidden 4,096, intermediate 12,288, 32 heads (8 KV) -- with
  ``--qwen3-layers`` layers (default 4), and a WordLevel tokenizer of 151,936 tokens.

What is measured (peak memory is ``torch.cuda.max_memory_allocated`` during the work
minus what was allocated just before it: the model and inputs are not counted):

1. scoring, bf16 model: opdcache's engine (``TransformersBackend.score``, what ``score-teacher`` runs), with the
   logit block as shipped, with ``--block-mib`` variants and with its fused kernel off (``OPDCACHE_KERNELS=0``), against (a) ``plain``: one sequence at a time, the model's
   full logits, a float32 log_softmax, gather, logsumexp, top-k; (b) ``batched``: the fair baseline -- the engine's own
   batches through the decoder, the head at response positions only, one float32 log_softmax over [response tokens, V].
   Same sequences (``--sequences`` of prompt ``--prompt`` + response up to ``--response`` tokens), top-k 20.
   Every variant of a model in one process (one model load), interleaved: a warm-up of each, then ``--rounds`` rounds
   of each in turn (order reversed every other round); tokens/s from the median run, the ratio per round.
2. ``opdcache build-rollouts`` and ``opdcache score-teacher --store logprob,hidden`` end to end (CLI, Parquet written) on
   the qwen3 model: ``--train-batch`` prompts x ``--train-response`` tokens. Its cache feeds 3.
3. one train step on qwen3 (batch ``--train-batch``): opdcache's fused step (``Trainer.loss_and_stats``, backward,
   AdamW; float32 masters, bf16 autocast) against the full-logits step (the model's logits from the first response position on,
   ``logits_to_keep``, a float32 log_softmax, the same loss, backward, AdamW), for the lightning, full-rkl and full-fkl losses (the full-vocabulary
   ones also with the divergence's fused kernel off), the steps on one trainer, interleaved as in 1; tokens/s from the median step, and peak GPU memory.
   Then the Lightning step padded (``--no-pack``) against packed (train's default) on rows whose lengths spread
   (bench_packed.py's spread cache: 4 x ``--train-batch`` rows of log-uniform 8-512 response tokens after 64-token
   prompts, synthetic values; the rollouts of 2 all run to ``--train-response``, so they have no padding to save), two
   trainers on the same weights and rows, interleaved; the padding share is in each row.
4. ``bench_divergence.py --devices cuda`` at 4,096 tokens, hidden 4,096, bf16 parameters and float32 masters under bf16
   autocast (its own table, printed and saved); on a card of 120 GiB or more also at 16,384 tokens.
0. ``generate`` (first: it decides the most): the rollout engine (``TransformersBackend.generate``, what
   ``build-rollouts`` runs: every step's log-softmax, counter-based draw, stored sampling and reference log-probs on
   the device) against ``model.generate(do_sample=True, top_k=0)`` -- which returns tokens only -- on the qwen3 model
   in bf16, temperature 1, for each batch in ``--gen-batches`` and length in ``--gen-lengths`` (prompts of 64 tokens;
   the end-of-sequence id is unset for both sides, so every row generates the full length and the token counts are
   equal). Both sides in one process per shape, interleaved as in 1 (``--gen-rounds`` rounds).
0b. ``exact``: the exact engine on the GPU (``--exact --device cuda``: opdcache/exact/invariant.py's batch-invariant
   kernels) against the default engine, both in bf16 storing what a cache stores, on the qwen3 model at
   ``--gen-batches[0]`` x ``--gen-lengths[0]`` new tokens, interleaved as in 1 (``--gen-rounds`` rounds).
6. ``async``: ``opdcache async --staleness 2`` against the strict synchronous run (``--staleness 0``, every stage in
   turn on the same GPU, colocated) on the qwen3 model as both student and teacher: ``--async-steps`` steps of
   ``--gen-batches[0]`` prompts x ``--gen-lengths[0]`` new tokens; the run's own throughput figure (response tokens a
   second over the whole run), sides alternating over ``--gen-rounds`` rounds, each a fresh ``opdcache async``.
7. ``quantize``: ``opdcache build-rollouts --quantize w4a16:g128`` against the bf16 engine, end to end (CLI, Parquet
   written), the same prompts and lengths, alternating over ``--gen-rounds`` rounds: the emulated low-bit scheme's cost
   (quantize, dequantize, compute: the numbers are int4's, the speed is not an int4 kernel's). In 6 and 7 each run is a
   fresh CLI process (model load included on both sides), with wall and CPU-seconds; GPU memory is not compared there.
5. ``write``: ``opdcache score-teacher`` end to end on an 8-shard cache (8 x ``--train-batch`` prompts), each shard
   written behind the next one's scoring (the default) against inline (``OPDCACHE_WRITE_BEHIND=0``).

    bash benchmarks/gpu_suite.sh                       # on the CUDA machine
    python benchmarks/bench_gpu.py --smoke --device cpu   # a tiny run of the same code anywhere
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_scale import full_logits_loss  # noqa: E402
from bench_scoring import workload  # noqa: E402
from inprocess import interleaved, kernels_off  # noqa: E402

V = 151_936
TOP_K = 20


# ---------------------------------------------------------------------------------------------------- models
def build_qwen3(path: Path, vocab: int, hidden: int, layers: int, device: str) -> None:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    heads = max(1, hidden // 128)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=max(1, heads // 4), head_dim=min(128, hidden),
                      max_position_embeddings=8192, tie_word_embeddings=False, eos_token_id=1, pad_token_id=0, bos_token_id=None)
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs: 2 B parameters initialise in seconds on a GPU
        model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    model.generation_config.eos_token_id = 1
    model.save_pretrained(path)
    tok = Tokenizer(models.WordLevel(vocab=word_vocab(vocab), unk_token=SPECIAL[2]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=SPECIAL[0], eos_token=SPECIAL[1], unk_token=SPECIAL[2]).save_pretrained(path)


SPECIAL = ("<pad>", "<eos>", "<unk>")
"""The qwen3 model's special tokens, ids 0-2: names no prompt word contains (named t0, t1 and t2 they matched inside the
words t13, t27, ...: 37.5% of a prompt's ids were unknown or end-of-sequence)."""


def word_vocab(vocab: int) -> dict[str, int]:
    """The WordLevel vocabulary: the special tokens, then the words t3 ... t<vocab - 1>."""
    return {**{name: i for i, name in enumerate(SPECIAL)}, **{f"t{i}": i for i in range(len(SPECIAL), vocab)}}


def build_smollm2(path: Path, source: Path, device: str, layers: int | None) -> None:
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(source)
    if layers:
        cfg.num_hidden_layers = layers
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json", "generation_config.json"):
        if (source / name).exists():
            shutil.copy(source / name, path / name)


def score_sides(variants: list[str], model_path: str, device: str, n: int, prompt: int, response: int, rounds: int) -> dict:
    """Variants: ``plain``, ``batched@<batch tokens>``, ``opdcache@<batch tokens>`` and ``opdcache@<batch tokens>/<block MiB>``."""
    import numpy as np
    import torch

    from opdcache.backends import hf, streamed
    from opdcache.backends.base import ScoreRequest

    backend = hf.TransformersBackend(model_path, dtype="bfloat16", device=device)
    vocab = backend.vocab_size
    work = [(p, r % vocab) for p, r in workload(n, prompt, response)]
    work = [([t % vocab for t in p], r.astype(np.int32)) for p, r in work]
    tokens = sum(len(r) for _, r in work)
    reqs = [ScoreRequest(p, r) for p, r in work]
    model, dev = backend.model, backend.device
    head = model.get_output_embeddings().weight
    shipped = (streamed.LOGIT_BLOCK_BYTES, streamed.GPU_LOGIT_BLOCK_BYTES)

    @torch.no_grad()
    def plain():  # one sequence at a time: the model's full logits, a float32 log_softmax
        for p, r in work:
            logits = model(torch.tensor([p + r.tolist()], device=dev)).logits[0].float()  # [L, V]
            a = len(p) - 1
            logp = torch.log_softmax(logits[a: a + len(r)], -1)
            lp = logp.gather(1, torch.as_tensor(r, dtype=torch.long, device=dev)[:, None]).squeeze(1)
            lse = torch.logsumexp(logits[a: a + len(r)], -1)
            top = logp.topk(TOP_K, -1)
            _ = (lp.cpu(), lse.cpu(), top.indices.cpu(), top.values.cpu())

    @torch.no_grad()
    def batched():  # the engine's batches, the head at response positions only, one float32 log_softmax over them
        for batch in backend._batches(reqs):
            hidden_NH, _ = backend.final_hidden([reqs[i] for i in batch])
            z = (hidden_NH @ head.T).float()  # [response tokens, V]
            sampled = torch.cat([torch.as_tensor(work[i][1], dtype=torch.long) for i in batch]).to(dev)
            logp = torch.log_softmax(z, -1)
            lp = logp.gather(1, sampled[:, None]).squeeze(1)
            lse = torch.logsumexp(z, -1)
            top = logp.topk(TOP_K, -1)
            _ = (lp.cpu(), lse.cpu(), top.indices.cpu(), top.values.cpu())

    def opdcache():
        out = backend.score(reqs, top_k=TOP_K)
        assert all(np.isfinite(s.logprobs).all() for s in out)

    def side(variant: str):
        kind, _, rest = variant.partition("@")
        mbt, _, mib = rest.partition("/")
        fn = {"plain": plain, "batched": batched, "opdcache": opdcache}[kind]
        if mib == "torch":  # opdcache with its fused kernels off: the torch ops they replace
            fn, mib = kernels_off(fn), ""

        def run():
            if mbt:
                backend.max_batch_tokens = int(mbt)
            streamed.LOGIT_BLOCK_BYTES, streamed.GPU_LOGIT_BLOCK_BYTES = ((int(mib) << 20,) * 2) if mib else shipped
            try:
                fn()
            finally:
                streamed.LOGIT_BLOCK_BYTES, streamed.GPU_LOGIT_BLOCK_BYTES = shipped
        return run

    res = interleaved({v: side(v) for v in variants}, device, rounds)
    return {v: {**r, "tokens": tokens} for v, r in res.items()}


def generate_sides(model_path: str, device: str, batch: int, new_tokens: int, rounds: int) -> dict:
    """The rollout engine against ``model.generate`` on one model and shape, interleaved in this process."""
    import torch

    from opdcache.backends import hf
    from opdcache.backends.base import GenerateRequest, SamplingConfig

    backend = hf.TransformersBackend(model_path, dtype="bfloat16", device=device, generate_batch_size=batch)
    model = backend.model
    model.generation_config.eos_token_id = None  # every row runs the full length on both sides
    backend.eos_ids = set()
    vocab = backend.vocab_size
    prompts = [[3 + (97 * b + 13 * j) % (vocab - 3) for j in range(64)] for b in range(batch)]
    reqs = [GenerateRequest(p, seed=b) for b, p in enumerate(prompts)]
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=new_tokens)
    ids = torch.tensor(prompts, device=backend.device)

    def engine():
        out = backend.generate(reqs, sampling)
        assert all(len(g.response_ids) == new_tokens for g in out)

    @torch.no_grad()
    def generate():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, top_k=0, top_p=1.0, temperature=1.0,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
        assert out.shape[1] == ids.shape[1] + new_tokens

    res = interleaved({"model.generate": generate, "opdcache": engine}, device, rounds)
    return {name: {**r, "tokens": batch * new_tokens} for name, r in res.items()}


def exact_sides(model_path: str, device: str, batch: int, new_tokens: int, rounds: int) -> dict:
    """The exact engine (``--exact --device cuda``: the batch-invariant kernels) against the default engine on one
    model and shape, both generating in bf16 with what a cache stores, interleaved in this process."""
    from opdcache.backends import hf
    from opdcache.backends.base import GenerateRequest, SamplingConfig
    from opdcache.backends.exact import ExactBackend

    backend = hf.TransformersBackend(model_path, dtype="bfloat16", device=device, generate_batch_size=batch)
    exact = ExactBackend(model_path, dtype="bfloat16", device=device, generate_batch_size=batch)
    for b in (backend, exact):  # every row runs the full length on both sides
        b.model.generation_config.eos_token_id = None
        b.eos_ids = [] if b is exact else set()
    vocab = backend.vocab_size
    reqs = [GenerateRequest([3 + (97 * b + 13 * j) % (vocab - 3) for j in range(64)], seed=b) for b in range(batch)]
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=new_tokens)

    def side(engine):
        def run():
            out = engine.generate(reqs, sampling)
            assert all(len(g.response_ids) == new_tokens for g in out)
        return run

    sides = {"opdcache": side(backend), "opdcache --exact": side(exact)}
    res = interleaved(sides, device, rounds)
    out = {name: {**r, "tokens": batch * new_tokens, "arithmetic": exact.arithmetic} for name, r in res.items()}
    for name, run in sides.items():  # after the timed rounds: what one generate call launches, and where its time goes
        out[name]["profile"] = kernel_profile(run, device, new_tokens)
    return out


def kernel_profile(run, device: str, steps: int, top: int = 8) -> dict:
    """One call of ``run`` under torch.profiler, after the timed rounds. ``kernels_per_step``: every device kernel the
    call launched (prefill included) divided by its ``steps`` decode steps; ``busy_ms``: those kernels' summed device
    time; ``top``: the ``top`` kernel names by summed device time, ms. On a CPU the same over aten operators (nested
    ones counted too) and their CPU time, so the CPU numbers are not kernel counts. Diagnostic, never a timed figure."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
        run()
    kernels = [e for e in prof.events() if (e.device_type.name == "CUDA") == cuda and (cuda or e.name.startswith("aten::"))]
    totals: dict = {}
    for e in kernels:
        us = e.device_time_total if cuda else e.cpu_time_total
        totals[e.name] = totals.get(e.name, 0.0) + us
    busy = sum(totals.values())
    return {"kernels_per_step": len(kernels) / max(steps, 1), "busy_ms": busy / 1e3,
            "top": [[name[:80], round(us / 1e3, 3)] for name, us in sorted(totals.items(), key=lambda kv: -kv[1])[:top]]}


def optimizer_step(trainer, loss_of, losses: dict, name: str):
    """A timed side: ``loss_of()``, its backward and the trainer's AdamW step; the loss value kept in ``losses[name]``."""
    def run():
        value = loss_of()
        value.backward()
        trainer.opt.step()
        trainer.opt.zero_grad(set_to_none=True)
        losses[name] = float(value.detach())
    return run


def train_sides(model_path: str, cache: str, loss: str, out: str, batch_size: int, rounds: int) -> dict:
    """One train step, opdcache's fused step against the full-logits step, on one trainer (the same weights,
    optimizer and batch), interleaved."""
    import torch

    from opdcache.training.train import TrainConfig, Trainer

    torch.manual_seed(0)
    trainer = Trainer(TrainConfig(model=Path(model_path), cache=Path(cache), out=Path(out), loss=loss, batch_size=batch_size, lr=1e-5,
                                  kl_coef=0.0, pack=False))  # the main loss alone on padded rows, as the full-logits baseline computes it
    batch = trainer.source.next_batch()
    device = str(trainer.device)
    losses: dict = {}

    def step(name, loss_of, owner=trainer):
        return optimizer_step(owner, loss_of, losses, name)

    fns = {"full logits": step("full logits", lambda: full_logits_loss(trainer, batch, loss)),  # [B, kept, V] bf16, then float32
           "fused": step("fused", lambda: trainer.loss_and_stats(batch)[0])}
    if loss.startswith("full-"):  # the uniform divergence's kernel (opdcache/logits/kernels.py) off: its torch ops
        fns["fused, torch ops"] = kernels_off(step("fused, torch ops", lambda: trainer.loss_and_stats(batch)[0]))
    padding = 1 - float(batch["attention_mask"].float().mean())
    if loss == "lightning":  # the same rows packed (train's default): its own trainer, since its model runs the packed attention
        torch.manual_seed(0)
        packed_trainer = Trainer(TrainConfig(model=Path(model_path), cache=Path(cache), out=Path(out) / "packed", loss=loss,
                                             batch_size=batch_size, lr=1e-5, kl_coef=0.0, pack=True))
        packed = packed_trainer.source.next_batch()
        fns["fused, packed"] = step("fused, packed", lambda: packed_trainer.loss_and_stats(packed)[0], packed_trainer)
    res = interleaved(fns, device, rounds)
    tokens = int(batch["response_mask"].sum())
    return {name: {**r, "tokens": tokens, "loss": losses[name], "padding_share": padding} for name, r in res.items()}


def packed_sides(model_path: str, cache: str, out: str, batch_size: int, rounds: int) -> dict:
    """One Lightning step on rows of spread lengths (bench_packed.py's spread cache), padded (``--no-pack``) against
    packed (train's default): two trainers on the same weights and the same first batch's rows, interleaved. Each
    side's ``tokens`` are the batch's response tokens; ``padding_share`` is the share of the padded batch's [B, L]
    prompt + response positions that are padding (the decoder work packing can save)."""
    import torch

    from opdcache.training.train import TrainConfig, Trainer

    trainers, batches, losses = {}, {}, {}
    for name, pack in (("padded", False), ("packed", True)):
        torch.manual_seed(0)
        trainers[name] = Trainer(TrainConfig(model=Path(model_path), cache=Path(cache), out=Path(out) / name, loss="lightning",
                                             batch_size=batch_size, lr=1e-5, kl_coef=0.0, pack=pack, allow_other_model=True))
        batches[name] = trainers[name].source.next_batch()

    def step(name):
        return optimizer_step(trainers[name], lambda: trainers[name].loss_and_stats(batches[name])[0], losses, name)

    res = interleaved({name: step(name) for name in trainers}, str(trainers["padded"].device), rounds)
    padded = batches["padded"]
    padding = 1 - float(padded["attention_mask"].float().mean())
    tokens = int(padded["response_mask"].sum())
    return {name: {**r, "tokens": tokens, "loss": losses[name], "padding_share": padding} for name, r in res.items()}


# ---------------------------------------------------------------------------------------------------- driving
def child(kind: str, *args) -> dict:
    """A section's sides in a fresh process (one model load): {side: figures}, or {"error": its last line}."""
    out = subprocess.run([sys.executable, __file__, f"_{kind}", *map(str, args)], capture_output=True, text=True)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        sys.stderr.write(out.stderr[-6000:])  # the whole traceback reaches the log; the row keeps its last lines
        return {"error": "\n".join(out.stderr.strip().splitlines()[-12:])[-1500:] or f"exit {out.returncode}"}
    return json.loads(lines[-1])


def cli(*args, env=None, timeout: float | None = None) -> float:
    """Run an opdcache command (its progress bars and messages pass through); its wall time in seconds."""
    return cli_usage(*args, env=env, timeout=timeout)[0]


def cli_usage(*args, env=None, timeout: float | None = None) -> tuple[float, float]:
    """(wall seconds, CPU-seconds) of an opdcache command run as a child process (its user + system time)."""
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "opdcache.cli.main", *map(str, args)], env=env, timeout=timeout)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if out.returncode != 0:
        raise SystemExit(f"opdcache {args[0]} failed ({out.returncode})")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--smollm2", type=Path, help="a SmolLM2 model directory (config and tokenizer are read)")
    ap.add_argument("--qwen3-layers", type=int, default=4)
    ap.add_argument("--sequences", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--response", type=int, default=1024)
    ap.add_argument("--max-batch-tokens", type=int, nargs="+", default=[1024, 16384])
    ap.add_argument("--block-mib", type=int, nargs="*", default=[64, 256], help="logit block sizes tried beside the shipped one")
    ap.add_argument("--train-batch", type=int, default=4)
    ap.add_argument("--train-response", type=int, default=1024)
    ap.add_argument("--sections", default="generate,exact,cli,train,async,quantize",
                    help="which of generate, exact, cli, train, async, quantize, divergence, score, write to run, in this order "
                         "(default: the first six; divergence, score and write on request)")
    ap.add_argument("--async-steps", type=int, default=6)
    ap.add_argument("--gen-batches", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--gen-lengths", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--gen-rounds", type=int, default=3, help="timed rounds of generate, exact, async and quantize, after a warm-up")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds of every side in turn, after a warm-up of each")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes: checks the code, measures nothing")
    ap.add_argument("--cli-timeout", type=float, default=300, help="seconds each CLI command may take")
    ap.add_argument("--out", type=Path, help="folder for results.json and table.md")
    ap.add_argument("--workdir", type=Path)
    ap.add_argument("--append", action="store_true", help="keep the rows already in --out's results.json (a suite run in phases)")
    args = ap.parse_args()
    vocab, hidden = (1024, 64) if args.smoke else (V, 4096)
    if args.smoke:
        args.sequences, args.prompt, args.response, args.train_response, args.qwen3_layers = 4, 8, 16, 16, 1
        args.gen_batches, args.gen_lengths, args.gen_rounds, args.async_steps = [2], [8], 1, 2
    root = args.workdir or Path(tempfile.mkdtemp(prefix="bench-gpu-"))
    models = {}
    for name in ("smollm2", "qwen3"):
        if name == "smollm2" and not args.smollm2:
            print("smollm2: skipped (no --smollm2 directory)", flush=True)
            continue
        models[name] = root / name
        if not (models[name] / "config.json").exists():
            subprocess.run([sys.executable, __file__, "_build", name, str(models[name]), str(vocab), str(hidden), str(args.qwen3_layers),
                            args.device, str(args.smollm2), "2" if args.smoke else "0"], check=True)
    rows: list[dict] = []
    load = {}  # the host's one-minute load average before and after each section
    took = {}  # each section's wall seconds, model builds and child processes included (the suite's time budget)
    if args.append and args.out and (args.out / "results.json").exists():  # an earlier phase of the same suite run
        earlier = json.loads((args.out / "results.json").read_text())
        rows, load, took = earlier["rows"], earlier["load"], earlier.get("section_seconds", {})

    def add(section: str, model: str, variant: str, res: dict, base: dict | None) -> None:
        row = {**res, "section": section, "model": model, "variant": variant}
        if "error" not in res and base and "error" not in base:
            row["speedup"] = (res["tokens"] / res["seconds"]) / (base["tokens"] / base["seconds"])
            # per round: this side's tokens/s over the baseline's in the same round (the interleaved pair)
            row["round_speedups"] = [(res["tokens"] / a) / (base["tokens"] / b) for a, b in zip(res["runs"], base["runs"])]
            if res.get("peak_bytes") and base.get("peak_bytes"):  # sides that measured GPU memory
                row["memory_ratio"] = res["peak_bytes"] / base["peak_bytes"]
        rows.append(row)
        print(json.dumps(row), flush=True)

    sections = args.sections.split(",")
    for section in sections:
        before, started = os.getloadavg()[0], time.perf_counter()
        run = {"generate": run_generate_section, "exact": run_exact_section, "async": run_async_section, "quantize": run_quantize_section, "score": run_score_section, "cli": run_cli_section, "train": run_train_section,
               "divergence": run_divergence_section, "write": run_write_section}[section]
        try:
            run(args, models, root, add, rows)
        except (Exception, SystemExit) as exc:  # one section's failure (a CLI call, a timeout) is a row; the next runs
            import traceback

            traceback.print_exc()
            rows.append({"section": section, "model": "-", "variant": "failed", "error": f"{type(exc).__name__}: {exc}"[:1500]})
        load[section] = [before, os.getloadavg()[0]]
        took[section] = round(time.perf_counter() - started, 1)
        print(f"section {section}: {took[section]} s", flush=True)
        if args.out:  # after every section: a run cut short by its lease keeps what it measured
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "results.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "load": load,
                                                               "section_seconds": took, "rows": rows}, indent=2))
            (args.out / "table.md").write_text(render(rows, args) + "\n")
    print("\n" + render(rows, args))


def _alternate(args, sides: dict, measure) -> dict:
    """``measure(side) -> (tokens, seconds, cpu_seconds)`` for each side in turn over ``--gen-rounds`` rounds (the order
    alternating), after a warm-up of each; per side the median and every run, as :func:`interleaved` returns them."""
    import statistics

    runs: dict = {name: [] for name in sides}
    for r in range(args.gen_rounds + 1):  # round 0 warms up
        for name in (list(sides) if r % 2 else list(sides)[::-1]):
            result = measure(sides[name])
            if r:
                runs[name].append(result)
    return {name: {"tokens": v[0][0], "seconds": statistics.median(x[1] for x in v), "min_seconds": min(x[1] for x in v),
                   "runs": [x[1] for x in v], "cpu_seconds": statistics.median(x[2] for x in v), "peak_bytes": 0}
            for name, v in runs.items()}


def _word_prompts(path: Path, n: int, stride: int) -> Path:
    """``n`` prompts of 16 words of the qwen3 model's WordLevel vocabulary, one JSON line each."""
    path.write_text("".join(json.dumps({"prompt": " ".join(f"t{3 + (stride * i + 3 * j) % 1000}" for j in range(16))}) + "\n"
                            for i in range(n)))
    return path


def run_async_section(args, models, root, add, rows) -> None:
    """opdcache async at staleness 2 against K = 0 (strict synchronous, the stages in turn on one GPU)."""
    env = {**os.environ, "OPDCACHE_PROGRESS": "0"}
    q = models["qwen3"]
    batch, length = args.gen_batches[0], args.gen_lengths[0]
    prompts = _word_prompts(root / "prompts-async.jsonl", batch * args.async_steps, 17)

    def measure(k: int):
        out = root / f"async-k{k}"
        subprocess.run(["rm", "-rf", str(out)], check=True)
        wall, cpu = cli_usage("async", "--model", q, "--teacher", q, "--prompts", prompts, "--no-chat-template", "--staleness", k,
                              "--steps", args.async_steps, "--batch-size", batch, "--max-new-tokens", length, "--temperature", "1.0",
                              "--lr", "1e-6", "--device", args.device, "--out", out, env=env, timeout=args.cli_timeout)
        ledger = [json.loads(line) for line in (out / "ledger.jsonl").read_text().splitlines() if line.strip()]
        return sum(int(e["tokens"]) for e in ledger), wall, cpu  # the response tokens the learner consumed

    res = _alternate(args, {"sync K=0 (colocated)": 0, "async K=2": 2}, measure)
    add("async", "qwen3", f"sync K=0, {args.async_steps} steps of {batch} x {length}", res["sync K=0 (colocated)"], res["sync K=0 (colocated)"])
    add("async", "qwen3", f"async K=2, {args.async_steps} steps of {batch} x {length}", res["async K=2"], res["sync K=0 (colocated)"])


def run_quantize_section(args, models, root, add, rows) -> None:
    """build-rollouts with the emulated w4a16:g128 scheme against the bf16 engine, end to end."""
    env = {**os.environ, "OPDCACHE_PROGRESS": "0"}
    q = models["qwen3"]
    batch, length = args.gen_batches[0], args.gen_lengths[0]
    prompts = _word_prompts(root / "prompts-quant.jsonl", batch, 19)

    def measure(scheme: str):
        out = root / f"quant-{scheme or 'bf16'}".replace(":", "-")
        subprocess.run(["rm", "-rf", str(out)], check=True)
        extra = ["--quantize", scheme] if scheme else []
        wall, cpu = cli_usage("build-rollouts", "--model", q, "--prompts", prompts, "--out", out, "--no-chat-template", "--num-shards", 1,
                              "--batch-size", batch, "--max-new-tokens", length, "--temperature", "1.0", *extra, env=env,
                              timeout=args.cli_timeout)
        manifest = json.loads((out / "opdcache.json").read_text())
        return sum(int(sh["tokens"]) for sh in manifest["tables"]["rollouts"]["shards"]), wall, cpu

    scheme = "w4a16:g32" if args.smoke else "w4a16:g128"  # the smoke model's width (64) holds no group of 128
    res = _alternate(args, {"bf16": "", scheme: scheme}, measure)
    add("quantize", "qwen3", f"build-rollouts bf16, {batch} x {length}", res["bf16"], res["bf16"])
    add("quantize", "qwen3", f"build-rollouts --quantize {scheme}, {batch} x {length}", res[scheme], res["bf16"])


def run_generate_section(args, models, root, add, rows) -> None:
    for batch in args.gen_batches:
        for length in args.gen_lengths:
            res = child("generate", models["qwen3"], args.device, batch, length, args.gen_rounds)
            for side in ("model.generate", "opdcache"):
                add("generate", "qwen3", f"{side}, batch {batch} x {length} new tokens", res.get(side, res), res.get("model.generate", res))


def run_exact_section(args, models, root, add, rows) -> None:
    batch, length = args.gen_batches[0], args.gen_lengths[0]
    res = child("exact", models["qwen3"], args.device, batch, length, args.gen_rounds)
    for side in ("opdcache", "opdcache --exact"):
        add("exact", "qwen3", f"{side}, batch {batch} x {length} new tokens", res.get(side, res), res.get("opdcache", res))
        if "profile" in res.get(side, {}):
            print(f"exact section, {side}: {json.dumps(res[side]['profile'])}", flush=True)


def run_score_section(args, models, root, add, rows) -> None:
    mbt = max(args.max_batch_tokens)
    variants = ["plain"] + [f"{kind}@{m}" for m in args.max_batch_tokens for kind in ("batched", "opdcache")]
    variants += [f"opdcache@{mbt}/{mib}" for mib in args.block_mib]  # the logit block: the knob a GPU may want larger
    variants += [f"opdcache@{mbt}/torch"]  # the fused kernel's effect: the same engine on its torch ops
    labels = {"plain": "plain"}
    labels.update({f"{kind}@{m}": f"{kind} (batch tokens {m})" for m in args.max_batch_tokens for kind in ("batched", "opdcache")})
    labels.update({f"opdcache@{mbt}/{mib}": f"opdcache, logit block {mib} MiB (batch tokens {mbt})" for mib in args.block_mib})
    labels[f"opdcache@{mbt}/torch"] = f"opdcache, torch ops: OPDCACHE_KERNELS=0 (batch tokens {mbt})"
    for name, path in models.items():
        res = child("score", ",".join(variants), path, args.device, args.sequences, args.prompt, args.response, args.rounds)
        base_variant = f"batched@{mbt}"  # the fair baseline: what a competent user runs
        for v in variants:
            add("score", name, labels[v], res.get(v, res), res.get(base_variant, res))


def run_cli_section(args, models, root, add, rows) -> None:
    """build-rollouts and score-teacher end to end; their cache feeds the train step."""
    env = {**os.environ, "OPDCACHE_PROGRESS": "0"}
    q = models["qwen3"]
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": " ".join(f"t{3 + (13 * i + 7 * j) % 1000}" for j in range(16))}) + "\n"
                               for i in range(args.train_batch)))
    cache = root / "cache"
    if not (cache / "opdcache.json").exists():
        tokens = args.train_batch * args.train_response
        s = cli("build-rollouts", "--model", q, "--prompts", prompts, "--out", cache, "--max-new-tokens", args.train_response,
                "--temperature", "1.0", "--no-chat-template", "--num-shards", "1", "--batch-size", args.train_batch, "--progress", env=env,
                timeout=args.cli_timeout)
        rows.append({"section": "cli", "model": "qwen3", "variant": "build-rollouts", "tokens": tokens, "seconds": s, "peak_bytes": 0})
        s = cli("score-teacher", cache, "--teacher", q, "--store", "logprob,hidden", "--progress", env=env, timeout=args.cli_timeout)
        rows.append({"section": "cli", "model": "qwen3", "variant": "score-teacher logprob,hidden", "tokens": tokens, "seconds": s, "peak_bytes": 0})
        # the table scored in bf16 on this device, audited here by its recorded arithmetic (every row): its verdict and
        # its tolerance's reasoning line go to the log; a failing audit is a finding, not a reason to stop the suite
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, "-m", "opdcache.cli.main", "audit", str(cache), "--rows", "all"], env=env,
                             capture_output=True, text=True, timeout=args.cli_timeout)
        print(out.stdout + out.stderr[-2000:], flush=True)
        rows.append({"section": "cli", "model": "qwen3", "variant": f"audit --rows all: exit {out.returncode}", "tokens": tokens,
                     "seconds": time.perf_counter() - t0, "peak_bytes": 0})
        for r in rows[-3:]:
            print(json.dumps(r), flush=True)



def run_write_section(args, models, root, add, rows) -> None:
    """score-teacher end to end on an 8-shard cache of the qwen3 model's rollouts, writing each finished shard in the
    background while the next is scored (the default) against writing it inline (``OPDCACHE_WRITE_BEHIND=0``), with the
    stores that cost the writer most: the prob14 top-128 and bf16 hidden states (a 4,096-wide bf16 shard writes at
    ~9,000-12,000 tokens a second on one core of the project's CPU machine). Each run is a fresh process, so the
    model's load is in both sides; the sides alternate over ``--rounds`` rounds after a warm-up of each; wall time and the
    child's CPU-seconds (median), the ratio per round; the host's load is recorded per section. tokens/s: the cache's
    response tokens over the whole command's wall time, model load included. GPU memory is not compared."""
    import statistics

    env = {**os.environ, "OPDCACHE_PROGRESS": "0"}
    q = models["qwen3"]
    n = 8 * args.train_batch
    prompts = root / "prompts-write.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": " ".join(f"t{3 + (11 * i + 5 * j) % 1000}" for j in range(16))}) + "\n" for i in range(n)))
    cache = root / "cache-write"
    if not (cache / "opdcache.json").exists():
        cli("build-rollouts", "--model", q, "--prompts", prompts, "--out", cache, "--max-new-tokens", args.train_response, "--temperature", "1.0",
            "--no-chat-template", "--num-shards", "8", "--batch-size", n, env=env, timeout=args.cli_timeout)
    tokens = sum(int(s["tokens"]) for s in json.loads((cache / "opdcache.json").read_text())["tables"]["rollouts"]["shards"])
    store = ["--store", "logprob,topk,hidden", "--top-k", "128", "--topk-precision", "prob14", "--topk-mass", "1e-4", "--hidden-dtype", "bfloat16"]
    runs: dict[str, list[tuple[float, float]]] = {"inline": [], "behind": []}
    for r in range(args.rounds + 1):  # round 0 is the warm-up
        for side in ("behind", "inline") if r % 2 else ("inline", "behind"):
            usage = cli_usage("score-teacher", cache, "--teacher", q, *store, "--name", f"{side}-{r}",
                              env=env | {"OPDCACHE_WRITE_BEHIND": "1" if side == "behind" else "0"}, timeout=args.cli_timeout)
            if r:
                runs[side].append(usage)
    sides = {side: {"tokens": tokens, "seconds": statistics.median(w for w, _ in v), "seconds_min": min(w for w, _ in v), "runs": [w for w, _ in v],
                    "cpu_seconds": statistics.median(c for _, c in v), "cpu_seconds_min": min(c for _, c in v), "cpu_runs": [c for _, c in v],
                    "peak_bytes": 0} for side, v in runs.items()}
    add("write", "qwen3", "score-teacher, each shard written inline (OPDCACHE_WRITE_BEHIND=0)", sides["inline"], sides["inline"])
    add("write", "qwen3", "score-teacher, each shard written behind the next one's scoring", sides["behind"], sides["inline"])


def run_train_section(args, models, root, add, rows) -> None:
    q, cache = models["qwen3"], root / "cache"
    for loss in ("lightning", "full-rkl", "full-fkl"):
        res = child("train", q, cache, loss, root / f"run-{loss}", args.train_batch, args.rounds)
        for side in ("full logits", "fused") + (("fused, torch ops",) if loss.startswith("full-") else ("fused, packed",) if loss == "lightning" else ()):
            add("train", "qwen3", f"{loss} {side}", res.get(side, res), res.get("full logits", res))
    # padded against packed where lengths spread (the rollouts above all run to --train-response: no padding to save):
    # bench_packed.py's spread cache, log-uniform 8-512 response tokens after 64-token prompts, synthetic values
    from bench_packed import build_spread

    spread = root / "spread-root"
    if not (spread / "spread" / "opdcache.json").exists():
        vocab = json.loads((Path(q) / "config.json").read_text())["vocab_size"]
        build_spread(spread, 4 * args.train_batch, vocab)
    res = child("packed", q, spread / "spread", root / "run-packed", args.train_batch, args.rounds)
    for side in ("padded", "packed"):
        add("train", "qwen3", f"lightning, spread lengths, {side}", res.get(side, res), res.get("padded", res))


def run_divergence_section(args, models, root, add, rows) -> None:
    """bench_divergence.py on this device at the real width (its own table, printed as it is): 4,096 tokens, and on a
    card of 120 GiB or more also 16,384, where kl_div's [tokens, vocabulary] tensors, not the head's [V, H] gradient,
    set the memory ratio (its float32 log-probs under autocast alone are 20 GB there)."""
    import torch

    cuda = args.device.startswith("cuda")
    sizes = [(64, 64, 3)] if args.smoke else [(4096, 4096, 3)]
    if not args.smoke and cuda and torch.cuda.get_device_properties(0).total_memory >= 120 << 30:
        sizes.append((16384, 4096, 3))
    text = ""
    for tokens, hidden, rounds in sizes:
        out = subprocess.run([sys.executable, str(Path(__file__).parent / "bench_divergence.py"), "--devices", "cuda" if cuda else "cpu",
                              "--tokens", str(tokens), "--hidden", str(hidden), "--vocab", str(1024 if args.smoke else V), "--kind", "fkl",
                              "--rounds", str(rounds), "--results", str(root)],  # a CPU smoke run's figures stay out of benchmarks/results
                             capture_output=True, text=True)
        print(out.stdout + out.stderr[-2000:], flush=True)
        text += out.stdout + ("" if out.returncode == 0 else f"failed ({out.returncode}): {out.stderr[-1500:]}\n")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "divergence.txt").write_text(text)


def render(rows: list[dict], args) -> str:
    lines = [f"device {args.device}; scoring: {args.sequences} sequences, prompt {args.prompt} + response <= {args.response}, top-k {TOP_K}; "
             f"train: batch {args.train_batch} x {args.train_response} response tokens; "
             f"sides interleaved in one process per model (score) or loss (train), {args.rounds} rounds after a warm-up, median", "",
             "| section | model | variant | tokens/s | vs baseline | CPU s | peak GiB | memory vs baseline |", "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['section']} | {r['model']} | {r['variant']} | failed: {r['error']} | | | | |")
            continue
        tps = r["tokens"] / r["seconds"]
        sp = f"{r['speedup']:.2f}x" if "speedup" in r else ""
        if r.get("round_speedups") and r["speedup"] != 1.0:  # per round, each side against the baseline's run of that round
            sp += f" ({min(r['round_speedups']):.2f}-{max(r['round_speedups']):.2f})"
        mem = f"{r['peak_bytes'] / 2**30:.2f}" if r.get("peak_bytes") else ""
        mr = f"{r['memory_ratio']:.3f}x" if "memory_ratio" in r else ""
        cpu = f"{r['cpu_seconds']:.2f}" if "cpu_seconds" in r else ""
        lines.append(f"| {r['section']} | {r['model']} | {r['variant']} | {tps:,.0f} | {sp} | {cpu} | {mem} | {mr} |")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_build":
        name, path, vocab, hidden, layers, device, source, smoke = sys.argv[2:10]
        if name == "qwen3":
            build_qwen3(Path(path), int(vocab), int(hidden), int(layers), device)
        else:
            build_smollm2(Path(path), Path(source), device, int(smoke) or None)
    elif len(sys.argv) > 1 and sys.argv[1] == "_score":
        variants, path, device, n, p, r, rounds = sys.argv[2:9]
        print(json.dumps(score_sides(variants.split(","), path, device, int(n), int(p), int(r), int(rounds))))
    elif len(sys.argv) > 1 and sys.argv[1] == "_generate":
        path, device, batch, length, rounds = sys.argv[2:7]
        print(json.dumps(generate_sides(path, device, int(batch), int(length), int(rounds))))
    elif len(sys.argv) > 1 and sys.argv[1] == "_exact":
        path, device, batch, length, rounds = sys.argv[2:7]
        print(json.dumps(exact_sides(path, device, int(batch), int(length), int(rounds))))
    elif len(sys.argv) > 1 and sys.argv[1] == "_packed":
        path, cache, out, bs, rounds = sys.argv[2:7]
        print(json.dumps(packed_sides(path, cache, out, int(bs), int(rounds))))
    elif len(sys.argv) > 1 and sys.argv[1] == "_train":
        path, cache, loss, out, bs, rounds = sys.argv[2:8]
        print(json.dumps(train_sides(path, cache, loss, out, int(bs), int(rounds))))
    else:
        main()
