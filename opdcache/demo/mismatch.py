"""``opdcache demo --ablation mismatch``: papers/003's findings in miniature, on the embedded task.

An online learner samples its own rollouts every step with the exact engine (opdcache/backends/exact.py), the teacher
scores them in the same arithmetic, and the learner recomputes its log-probs with train --exact's forward: with no
injection the sampler's numbers and the learner's are the same bits, so every measured delta is 0. Training-inference
mismatch is then a dial: Gaussian noise of scale sigma on the sampler's logits (``--inject-mismatch logit-noise:SIGMA``).

Arms (one optimizer step per batch; A_t the objective's advantage; s_t the learner's log-prob, r_t = sg(s_t) its
recompute at the step's start, b_t the sampler's stored temperature-1 log-prob):

* ``exact``: no injection; the policy gradient -sum A_t s_t (every importance weight exp(r_t - b_t) is exactly 1);
* ``bypass@sigma``: the sampler's log-probs stand in for pi_old (papers/003 section 4.1): -sum exp(s_t - b_t) A_t, so
  the mismatch ratio exp(r_t - b_t) multiplies every gradient unbounded;
* ``recompute@sigma``: pi_old recomputed by the learner: -sum A_t s_t on samples from the perturbed sampler;
* ``tis``, ``reject-k1``, ``reject-k3``, ``tis+reject-k3`` (section 4.2) at the largest sigma, on top of recompute:
  token weights min(exp(r_t - b_t), 2), and sequences dropped where sum_t K(r_t - b_t) > 1 (K1 or K3).

Objectives: ``opd`` (A_t = T_t - r_t, the teacher's per-token reverse-KL advantage) and ``reinforce`` (A_t = the
verifier's sequence reward minus the batch mean, papers/003 section 3.2) for exact, the largest bypass and TIS+reject.
Per run: held-out greedy accuracy, reverse KL to the teacher, and per step the mean and max |r_t - b_t|, the K1/K3
probes of KL(sampler || learner) and the gradient norm. Seeds are separate invocations (``--seed``); ``summarize`` puts
several seeds' reports into the README's table and a plot.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

SIGMAS = (0.25, 0.5, 1.0)
ARMS = {  # name: (sigma, mode, corrections, objective)
    "exact": (0.0, "recompute", {}, "opd"),
    **{f"bypass@{s:g}": (s, "bypass", {}, "opd") for s in SIGMAS},
    f"recompute@{SIGMAS[-1]:g}": (SIGMAS[-1], "recompute", {}, "opd"),
    f"tis@{SIGMAS[-1]:g}": (SIGMAS[-1], "recompute", {"tis_cap": 2.0}, "opd"),
    f"reject-k1@{SIGMAS[-1]:g}": (SIGMAS[-1], "recompute", {"reject_k": "k1", "reject_threshold": 1.0}, "opd"),
    f"reject-k3@{SIGMAS[-1]:g}": (SIGMAS[-1], "recompute", {"reject_k": "k3", "reject_threshold": 1.0}, "opd"),
    f"tis+reject-k3@{SIGMAS[-1]:g}": (SIGMAS[-1], "recompute", {"tis_cap": 2.0, "reject_k": "k3", "reject_threshold": 1.0}, "opd"),
    "reinforce exact": (0.0, "recompute", {}, "reinforce"),
    f"reinforce bypass@{SIGMAS[-1]:g}": (SIGMAS[-1], "bypass", {}, "reinforce"),
    f"reinforce tis+reject-k3@{SIGMAS[-1]:g}": (SIGMAS[-1], "recompute", {"tis_cap": 2.0, "reject_k": "k3", "reject_threshold": 1.0}, "reinforce"),
}
STEPS, BATCH, LR, MAX_NEW = 40, 64, 1e-4, 48


def _online_run(arm: str, p: dict, cfg, steps: int = STEPS) -> tuple[Path, list[dict]]:
    """Train one arm from pi_ref; returns the saved model's directory and the per-step log."""
    import numpy as np
    import torch

    from opdcache.backends.base import GenerateRequest, SamplingConfig, ScoreRequest
    from opdcache.backends import EngineConfig, backend_from_model, make_backend
    from opdcache.training.data import collate
    from opdcache.demo import task
    from opdcache.demo.pipeline import load
    from opdcache.training.losses import Corrections, correction_weights, k1, k3
    from opdcache.training.student import StudentForward

    sigma, mode, corr, objective = ARMS[arm]
    out = cfg.workdir / "runs" / f"mismatch-{arm.replace(' ', '-')}-seed{cfg.seed}"
    log_path = out / "steps.jsonl"
    if (out / "model" / "config.json").is_file():
        return out / "model", [json.loads(line) for line in log_path.read_text().splitlines()]
    torch.manual_seed(cfg.seed)
    model, tok = load(p["pi_ref"])
    sampler = backend_from_model(model, EngineConfig(exact=True, inject=f"logit-noise:{sigma}" if sigma else None))
    teacher = make_backend(p["teacher"], EngineConfig(exact=True, dtype="float32", device="cpu"))
    forward = StudentForward(model, 8192, torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    corrections = Corrections(**corr)
    problems = task.problems("opd", cfg.n_opd, seed=cfg.seed)
    from opdcache.demo.evaluate import chat_prompt_ids

    prompt_ids = [chat_prompt_ids(tok, q.prompt) for q in problems]
    rng = np.random.default_rng(cfg.seed)
    log = []
    for step in range(steps):
        idx = rng.choice(len(problems), BATCH, replace=False)
        reqs = [GenerateRequest(prompt_ids[i], seed=int(rng.integers(1 << 62))) for i in idx]
        model.eval()
        gens = sampler.generate(reqs, SamplingConfig(temperature=1.0, max_new_tokens=MAX_NEW))
        model.train()
        scores = teacher.score([ScoreRequest(r.prompt_ids, g.response_ids) for r, g in zip(reqs, gens)])
        rewards = [task.verify_addition(tok.decode(g.response_ids, skip_special_tokens=True), {"answer": problems[i].answer})
                   for i, g in zip(idx, gens)]
        batch = collate([{"prompt_ids": np.asarray(r.prompt_ids), "response_ids": g.response_ids, "sampling_logprobs": g.sampling_logprobs,
                          "ref_logprobs": g.ref_logprobs, "teacher_logprobs": sc.logprobs} for r, g, sc in zip(reqs, gens, scores)])
        mask = batch["response_mask"]
        sel = mask.bool()
        lp, _, _ = forward(batch["input_ids"], batch["attention_mask"], batch["logit_positions"], sel, batch["response_ids"][sel][:, None])
        s = torch.zeros(mask.shape)
        s = s.masked_scatter(sel, lp[:, 0])
        r_train, b = s.detach(), batch["ref_logprobs"] * mask
        if objective == "opd":
            adv = (batch["teacher_logprobs"] - r_train) * mask
        else:
            R = torch.tensor(rewards, dtype=torch.float32)
            adv = (R - R.mean())[:, None] * mask
        ratio = torch.exp(s - b) if mode == "bypass" else torch.exp(s - r_train)
        weights, cstats = correction_weights(corrections, s, r_train, b, adv, mask)
        loss = -(weights * ratio * adv * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9))
        opt.step()
        delta = (r_train - b)[sel]
        log.append({"step": step + 1, "loss": float(loss.detach()), "grad_norm": grad_norm, "mean_abs_delta": float(delta.abs().mean()),
                    "max_abs_delta": float(delta.abs().max()), "k1": float(k1(delta).mean()), "k3": float(k3(delta).mean()),
                    "reward": float(np.mean(rewards)), **{k: float(v) for k, v in cstats.items()}})
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out / "model")
    tok.save_pretrained(out / "model")
    log_path.write_text("".join(json.dumps(r) + "\n" for r in log))
    return out / "model", log


