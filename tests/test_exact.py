"""The exact arithmetic (papers/003): primitives against plain references, the engine's invariance to batch,
padding, KV cache and threads, and the CLI's --exact caches reproduced bit for bit by train, mismatch-report and audit."""

import json
from unittest.mock import ANY
import math
import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from opdcache.backends.base import GenerateRequest, SamplingConfig, ScoreRequest
from opdcache.backends.exact import ExactBackend
from opdcache.cli.main import main
from opdcache.exact import arith as X


@pytest.fixture(autouse=True)
def _threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


# ----------------------------------------------------------------------------------------------- primitives
def _reference_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The definition, plainly: float64 products, summed in the fold's order one output at a time, rounded once."""
    out = torch.empty(a.shape[0], b.shape[1])
    for m in range(a.shape[0]):
        for n in range(b.shape[1]):
            terms = (a[m].double() * b[:, n].double()).tolist()
            width = 1 << max(0, (len(terms) - 1).bit_length())
            terms += [0.0] * (width - len(terms))
            while len(terms) > 1:
                half = len(terms) // 2
                terms = [terms[i] + terms[i + half] for i in range(half)]
            out[m, n] = terms[0]
    return out + 0.0


@pytest.mark.parametrize("seed", range(6))
def test_linear_equals_its_definition_on_random_shapes(seed):
    g = torch.Generator().manual_seed(seed)
    M, K, N = (int(x) for x in torch.randint(1, 40, (3,), generator=g))
    scale = 10.0 ** float(torch.randint(-3, 4, (1,), generator=g))
    a, w = torch.randn(M, K, generator=g) * scale, torch.randn(N, K, generator=g)
    assert torch.equal(X.linear(a, w), _reference_dot(a, w.T))


def test_fast_path_and_fallback_agree_where_rounding_is_close():
    # sums that land next to a float32 rounding boundary force the fold; the result must still be the definition's
    a = torch.tensor([[1.0, 2.0 ** -24, 2.0 ** -48, -(2.0 ** -48)]])
    w = torch.ones(1, 4)
    assert torch.equal(X.linear(a, w), _reference_dot(a, w.T))
    big = torch.randn(7, 3000, generator=torch.Generator().manual_seed(3))  # width 3000: ~1% of outputs take the fold
    w = torch.randn(20, 3000, generator=torch.Generator().manual_seed(4))
    assert torch.equal(X.linear(big, w), _reference_dot(big, w.T))


def test_matmul_is_invariant_to_rows_batch_and_threads():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 96, generator=g), torch.randn(80, 96, generator=g)
    full = X.linear(x, w)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for rows in (slice(0, 1), slice(3, 10), slice(0, 64)):
            assert torch.equal(X.linear(x[rows], w), full[rows])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_primitive_and_composite_gives_a_row_the_same_bits_in_any_batch(dtype):
    """The CPU arithmetic's primitives and the decoder's composites built from them (RMSNorm, attention's softmax, the
    rotary embedding): a row alone, among 7 and among 64 gets the same bits (names the ones that do not); the GPU
    arithmetic passes the same check (tests/test_invariant.py, tests/test_gpu.py)."""
    from exact_checks import primitives_that_vary

    assert primitives_that_vary(X, "cpu", dtype) == []


def test_fold_ignores_appended_zeros():
    t = torch.randn(5, 37, dtype=torch.float64)
    for extra in (1, 27, 91):
        assert torch.equal(X.fold(t), X.fold(torch.nn.functional.pad(t, (0, extra))))


def test_batched_matmul_ignores_masked_keys():
    # attention's p @ v over t + 1 keys equals the same row inside a longer, zero-padded key set (the KV cache vs a full forward)
    g = torch.Generator().manual_seed(1)
    p, v = torch.rand(2, 3, 1, 9, generator=g), torch.randn(2, 3, 9, 16, generator=g)
    longer_p = torch.cat([p, torch.zeros(2, 3, 1, 30)], -1)
    longer_v = torch.cat([v, torch.randn(2, 3, 30, 16, generator=g)], 2)
    assert torch.equal(X.matmul(p, v), X.matmul(longer_p, longer_v))


