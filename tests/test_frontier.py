"""``opdcache plan`` and opdcache/teacher/frontier.py: each number against a plain full-vocabulary reference on the demo
teacher, the choice, and the command's errors."""

import json

import numpy as np
import pytest
import torch

from opdcache.teacher.frontier import choose, measure, Model, Setting


@pytest.fixture(scope="module")
def demo_models(weights):
    from opdcache.backends.hf import TransformersBackend

    return Model(TransformersBackend(weights / "teacher", dtype="float32")), Model(TransformersBackend(weights / "student", dtype="float32"))


def _requests(hf_cache, n):
    from opdcache.format.cache import Cache
    from opdcache.teacher.scoring import score_requests

    table = Cache(hf_cache).read_shard("rollouts", 0, ["id", "prompt_ids", "response_ids"]).slice(0, n)
    return score_requests(table), table["id"].to_pylist()


def test_frontier_numbers_equal_plain_full_vocabulary_references(hf_cache, demo_models):
    from opdcache.stores import compact

    teacher, student = demo_models
    reqs, ids = _requests(hf_cache, 3)
    settings = [Setting.of("topk", top_k=8), Setting.of("topk", top_k=8, topk_precision="float16", topk_mass=1e-2),
                Setting.of("topk", top_k=8, topk_precision="prob14", topk_mass=1e-2), Setting.of("hidden", hidden_dtype="bfloat16")]
    report = measure(teacher, reqs, ids, settings, {"s": student})
    kl = {s.label: [] for s in settings}
    fkl = {s.label: [] for s in settings}
    for req in reqs:  # plain: whole [T, V] distributions in float64, built per setting over the vocabulary
        p_lp = teacher.log_probs(teacher.hidden(req)).double()
        s_lp = student.log_probs(student.hidden(req)).double()
        p, V = p_lp.exp(), p_lp.shape[1]
        full = (p * (p_lp - s_lp)).sum(-1)
        for s in settings[:3]:
            top_lp, top_ids = p_lp.float().topk(8, -1)
            if s.get("topk_mass") is None:
                kept_ids, stored = [t.tolist() for t in top_ids], [t.double() for t in top_lp]
                tails = [float(1 - p[t, top_ids[t]].sum()) for t in range(len(p))]
            else:
                enc = compact.compact_topk(top_ids.numpy(), top_lp.numpy(), s.get("topk_precision"), s.get("topk_mass"))
                kept_ids = [row[row != -1].tolist() for row in enc["ids"]]
                stored = [torch.as_tensor(enc["logprobs"][t][enc["ids"][t] != -1]).double() for t in range(len(p))]
                tails = enc["tail"].astype(np.float64).tolist()
            for t in range(len(p)):
                z = float(stored[t].exp().sum()) + tails[t]
                q = torch.full((V,), tails[t] / z / (V - len(kept_ids[t])), dtype=torch.float64)
                q[kept_ids[t]] = stored[t].exp() / z
                kl[s.label].append(float((p[t] * (p_lp[t] - q.log())).sum()))
                out_mask = torch.ones(V, dtype=torch.bool)
                out_mask[kept_ids[t]] = False
                s_tail = float(s_lp[t].exp()[out_mask].sum())
                est = float((q[kept_ids[t]] * (q[kept_ids[t]].log() - s_lp[t, kept_ids[t]])).sum())
                r = tails[t] / z
                est += r * (np.log(r) - np.log(s_tail)) if r > 0 else 0.0
                fkl[s.label].append(abs(est - float(full[t])))
        q_lp = teacher.log_probs(teacher.hidden(req).to(torch.bfloat16).float()).double()
        kl[settings[3].label] += (p * (p_lp - q_lp)).sum(-1).tolist()
        fkl[settings[3].label] += ((q_lp.exp() * (q_lp - s_lp)).sum(-1) - full).abs().tolist()
    for s in settings:
        got = report["settings"][s.label]
        assert got["kl"]["mean"] == pytest.approx(np.mean(kl[s.label]), rel=1e-3, abs=1e-7)
        assert got["kl"]["max"] == pytest.approx(np.max(kl[s.label]), rel=1e-3, abs=1e-7)
        assert got["students"]["s"]["fkl_error"]["mean"] == pytest.approx(np.mean(fkl[s.label]), rel=1e-3, abs=1e-7)
        assert got["bytes_per_token"] > 0
    assert report["settings"]["top-8 exact"]["kl"]["max"] > 1e-4  # the references are not all ~0
    codes, half = (report["settings"][f"top-8 {p} mass 0.01"]["students"]["s"]["vs_exact"]["max"] for p in ("prob14", "float16"))
    # each compact store measured against the exact top-8 it encodes: both lose the entries past the 1e-2 mass cut, which
    # dominates their precision's steps (prob14's 2^-15, float16's 2^-11 relative), so the two errors are close, not 0
    assert codes > 0 and half > 0 and abs(codes - half) < 0.05 * max(codes, half)


