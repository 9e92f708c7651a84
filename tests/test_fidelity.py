"""The error against the full vocabulary that every teacher table records (opdcache/format/fidelity.py): the streamed
moments and the closed forms against plain full-vocabulary references, the record through score-teacher, info, the
card and validate, and --hidden-dtype."""

import json

import numpy as np
import pytest
import torch

from opdcache.format import fidelity


def _full_kl_to_maxent(lp_V: np.ndarray, kept_ids: np.ndarray, stored_lp: np.ndarray, stored_tail: float) -> float:
    """Plain reference: build q* over the whole vocabulary and sum p log(p / q*)."""
    V = lp_V.shape[0]
    q = np.zeros(V)
    z = np.exp(stored_lp).sum() + stored_tail
    q[kept_ids] = np.exp(stored_lp) / z
    outside = np.ones(V, bool)
    outside[kept_ids] = False
    q[outside] = (stored_tail / z) / outside.sum()
    p = np.exp(lp_V)
    return float((p * (lp_V - np.log(q))).sum())


@pytest.mark.parametrize("mass", [None, 1e-3])
def test_kl_to_the_maxent_completion_equals_the_full_vocabulary_sum(mass):
    from opdcache.stores import compact

    rng = np.random.default_rng(0)
    T, V, k = 40, 3000, 32
    prior = -3.0 * np.log(rng.permutation(V) + 1.0)  # Zipf-like: a few tokens carry most of the mass, as an LM's do
    logits = prior + rng.normal(size=(T, V)) * rng.uniform(0.5, 3.0, size=(T, 1))
    lp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    entropy = -(np.exp(lp) * lp).sum(1)
    top = np.argsort(-lp, 1)[:, :k]
    top_lp = np.take_along_axis(lp, top, 1).astype(np.float32)
    if mass is None:  # the exact store: tail = 1 - kept mass
        r, kl = compact.kl_maxent(entropy, top_lp, np.ones_like(top_lp, bool), top_lp, None, V)
        for t in range(T):
            tail = 1 - np.exp(top_lp[t].astype(np.float64)).sum()
            assert kl[t] == pytest.approx(_full_kl_to_maxent(lp[t], top[t], top_lp[t].astype(np.float64), tail), abs=2e-6)
            assert r[t] == pytest.approx(tail, abs=1e-6)
    else:
        enc = compact.compact_topk(top, top_lp, "float16", mass)
        kept = enc["ids"] != -1
        r, kl = compact.kl_maxent(entropy, enc["exact"], kept, enc["logprobs"], enc["tail"], V)
        assert kept.sum(1).min() < k  # the mass threshold dropped entries somewhere
        for t in range(T):
            ids = enc["ids"][t][kept[t]]
            want = _full_kl_to_maxent(lp[t], ids, enc["logprobs"][t][kept[t]].astype(np.float64), float(enc["tail"][t]))
            assert kl[t] == pytest.approx(want, abs=2e-6)
    assert (kl > 1e-4).any()  # the references are not all ~0: the test can fail