@pytest.mark.parametrize("name,fn", [("exp", math.exp), ("log", math.log), ("silu", lambda x: x / (1 + math.exp(-x))),
                                     ("rsqrt", lambda x: 1 / math.sqrt(x))])
def test_unary_is_round32_of_libm_whatever_the_position(name, fn):
    x = torch.rand(3001, generator=torch.Generator().manual_seed(2)) * 20 + 1e-3
    if name in ("exp", "silu"):
        x = x - 10
    ref = torch.tensor([fn(v) for v in x.double().tolist()], dtype=torch.float64).float()
    assert torch.equal(X.unary(name, x), ref)
    assert torch.equal(torch.cat([X.unary(name, x[i: i + 13]) for i in range(0, 3001, 13)]), ref)


def test_sum_and_gradients():
    t = torch.randn(7, 300, dtype=torch.float32, requires_grad=True)
    s = X.sum_last(t)
    assert torch.equal(s.detach(), X.fold(t.detach().double()).float() + 0.0)
    s.sum().backward()
    assert torch.equal(t.grad, torch.ones_like(t))
    x = torch.randn(5, 8, requires_grad=True)
    w = torch.randn(3, 8, requires_grad=True)
    X.linear(x, w).sum().backward()
    assert torch.allclose(x.grad, torch.ones(5, 3) @ w.detach()) and torch.allclose(w.grad, torch.ones(3, 5) @ x.detach())