def run_mismatch_ablation(cfg):
    """One seed of the ablation in ``cfg.workdir``; figures to ``ablation_mismatch_seed<seed>.json``."""
    from opdcache.demo.pipeline import DemoReport, evaluate, finish, prepare

    report = DemoReport()
    start = time.perf_counter()
    p = prepare(cfg, report)
    report.figures["runs"] = {}
    for arm in ARMS:
        t0 = time.perf_counter()
        model_dir, log = _online_run(arm, p, cfg)
        figures = evaluate(arm, model_dir, p["teacher_model"], cfg, report)
        del report.figures[arm]
        sigma, mode, corr, objective = ARMS[arm]
        report.figures["runs"][arm] = {
            "sigma": sigma, "mode": mode, "corrections": corr, "objective": objective, **figures,
            "mean_abs_delta": sum(r["mean_abs_delta"] for r in log) / len(log), "max_abs_delta": max(r["max_abs_delta"] for r in log),
            "k1": sum(r["k1"] for r in log) / len(log), "k3": sum(r["k3"] for r in log) / len(log),
            "grad_norm_median": sorted(r["grad_norm"] for r in log)[len(log) // 2], "grad_norm_max": max(r["grad_norm"] for r in log),
            "steps": log, "seconds": time.perf_counter() - t0}
    report.say("[result] mismatch ablation, this seed:\n" + table([report.figures]))
    return finish(report, cfg, start, f"ablation_mismatch_seed{cfg.seed}.json")


def table(reports: list[dict]) -> str:
    """Markdown: per arm, held-out accuracy (mean and each seed), reverse KL, delta, K1/K3 and gradient norms."""
    lines = ["| arm | objective | held-out accuracy | reverse KL | mean abs delta | max abs delta | K1 | K3 | median / max grad norm |",
             "|---|---|---|---|---|---|---|---|---|"]
    for arm in ARMS:
        runs = [r["runs"][arm] for r in reports if arm in r.get("runs", {})]
        if not runs:
            continue
        mean = lambda key: sum(r[key] for r in runs) / len(runs)  # noqa: E731
        accs = ", ".join(f"{r['accuracy']:.1%}" for r in runs)
        lines.append(f"| {arm} | {runs[0]['objective']} | {mean('accuracy'):.1%} ({accs}) | {mean('reverse_kl'):.4f} | "
                     f"{mean('mean_abs_delta'):.2e} | {max(r['max_abs_delta'] for r in runs):.2e} | {mean('k1'):.2e} | {mean('k3'):.2e} | "
                     f"{mean('grad_norm_median'):.2f} / {max(r['grad_norm_max'] for r in runs):.2f} |")
    return "\n".join(lines)


def summarize(paths: list[Path], png: Path | None = None) -> str:
    """The table over several seeds' reports, and (with ``png``) accuracy and gradient norm per arm."""
    reports = [json.loads(Path(p).read_text()) for p in paths]
    text = table(reports)
    if png is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        arms = [a for a in ARMS if all(a in r["runs"] for r in reports)]
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        for i, r in enumerate(reports):
            axes[0].scatter(range(len(arms)), [r["runs"][a]["accuracy"] for a in arms], color="C0", alpha=0.6, label="seed" if i == 0 else None)
            axes[1].scatter(range(len(arms)), [r["runs"][a]["grad_norm_max"] for a in arms], color="C3", alpha=0.6)
        axes[0].set_ylabel("held-out accuracy")
        axes[1].set_ylabel("max gradient norm over the run")
        axes[1].set_yscale("log")
        for ax in axes:
            ax.set_xticks(range(len(arms)), arms, rotation=60, ha="right", fontsize=8)
        fig.suptitle("papers/003 in miniature: exact rollouts vs injected logit noise, bypass vs recompute vs corrections")
        fig.tight_layout()
        fig.savefig(png, dpi=110)
    return text