def test_streamed_moments_and_rounding_kl_equal_a_plain_full_forward(weights):
    from opdcache.backends.base import ScoreRequest
    from opdcache.backends.hf import TransformersBackend
    from opdcache.inputs.models import load_causal_lm

    backend = TransformersBackend(weights / "teacher", dtype="float32")
    reqs = [ScoreRequest([1, 5, 7, 9], [11, 4, 20, 3, 8]), ScoreRequest([2, 6], [30, 31, 1])]
    got = backend.score(reqs, top_k=4, hidden=True, hidden_dtype="bfloat16")
    model = load_causal_lm(weights / "teacher", torch.float32).eval()
    head = model.get_output_embeddings()
    for req, sc in zip(reqs, got):
        ids = torch.tensor([list(req.prompt_ids) + list(req.response_ids)])
        with torch.no_grad():
            logits = model(ids).logits[0, len(req.prompt_ids) - 1: -1].double()
        lp = torch.log_softmax(logits, -1)
        p = lp.exp()
        ent = -(p * lp).sum(-1)
        var = (p * lp * lp).sum(-1) - ent ** 2
        np.testing.assert_allclose(sc.entropy, ent.numpy(), atol=2e-6)
        np.testing.assert_allclose(sc.variance, var.numpy(), atol=2e-5)
        # the KL of these very states, in float64. The engine's KL is log(1 + S1/s) - S0/s with S0 = sum_v e_v d_v,
        # S1 = sum_v e_v expm1(d_v) (e_v = exp(z_v - m), d = (h_rounded - h) W^T), each a float32 dot over a vocabulary
        # slice (at most V terms: error <= V u sum_v e_v |d_v|), and the two nearly cancel (the KL is ~ Var_p[d] / 2,
        # S0/s ~ E_p[d]): its error is at most 2 V u E_p[|d|] (x 1.01 for expm1's |expm1(d)| <= 1.01 |d| here), plus
        # second-order terms (float32 d and p move the KL by its derivative p_v (d_v - E_p[d]) times their error)
        W64 = head.weight.detach().double()
        z64 = sc.hidden.double() @ W64.T
        z2 = sc.hidden.to(torch.bfloat16).double() @ W64.T
        if getattr(head, "bias", None) is not None:
            z64, z2 = z64 + head.bias.detach().double(), z2 + head.bias.detach().double()
        lp64 = torch.log_softmax(z64, -1)
        p64 = lp64.exp()
        kl = (p64 * (lp64 - torch.log_softmax(z2, -1))).sum(-1).numpy()
        assert kl.max() > 1e-8  # bfloat16 rounding changes something
        V = W64.shape[0]
        bound = 2 * 1.01 * V * 2.0 ** -24 * (p64 * (z2 - z64).abs()).sum(-1).numpy()
        assert (np.abs(sc.rounding_kl - kl) <= bound + 1e-15).all(), (sc.rounding_kl, kl, bound)
        assert bound[kl.argmax()] < 0.1 * kl.max()  # tight enough to check something where the KL is largest


def test_score_teacher_records_the_error_and_info_card_and_validate_show_it(hf_cache, tmp_path, capsys):
    import shutil

    from opdcache.cli.main import main
    from opdcache.format.validate import validate

    cache = tmp_path / "c"
    shutil.copytree(hf_cache, cache)
    manifest = json.loads((cache / "opdcache.json").read_text())
    record = manifest["tables"]["teachers/teacher"]["fidelity"]
    assert record["measured"] is True
    for key in ("topk_kl_maxent", "topk_tail_mass", "sampled_stderr", "entropy"):
        assert record[key]["positions"] == sum(s["tokens"] for s in manifest["tables"]["rollouts"]["shards"])
        assert 0 <= record[key]["mean"] <= record[key]["max"]
    assert record["topk_kl_maxent"]["max"] > 0
    with pytest.raises(SystemExit) as exit_:
        main(["info", str(cache)])
    out = capsys.readouterr().out
    assert exit_.value.code == 0
    assert "against the full vocabulary (measured while scoring): KL(teacher || stored" in " ".join(out.split())
    assert "top-k with its tail spread evenly), nats: mean" in " ".join(out.split())
    assert "Error of `teacher-teacher` against the teacher's full vocabulary" in (cache / "README.md").read_text()
    assert not [p for p in validate(cache) if not p.warning]
    # a hand-edited record is found; a missing one is a warning naming the fix
    record["topk_kl_maxent"]["mean"] /= 10
    (cache / "opdcache.json").write_text(json.dumps(manifest))
    problems = [str(p) for p in validate(cache)]
    assert any("recorded error against the full vocabulary differs from what its shards' footers record" in p for p in problems)
    del manifest["tables"]["teachers/teacher"]["fidelity"]
    (cache / "opdcache.json").write_text(json.dumps(manifest))
    problems = validate(cache)
    assert [p for p in problems if "records no error against the full vocabulary" in str(p) and "re-score it" in str(p)]
    assert all(p.warning for p in problems if "full vocabulary" in str(p))