def test_log_softmax_over_slices_with_a_slice_masked_whole():
    # a top-p nucleus can leave a whole 8,192-column slice at -inf: it must add nothing, not NaN
    from opdcache.exact import head as H

    z = torch.randn(3, 3 * H.VOCAB_BLOCK + 17, generator=torch.Generator().manual_seed(5)) * 3
    z[:, H.VOCAB_BLOCK: 2 * H.VOCAB_BLOCK] = float("-inf")
    z[1, : H.VOCAB_BLOCK] = float("-inf")
    lp = H.log_softmax(z)
    ref = torch.log_softmax(z.double(), -1)
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(lp), finite)
    assert (lp[finite].double() - ref[finite]).abs().max() < 1e-5
    u = torch.rand(3, 50, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    drawn = H.draw(lp, u)
    assert torch.isfinite(lp.gather(1, drawn)).all()


def test_log_softmax_in_one_call_equals_slice_by_slice():
    from exact_checks import log_softmax_slice_by_slice, wide_logits

    from opdcache.exact import head as H

    for z in (wide_logits(), wide_logits(7)[[0, 2], : H.VOCAB_BLOCK - 5], wide_logits(8)[[0, 2], : 2 * H.VOCAB_BLOCK]):
        assert torch.equal(H.log_softmax(z), log_softmax_slice_by_slice(z, X))


# ----------------------------------------------------------------------------------------------- the engine
def _requests(n, seed=0, vocab=64):
    rng = np.random.default_rng(seed)
    return [GenerateRequest(prompt_ids=rng.integers(2, vocab, size=int(rng.integers(2, 14))).tolist(), seed=i) for i in range(n)]


FIELDS = ("response_ids", "sampling_logprobs", "ref_logprobs", "ref_topk_ids", "ref_topk_logprobs", "mc_ids", "mc_sampling_logprobs")


def _same_generations(a, b):
    for x, y in zip(a, b):
        for f in FIELDS:
            assert np.array_equal(getattr(x, f), getattr(y, f)), f


@pytest.mark.slow
@pytest.mark.parametrize("model,dtype,quantize", [("student", "float32", None), ("teacher", "float32", None),
                                                  ("teacher", "bfloat16", None), ("student", "float32", "w4a16:g32")])
def test_generation_is_invariant_and_equals_scoring(weights, model, dtype, quantize):
    engine = ExactBackend(weights / model, dtype=dtype, quantize=quantize)
    reqs = _requests(32, seed=len(model))
    sampling = SamplingConfig(temperature=0.9, top_p=0.9, max_new_tokens=20, ref_top_k=4, mc_samples=2)
    engine.generate_batch_size = 32
    torch.set_num_threads(2)
    base = engine.generate(reqs, sampling)
    # batch 1 on the first 8 rows: a row's bits do not depend on the others, and a one-row decode costs nearly a whole batch
    for batch, threads, order in ((7, 1, list(range(len(reqs)))[::-1]), (1, 2, list(range(8)))):
        engine.generate_batch_size = batch
        torch.set_num_threads(threads)
        again = engine.generate([reqs[i] for i in order], sampling)
        _same_generations([base[i] for i in order], again)
    # teacher-forced scoring of the same tokens (full forward, right padding) equals what decoding stored (KV cache)
    score_reqs = [ScoreRequest(r.prompt_ids, g.response_ids, ref_topk_ids=g.ref_topk_ids) for r, g in zip(reqs, base)]
    for budget in (4096, 40):
        engine.max_batch_tokens = budget
        scores = engine.score(score_reqs, top_k=4)
        for sc, g in zip(scores, base):
            assert np.array_equal(sc.logprobs, g.ref_logprobs)
            assert np.array_equal(sc.ref_topk_logprobs, g.ref_topk_logprobs)
            assert np.array_equal(sc.topk_ids, g.ref_topk_ids)
    assert sum(len(g.response_ids) for g in base) > 150


def test_padding_does_not_change_a_row(weights):
    # the engine takes unpadded id lists and right-pads internally (a row's token t at position t, keys at their own
    # positions), so how much padding a row gets -- none alone, some beside a longer row, a lot beside a much longer
    # one -- changes none of its bits; there is no left-padded layout to differ from (the transformers engine's
    # left padding for generation is exactly what this removes)
    engine = ExactBackend(weights / "teacher")
    row = torch.tensor([[5, 9, 13, 2, 7]])
    alone = engine.decoder.forward(row)[0]
    for pad_to in (8, 40):
        longer = torch.randint(2, 64, (1, pad_to), generator=torch.Generator().manual_seed(pad_to))
        batch = torch.zeros(2, pad_to, dtype=torch.long)
        batch[0, :5], batch[1] = row[0], longer[0]
        assert torch.equal(engine.decoder.forward(batch)[0, :5], alone)
        flipped = batch.flip(0)  # the row's position in the batch
        assert torch.equal(engine.decoder.forward(flipped)[1, :5], alone)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_sequences_have_their_padded_rows_bits(weights, dtype):
    """forward_packed (train --pack --exact): sequences laid end to end, each at positions 0, 1, ..., give token for
    token the bits forward gives them as right-padded rows of a batch."""
    from opdcache.backends.loading import load_model
    from opdcache.exact.decoder import ExactDecoder

    from exact_checks import check_packed_has_padded_bits

    check_packed_has_padded_bits(ExactDecoder(load_model(weights / "student", "float32", "cpu"), dtype))


def test_exact_forward_is_the_models_maths(weights):
    from opdcache.backends.loading import load_model

    for name in ("student", "teacher"):
        model = load_model(weights / name, "float32", "cpu")
        ids = torch.randint(2, 64, (3, 17), generator=torch.Generator().manual_seed(0))
        ref = model.model(input_ids=ids).last_hidden_state
        ours = ExactBackend.from_model(model).decoder.forward(ids)
        assert (ours - ref).abs().max() < 1e-4


def test_unsupported_models_are_refused_in_one_line():
    from types import SimpleNamespace

    from opdcache.errors import ConfigError
    from opdcache.exact.decoder import check_supported

    with pytest.raises(ConfigError, match="--exact supports the llama"):
        check_supported(SimpleNamespace(model_type="gpt2"))
    with pytest.raises(ConfigError, match="rotary"):
        check_supported(SimpleNamespace(model_type="llama", rope_parameters={"rope_type": "yarn"}))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a usable GPU")
def test_exact_on_a_gpu_without_one_is_refused_before_the_model_loads(tmp_path, opd_prompts, capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    code, out = _cli(["build-rollouts", "--model", tmp_path / "no-model-here", "--prompts", opd_prompts, "--out",
                      tmp_path / "c", "--exact", "--device", "cuda"], capsys)
    assert code == 2 and "Traceback" not in out
    line = out.strip().splitlines()[-1]
    assert "--exact --device cuda runs the batch-invariant GPU kernels:" in line and "--device cpu" in line
    assert ("triton" in line) or ("no CUDA GPU" in line)


def test_exact_float32_on_a_gpu_is_refused_before_the_model_loads(tmp_path, opd_prompts, capsys):
    from opdcache.backends.exact import FLOAT32_ON_GPU

    code, out = _cli(["build-rollouts", "--model", tmp_path / "no-model-here", "--prompts", opd_prompts, "--out",
                      tmp_path / "c", "--exact", "--device", "cuda", "--dtype", "float32"], capsys)
    assert code == 2 and "Traceback" not in out
    assert out.strip().splitlines()[-1].endswith(FLOAT32_ON_GPU)
    assert "--dtype bfloat16" in FLOAT32_ON_GPU and "--exact on the CPU" in FLOAT32_ON_GPU


def test_a_table_of_the_gpu_arithmetic_is_replayed_only_on_a_gpu(tmp_path, monkeypatch):
    from opdcache.backends import engine_for_table
    from opdcache.errors import ConfigError
    from opdcache.exact import GPU_ARITHMETIC

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if torch.cuda.is_available():
        pytest.skip("checks the refusal on a machine without a GPU")
    with pytest.raises(ConfigError, match=f"the rollouts was computed in {GPU_ARITHMETIC}, the GPU's batch-invariant arithmetic: "
                                          "it re-computes on a CUDA GPU"):
        engine_for_table({"exact": {"arithmetic": GPU_ARITHMETIC}}, tmp_path, "the rollouts")
    with pytest.raises(ConfigError, match="this opdcache implements 'opdcache-exact-1', 'opdcache-invariant-2'"):
        engine_for_table({"exact": {"arithmetic": "opdcache-exact-0"}}, tmp_path, "the rollouts")
    with pytest.raises(ConfigError, match="computed in 'opdcache-invariant-1', this opdcache implements"):  # the previous GPU arithmetic
        engine_for_table({"exact": {"arithmetic": "opdcache-invariant-1"}}, tmp_path, "the rollouts")


# ----------------------------------------------------------------------------------------------- the CLI
def _cli(args, capsys):
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in args])
    out = capsys.readouterr()
    return e.value.code, out.out + out.err