def test_choose_picks_the_cheapest_within_the_error_or_the_best_within_the_bytes():
    frontier = {"settings": {
        "a": {"bytes_per_token": 100.0, "kl": {"max": 1e-2}, "kl_is": "divergence", "flags": "--a", "students": {}},
        "b": {"bytes_per_token": 300.0, "kl": {"max": 1e-4}, "kl_is": "divergence", "flags": "--b", "students": {}},
        "c": {"bytes_per_token": 10.0, "kl": {"max": 1e-6}, "kl_is": "spread", "flags": "--c", "students": {}},
    }}
    assert choose(frontier, max_error=1e-3)["label"] == "b"  # the sampled store's spread is not an error bound: skipped
    assert choose(frontier, max_error=1e-1)["label"] == "a"
    assert choose(frontier, max_bytes=200)["label"] == "a"
    assert choose(frontier, max_error=1e-9) is None


def test_plan_command_prints_the_frontier_and_refuses_bad_options(hf_cache, weights, capsys):
    from opdcache.cli.main import main

    def cli(*args):
        with pytest.raises(SystemExit) as e:
            main([str(a) for a in args])
        out = capsys.readouterr()
        return e.value.code, out.out, out.err

    code, out, err = cli("plan", hf_cache, "--teacher", weights / "teacher", "--rows", 4, "--max-error", 1e-2, "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["rows"] == 2 and report["choice"]["flags"].startswith("--store")  # svd: half the rows fit it
    assert {"top-20 exact", "sampled m=12", "hidden bfloat16", "svd r=64 bfloat16"} <= set(report["settings"])
    k = min(128, report["vocab_size"] - 1)  # the compact top-128, prob14 among them: the smallest top-k store
    assert {f"top-{k} float16 mass 0.0001", f"top-{k} prob14 mass 0.0001"} <= set(report["settings"])
    assert report["settings"][f"top-{k} prob14 mass 0.0001"]["flags"] == f"--store topk --top-k {k} --topk-precision prob14 --topk-mass 0.0001"
    assert report["svd_calibration_positions"] > 0
    code, out, err = cli("plan", hf_cache, "--teacher", weights / "teacher", "--rows", 4)
    n = f"{report['svd_calibration_positions']:,}"
    assert code == 0 and f"svd rows: fitted on the first half of the sample ({n} positions)" in out, out  # the same seeded sample
    # by default: a recommendation within the stated budget, and the settings this cache already holds as marked rows
    assert "recommended (the cheapest with max kl <= 0.01 nats a position, the default budget: --max-error or --max-bytes" in out
    assert any(line.startswith("top-6 exact *") for line in out.splitlines()), out
    assert "* top-6 exact: in teachers/teacher" in out and "* sampled m=4: in teachers/teacher" in out
    assert "B/token: the store's bytes on disk per response token" in out and "kl max / kl mean:" in out
    code, out, err = cli("plan", hf_cache, "--teacher", weights / "teacher", "--max-error", 1e-2, "--max-bytes", 100)
    assert code == 2 and "--max-error and --max-bytes each pick a setting; pass one of them" in err and "Traceback" not in err
    code, out, err = cli("plan", hf_cache, "--teacher", weights / "teacher", "--rows", 0)
    assert code == 2 and "--rows must be at least 1, got 0" in err


def test_a_padding_slot_never_touches_token_0():
    """A compact row whose support holds token 0 and ends in padding (id -1, clamped to 0 for indexing): q* at token 0
    must be its stored value, so KL(p || q*) equals the plain sum. (The first version scattered the padding slots too,
    and token 0's entry could lose to one of them.)"""
    from opdcache.stores import compact
    from opdcache.stores.base import FrontierBlock
    from opdcache.teacher.frontier import block_errors

    V = 50
    logits = torch.full((1, V), -6.0)
    logits[0, 0], logits[0, 7], logits[0, 3] = 4.0, 3.0, 1.0  # token 0 the most likely; a peaked row keeps few entries
    p_lp = torch.log_softmax(logits, -1)
    tv, ti = p_lp.topk(8, -1)
    s = Setting.of("topk", top_k=8, topk_precision="float32", topk_mass=0.1)
    block = FrontierBlock(p_lp=p_lp.double(), hidden=None, stats={"topk_ids": ti, "topk_logprobs": tv}, log_probs=None)
    kl, _, spread = block_errors(s, block, {})
    assert not spread
    enc = compact.compact_topk(ti.numpy(), tv.numpy(), "float32", 0.1)
    kept = enc["ids"][0][enc["ids"][0] != -1]
    assert 0 in kept.tolist() and (enc["ids"][0] == -1).any()  # the case: token 0 kept, padding present
    stored = torch.as_tensor(enc["logprobs"][0][enc["ids"][0] != -1]).double()
    z = float(stored.exp().sum()) + float(enc["tail"][0])
    q = torch.full((V,), float(enc["tail"][0]) / z / (V - len(kept)), dtype=torch.float64)
    q[torch.as_tensor(kept).long()] = stored.exp() / z
    want = float((p_lp[0].double().exp() * (p_lp[0].double() - q.log())).sum())
    assert kl[0] == pytest.approx(want, rel=1e-6, abs=1e-9)