def test_validate_checks_the_fidelity_record(hf_cache, tmp_path):
    """A hostile footer record is one problem, not a crash."""
    import shutil

    import pyarrow.parquet as pq

    from opdcache.format.validate import validate

    cache = tmp_path / "c"
    shutil.copytree(hf_cache, cache)
    manifest = json.loads((cache / "opdcache.json").read_text())
    info = manifest["tables"]["teachers/teacher"]["shards"][0]
    path = cache / info["path"]
    table = pq.read_table(path)
    meta = dict(table.schema.metadata)
    meta[fidelity.META] = json.dumps({"entropy": {"sum": "x", "max": [], "positions": None}}).encode()
    pq.write_table(table.replace_schema_metadata(meta), path)
    from opdcache.inputs.fingerprint import sha256_file

    info["bytes"], info["sha256"] = path.stat().st_size, sha256_file(path)
    (cache / "opdcache.json").write_text(json.dumps(manifest))
    problems = [str(p) for p in validate(cache)]
    assert any("malformed" in p or "differs from what its shards' footers record" in p for p in problems)


def test_hidden_dtype_bfloat16_stores_rounded_states_and_records_their_kl(weights, tmp_path, opd_prompts):
    from opdcache.format import shards
    from opdcache.backends.base import SamplingConfig
    from opdcache.format.cache import Cache
    from opdcache.errors import ConfigError
    from opdcache.inputs.prompts import PromptConfig
    from opdcache.teacher.rollouts import GenerateJob, run_generate
    from opdcache.teacher.scoring import ScoreJob, run_score

    out = tmp_path / "c"
    run_generate(GenerateJob(model=weights / "student", prompts=PromptConfig(opd_prompts, limit=4), out=out, num_shards=1,
                             sampling=SamplingConfig(max_new_tokens=12), sft_teacher=weights / "teacher"))
    run_score(ScoreJob(cache=out, teacher=weights / "teacher", stores=("logprob", "hidden"), hidden_dtype="bfloat16", slug="bf"))
    run_score(ScoreJob(cache=out, teacher=weights / "teacher", stores=("logprob", "hidden"), slug="f32"))
    cache = Cache(out)
    assert cache.params("teachers/bf").hidden_dtype == "bfloat16" and cache.params("teachers/f32").hidden_dtype == "float32"
    bf = shards.read_table(cache.shard_paths("teachers/bf")[0])
    f32 = shards.read_table(cache.shard_paths("teachers/f32")[0])
    h_bf = shards.hidden_to_torch(shards.token_values(bf["hidden"]), "bfloat16")
    h_32 = shards.hidden_to_torch(shards.token_values(f32["hidden"]), "float32")
    assert torch.equal(h_bf, h_32.to(torch.bfloat16))  # the float32 states, rounded once
    rec = cache.table("teachers/bf")["fidelity"]["hidden_rounding_kl"]
    assert 0 < rec["mean"] <= rec["max"] < 1e-3
    assert "hidden_rounding_kl" not in cache.table("teachers/f32")["fidelity"]
    with pytest.raises(ConfigError, match="--hidden-dtype sets the hidden store's precision: add --store hidden"):
        ScoreJob(cache=out, teacher=weights / "teacher", hidden_dtype="bfloat16")
    with pytest.raises(ConfigError, match="--hidden-dtype must be one of float32, bfloat16, float16"):
        ScoreJob(cache=out, teacher=weights / "teacher", stores=("hidden",), hidden_dtype="fp8")