@pytest.fixture(scope="module")
def exact_cache(tmp_path_factory, weights, write_ragged_prompts):
    """256 exact rollouts of prompts of 5-11 tokens (1- to 4-digit problems: padding in every generation and scoring
    batch, responses of 9-12 tokens), scored exactly."""
    root = tmp_path_factory.mktemp("exact")
    prompts = write_ragged_prompts(root / "opd.jsonl", (8, 16, 20, 20))
    out = root / "cache"
    for args in (["build-rollouts", "--model", weights / "student", "--prompts", prompts, "--out", out, "--num-shards", 2,
                  "--samples", 4, "--temperature", 0.9, "--top-p", 0.95, "--max-new-tokens", 12, "--ref-top-k", 4, "--mc-samples", 2,
                  "--sft-teacher", weights / "teacher", "--exact", "--batch-size", 48],
                 ["score-teacher", out, "--teacher", weights / "teacher", "--store", "logprob,topk,sampled,hidden", "--top-k", 6,
                  "--topk-mass", "1e-3", "--topk-precision", "float16", "--samples-per-position", 4, "--exact"]):
        with pytest.raises(SystemExit) as e:
            main([str(a) for a in args])
        assert e.value.code in (0, None)
    return out


def test_exact_cache_reproduces_everywhere(exact_cache, tmp_path, weights, capsys):
    manifest = json.loads((exact_cache / "opdcache.json").read_text())
    rollouts = manifest["tables"]["rollouts"]
    assert sum(s["rows"] for s in rollouts["shards"]) == 256
    assert rollouts["model"]["engine"] == "exact" and rollouts["model"]["exact"]["arithmetic"] == "opdcache-exact-1"
    import pyarrow.parquet as pq

    table = pq.read_table(exact_cache / rollouts["shards"][0]["path"], columns=["prompt_ids", "response_ids"])
    assert len({len(p) for p in table["prompt_ids"].to_pylist()}) > 2  # padding in every batch: what the bits must not see
    assert len({len(r) for r in table["response_ids"].to_pylist()}) > 1
    code, out = _cli(["mismatch-report", exact_cache, "--exact", "--out", tmp_path / "mm", "--no-png", "--max-abs-delta", 0], capsys)
    assert code in (0, None), out
    rep = json.loads((tmp_path / "mm" / "mismatch_report.json").read_text())
    assert set(rep["sections"]) == {"rollouts, exact", "teachers/teacher, exact"}
    assert all(s["max_abs_delta"] == 0 for s in rep["sections"].values())
    code, out = _cli(["audit", exact_cache, "--rows", 24, "--json"], capsys)
    assert code in (0, None), out
    report = json.loads(out[out.index("{"):])
    for table in report["tables"]:
        assert table["passed"] and all(c["exact"] == c["values"] > 0 for c in table["columns"].values()), table
    # the learner: at step 1 every importance weight is exactly 1
    code, out = _cli(["train", "--model", weights / "student", "--cache", exact_cache, "--loss", "lightning", "--steps", 1,
                      "--batch-size", 32, "--out", tmp_path / "run", "--exact"], capsys)
    assert code in (0, None), out
    step = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert step["is_weight_mean"] == 1.0 and step["is_weight_std"] == 0.0 and step["k1"] == 0.0
    code, out = _cli(["train", "--model", weights / "student", "--cache", exact_cache, "--loss", "lightning", "--steps", 1,
                      "--batch-size", 32, "--out", tmp_path / "packed", "--exact", "--pack"], capsys)
    assert code in (0, None), out  # packed batches (no padding in the forward): the same bits
    packed = json.loads((tmp_path / "packed" / "metrics.jsonl").read_text().splitlines()[0])
    assert packed == {**step, "seconds": ANY, "grad_norm": pytest.approx(step["grad_norm"], rel=1e-5)}  # the backward's sums: rounding


def test_audit_catches_a_changed_value(exact_cache, tmp_path, capsys):
    root = tmp_path / "cache"
    shutil.copytree(exact_cache, root)
    path = next((root / "teachers" / "teacher").glob("*.parquet"))
    table = pq.read_table(path)
    lp = table["logprobs"].to_pylist()
    lp[0][0] = np.nextafter(np.float32(lp[0][0]), np.float32(0))  # one ulp: invisible to any tolerance
    table = table.set_column(table.schema.get_field_index("logprobs"), "logprobs",
                             __import__("pyarrow").array(lp, table.schema.field("logprobs").type))
    pq.write_table(table, path)
    code, out = _cli(["audit", root, "--table", "teacher", "--rows", 256], capsys)
    assert code == 1 and "FAIL" in out and "Traceback" not in out


def test_audit_names_a_missing_model_in_one_line(exact_cache, tmp_path, capsys):
    root = tmp_path / "cache"
    shutil.copytree(exact_cache, root)
    manifest = json.loads((root / "opdcache.json").read_text())
    missing = str(tmp_path / "gone")
    manifest["tables"]["rollouts"]["model"]["name_or_path"] = missing
    (root / "opdcache.json").write_text(json.dumps(manifest))
    code, out = _cli(["audit", root, "--table", "rollouts"], capsys)
    lines = [line for line in out.strip().splitlines() if line.startswith("error")]
    assert code == 2 and len(lines) == 1 and "pass --model PATH" in lines[0] and "Traceback" not in out
    code, out = _cli(["audit", root, "--rows", 0], capsys)
    assert code == 2 and "--rows must be a positive" in out