def test_svd_calibration_is_drawn_from_all_shards_and_its_size_recorded(hf_cache, weights, tmp_path, capsys):
    """The fit takes seeded rows over every shard (not the first rows of shard 0), records its calibration size, warns
    with the count when the rollouts hold fewer than max(32 x rank, 2,048) positions, and --svd-min-positions refuses
    before any model loads."""
    import shutil

    from opdcache.format.cache import Cache
    from opdcache.errors import ConfigError
    from opdcache.stores.svdprojection import calibration_rows
    from opdcache.teacher.scoring import ScoreJob, run_score

    cache = Cache(hf_cache)
    picks, target = calibration_rows(cache, 16, 0)
    assert calibration_rows(cache, 512, 0)[1] == 16384  # 32 x rank above the floor
    assert target == 2048 and len({s for s, _ in picks}) == len(cache.table("rollouts")["shards"]) > 1
    assert calibration_rows(cache, 16, 0) == (picks, target) and calibration_rows(cache, 16, 1)[0] != picks  # seeded
    info = cache.table("teachers/teacher")["svd"]
    tokens = sum(s["tokens"] for s in cache.table("rollouts")["shards"])
    assert info["calibration_shards"] == 3 and info["calibration_positions"] == tokens  # all of this small cache
    assert info["calibration_target"] == 2048 and "in-sample" in info["heldout"]
    out = tmp_path / "c"
    shutil.copytree(hf_cache, out)
    run_score(ScoreJob(cache=out, teacher=weights / "teacher", stores=("svd",), svd_rank=8, slug="svd8"))
    assert f"warning: the svd projection is fitted on {tokens:,} positions, fewer than 2,048" in capsys.readouterr().out
    with pytest.raises(ConfigError, match=rf"--svd-min-positions 5000: the rollouts table has only {tokens:,} response positions"):
        run_score(ScoreJob(cache=out, teacher=tmp_path / "no-such-teacher", stores=("svd",), svd_rank=8, svd_min_positions=5000))


def test_svd_rank_above_the_hidden_size_is_refused_in_one_line_before_the_model_loads(hf_cache, weights, tmp_path, capsys, monkeypatch):
    """--svd-rank above the teacher's hidden size: exit 2 with the hidden size and the fix, from config.json before any
    weight loads (it was a ValueError from the fit, a traceback, after the model had loaded); a config.json without a
    hidden size is checked against the loaded head instead."""
    import shutil

    import opdcache.teacher.scoring as scoring
    from opdcache.cli.main import main
    from opdcache.errors import ConfigError

    out = tmp_path / "c"
    shutil.copytree(hf_cache, out)

    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(scoring, "make_backend", no_load)
    with pytest.raises(SystemExit) as exit_:
        main(["score-teacher", str(out), "--teacher", str(weights / "teacher"), "--store", "svd", "--svd-rank", "129", "--no-progress"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err
    assert err.strip().splitlines() == ["error: --svd-rank 129 is above the teacher's hidden size 128 (config.json): the svd store "
                                        "projects the hidden state, so its rank is at most 128; pass --svd-rank 128 or less, or "
                                        "--store hidden for the states themselves"]
    monkeypatch.undo()
    teacher = tmp_path / "teacher"
    shutil.copytree(weights / "teacher", teacher)
    cfg = json.loads((teacher / "config.json").read_text())
    del cfg["hidden_size"]
    cfg_path = teacher / "config.json"
    assert scoring._config_number(teacher) == 128
    cfg_path.write_text(json.dumps(cfg | {"text_config": {"hidden_size": 64}}))
    assert scoring._config_number(teacher) == 64  # a multimodal config's text part
    cfg_path.write_text(json.dumps(cfg | {"hidden_size": "128"}))
    assert scoring._config_number(teacher) is None  # not a number: left to the check on the loaded head
    monkeypatch.setattr(scoring, "_config_number", lambda path, key="hidden_size": None)  # as for a config.json that states none
    with pytest.raises(ConfigError, match=r"--svd-rank 200 is above the teacher's hidden size 128 \(its output head\)"):
        scoring.run_score(scoring.ScoreJob(cache=out, teacher=weights / "teacher", stores=("svd",), svd_rank=200))


def test_train_sampled_fkl_logs_the_estimates_standard_error(hf_cache, weights, tmp_path, capsys):
    from opdcache.cli.main import main

    with pytest.raises(SystemExit) as exit_:
        main(["train", "--model", str(weights / "student"), "--cache", str(hf_cache), "--loss", "sampled-fkl", "--steps", "2",
              "--batch-size", "4", "--out", str(tmp_path / "run")])
    assert exit_.value.code == 0, capsys.readouterr().err
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 2 and all(s["sampled_stderr"] > 0 for s in steps)