def test_resume_without_exact_is_refused(exact_cache, tmp_path, weights, capsys):
    from opdcache.demo.task import write_prompts

    prompts = write_prompts(tmp_path / "p.jsonl", "opd", 64)
    out = tmp_path / "cache"
    shutil.copytree(exact_cache, out)
    code, text = _cli(["build-rollouts", "--model", weights / "student", "--prompts", prompts, "--out", out, "--num-shards", 2,
                       "--samples", 4, "--temperature", 0.9, "--top-p", 0.95, "--max-new-tokens", 12, "--ref-top-k", 4,
                       "--mc-samples", 2, "--sft-teacher", weights / "teacher", "--batch-size", 48], capsys)
    assert code == 2 and "exact" in text and "Traceback" not in text


@pytest.mark.parametrize("settings", [["--dtype", "bfloat16"], ["--quantize", "w4a16:g32"]])
def test_bfloat16_and_w4a16_caches_reproduce(tmp_path, weights, settings, capsys):
    from opdcache.demo.task import write_prompts

    prompts = write_prompts(tmp_path / "p.jsonl", "opd", 16)
    out = tmp_path / "cache"
    code, text = _cli(["build-rollouts", "--model", weights / "student", "--prompts", prompts, "--out", out, "--num-shards", 2,
                       "--samples", 4, "--temperature", 0.9, "--top-p", 0.9, "--max-new-tokens", 10, "--exact", *settings], capsys)
    assert code in (0, None), text
    record = json.loads((out / "opdcache.json").read_text())["tables"]["rollouts"]["model"]
    assert record["engine"] == "exact" and (record["dtype"] == "bfloat16" if "--dtype" in settings else record["quantization"].startswith("w4a16:g32:sym"))
    code, text = _cli(["mismatch-report", out, "--exact", "--no-png", "--out", tmp_path / "mm", "--max-abs-delta", 0], capsys)
    assert code in (0, None), text
    rep = json.loads((tmp_path / "mm" / "mismatch_report.json").read_text())
    assert rep["sections"]["rollouts, exact"]["max_abs_delta"] == 0
    code, text = _cli(["audit", out, "--rows", 8], capsys)
    assert code in (0, None) and "PASS" in text, text
    if "--dtype" in settings:  # the learner takes the rollouts' dtype (--dtype auto), and refuses another one
        code, text = _cli(["score-teacher", out, "--teacher", weights / "teacher", "--store", "logprob", "--exact"], capsys)
        assert code in (0, None), text
        code, text = _cli(["train", "--model", weights / "student", "--cache", out, "--loss", "lightning", "--steps", 1,
                           "--batch-size", 32, "--out", tmp_path / "run", "--exact"], capsys)
        assert code in (0, None), text
        step = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
        assert step["is_weight_mean"] == 1.0 and step["is_weight_std"] == 0.0, step
        code, text = _cli(["train", "--model", weights / "student", "--cache", out, "--loss", "lightning", "--steps", 1,
                           "--out", tmp_path / "run2", "--exact", "--dtype", "float32"], capsys)
        errors = [line for line in text.splitlines() if line.startswith("error")]
        assert code == 2 and len(errors) == 1 and "pass --dtype bfloat16" in errors[0] and "Traceback" not in text, text


def test_injected_mismatch_is_recorded_measured_and_replayed(tmp_path, weights, capsys):
    from opdcache.demo.task import write_prompts

    prompts = write_prompts(tmp_path / "p.jsonl", "opd", 16)
    out = tmp_path / "cache"
    code, text = _cli(["build-rollouts", "--model", weights / "student", "--prompts", prompts, "--out", out, "--num-shards", 1,
                       "--samples", 4, "--max-new-tokens", 10, "--exact", "--inject-mismatch", "logit-noise:0.5"], capsys)
    assert code in (0, None), text
    record = json.loads((out / "opdcache.json").read_text())["tables"]["rollouts"]["model"]
    assert record["exact"]["inject"] == "logit-noise:0.5"
    code, text = _cli(["mismatch-report", out, "--exact", "--no-png", "--out", tmp_path / "mm"], capsys)
    rep = json.loads((tmp_path / "mm" / "mismatch_report.json").read_text())["sections"]["rollouts, exact"]
    assert rep["max_abs_delta"] > 0.05 and rep["k3"] > 0  # the injected noise, measured against the exact reference
    code, text = _cli(["audit", out, "--rows", 16], capsys)
    assert code in (0, None) and "PASS" in text, text  # the injected cache itself is replayed bit for bit
    code, text = _cli(["build-rollouts", "--model", weights / "student", "--prompts", prompts, "--out", tmp_path / "x",
                       "--inject-mismatch", "logit-noise:0.5"], capsys)
    assert code == 2 and "add --exact" in text
    code, text = _cli(["build-rollouts", "--model", weights / "student", "--prompts", prompts, "--out", tmp_path / "x", "--exact",
                       "--inject-mismatch", "logit-noise:-1"], capsys)
    assert code == 2 and "0 < SIGMA <= 10" in text


def test_validate_requires_the_arithmetic_record(exact_cache, tmp_path, capsys):
    root = tmp_path / "cache"
    shutil.copytree(exact_cache, root)
    manifest = json.loads((root / "opdcache.json").read_text())
    del manifest["tables"]["rollouts"]["model"]["exact"]["torch"]
    (root / "opdcache.json").write_text(json.dumps(manifest))
    code, text = _cli(["validate", root], capsys)
    assert code == 1 and "lacks torch" in text


@pytest.mark.parametrize("record", ["made-up", 7, "string"], ids=["unknown-name", "number", "record-a-string"])
def test_an_exact_record_of_another_arithmetic_or_type_is_one_line_everywhere(exact_cache, weights, tmp_path, capsys, record):
    root = tmp_path / "cache"
    shutil.copytree(exact_cache, root)
    manifest = json.loads((root / "opdcache.json").read_text())
    if record == "string":
        manifest["tables"]["rollouts"]["model"]["exact"] = "cpu-float64"
    else:
        manifest["tables"]["rollouts"]["model"]["exact"]["arithmetic"] = record
    (root / "opdcache.json").write_text(json.dumps(manifest))
    code, text = _cli(["validate", root], capsys)
    assert code == 1 and ("model/exact is 'cpu-float64', not a record naming its arithmetic" in text if record == "string"
                          else "not a record naming its arithmetic" in text if record == 7
                          else "which this opdcache does not implement" in text), text
    for args in (["train", "--model", weights / "student", "--cache", root, "--exact", "--steps", "1", "--batch-size", "4",
                  "--out", tmp_path / "run", "--no-progress"],
                 ["audit", root, "--table", "rollouts", "--rows", "2"]):
        code, text = _cli(args, capsys)
        lines = [l for l in text.strip().splitlines() if l.startswith("error")]
        assert code in (1, 2) and "Traceback" not in text and len(lines) == 1, (args[0], text[-2000:])


def test_a_consumed_batch_that_cannot_be_sampled_again_is_refused(tmp_path, weights, opd_prompts):
    from opdcache.asyncopd.config import AsyncConfig, learner
    from opdcache.asyncopd.run import _check_regenerable
    from opdcache.errors import ResumeError
    from opdcache.inputs.prompts import PromptConfig

    cfg = AsyncConfig(learner=learner(weights / "student", steps=6, batch_size=2), teacher=weights / "teacher",
                      prompts=PromptConfig(opd_prompts), out=tmp_path / "run", staleness=2)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "ledger.jsonl").write_text("".join(json.dumps({"batch": b, "student_version": max(0, b - 2), "consumed_at_step": b + 1, "time": 1.0}) + "\n" for b in range(5)))
    # batches 0-2 were sampled by --model itself (version 0) and can be sampled again; batch 3 needs snapshot v1
    with pytest.raises(ResumeError, match="batch 3 was consumed but its rollout shard .* is missing, and the snapshot v1"):
        _check_regenerable(cfg)


@pytest.mark.slow
def test_async_exact_at_staleness_zero_has_weights_of_exactly_one(tmp_path, weights, ragged_prompts, capsys):
    """async --exact: the rollout, teacher and learner stages share one arithmetic, so at K = 0 the learner's recompute of
    the snapshot that sampled each batch gives old-to-current weights of exactly 1 (papers/001's rho), at every step
    (prompts of 5-11 tokens: padded batches at every stage)."""
    code, text = _cli(["async", "--model", weights / "student", "--teacher", weights / "teacher", "--prompts", ragged_prompts,
                       "--staleness", 0, "--steps", 2, "--batch-size", 8, "--max-new-tokens", 10, "--out", tmp_path / "run", "--exact"], capsys)
    assert code in (0, None), text
    steps = [json.loads(line) for line in (tmp_path / "run" / "learner" / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 2 and steps[1]["student_version"] == 1
    assert all(s["rho_mean"] == 1.0 and s["rho_std"] == 0.0 and s["rho_max"] == 1.0 and s["k1"] == 0.0 for s in steps)
    record = json.loads((tmp_path / "run" / "cache" / "opdcache.json").read_text())["tables"]["rollouts"]["model"]
    assert record["engine"] == "exact"


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_grouped_query_attention_is_the_models_maths_and_decodes_as_it_forwards(family):
    """Four query heads on two key heads (the demo's models have one each): the exact forward is transformers' maths,
    and KV-cache decoding and a row alone give the full forward's bits."""
    from exact_checks import check_grouped_query_decoder

    check_grouped_query_decoder(family, X)


def test_the_canonical_top_k_by_one_sort_equals_the_candidate_path():
    """The GPU's path (one stable sort, no host read) and the CPU's (top-k, then the tied candidates ordered by id) give
    the same values and ids, ties included (bfloat16 logits tie often)."""
    from opdcache.exact.head import canonical_top_k, canonical_top_k_by_sort

    g = torch.Generator().manual_seed(0)
    for values in (torch.randn(9, 300, generator=g), torch.randint(-3, 3, (9, 300), generator=g).float(),
                   torch.randn(9, 300, generator=g).bfloat16().float()):
        for k in (1, 5, 64, 300):
            a, b = canonical_top_k(values, k), canonical_top_k_by_sort(values, k)
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), k


def test_train_exact_on_rollouts_of_the_gpu_arithmetic_without_a_gpu_is_one_line(hf_cache, weights, tmp_path, monkeypatch):
    from opdcache.errors import ConfigError
    from opdcache.exact import GPU_ARITHMETIC
    from opdcache.training.train import TrainConfig, run_train

    if torch.cuda.is_available():
        pytest.skip("checks the refusal on a machine without a GPU")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cache = tmp_path / "cache"
    shutil.copytree(hf_cache, cache)
    manifest = json.loads((cache / "opdcache.json").read_text())
    manifest["tables"]["rollouts"]["model"]["exact"] = {"arithmetic": GPU_ARITHMETIC, "dtype": "float32"}
    (cache / "opdcache.json").write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match=f"--exact: {cache}'s rollouts was computed in {GPU_ARITHMETIC}, the GPU's "
                                          "batch-invariant arithmetic: it re-computes on a CUDA GPU"):
        run_train(TrainConfig(model=weights / "student", cache=cache, out=tmp_path / "run", loss="lightning", steps=1, exact=True))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
