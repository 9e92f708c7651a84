"""The transformers engine: every stored number means what the schema says, checked against a fresh
full-vocabulary float32 forward; scoring is exact, and bit-identical across batchings in deterministic mode."""

import random

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from opdcache.backends.base import GenerateRequest, SamplingConfig, ScoreRequest
from opdcache.backends.hf import sampling_logprobs, TransformersBackend
from opdcache.demo.evaluate import chat_prompt_ids
from opdcache.format import shards
from opdcache.format.cache import Cache
from opdcache.format.validate import validate
from tolerance import assert_close_within, logprob_tolerance


def _full_logits(model, prompt, response):
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    return logits[len(prompt) - 1: len(prompt) - 1 + len(response)]  # [T, V]: position t predicts response[t]


@pytest.fixture(scope="module")
def prompts(weights):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(weights / "student")
    # prompts of three lengths: a batch of them is left-padded (prompts[3] among the first three as well)
    return [chat_prompt_ids(tok, p) for p in ("347+589", "1+2", "999+999", "12+305", "555+445", "10+990", "731+064")]


def test_generated_values_mean_what_the_schema_says(student, prompts):
    # generation values come from incremental (KV-cache) decoding: equal to a full forward up to float32 rounding
    tol = dict(rtol=1e-5, atol=1e-5)
    s = SamplingConfig(temperature=0.7, top_p=0.9, max_new_tokens=30, ref_top_k=4, mc_samples=5)
    gens = student.generate([GenerateRequest(p, seed=i) for i, p in enumerate(prompts)], s)
    for p, g in zip(prompts, gens):
        logits = _full_logits(student.model, p, g.response_ids)
        ref = torch.log_softmax(logits, -1)
        q = sampling_logprobs(logits, 0.7, 0.9)
        resp = torch.as_tensor(g.response_ids, dtype=torch.long)
        np.testing.assert_allclose(g.ref_logprobs, ref.gather(1, resp[:, None]).squeeze(1), **tol)
        np.testing.assert_allclose(g.sampling_logprobs, q.gather(1, resp[:, None]).squeeze(1), **tol)
        assert torch.isfinite(q.gather(1, resp[:, None])).all(), "a sampled token lies outside the top-p nucleus"
        # the stored top-4 is the full forward's: each id's log-prob there is the value at its rank (ids within float32's
        # rounding of each other may stand in either order), no id twice
        ref_ids = torch.as_tensor(g.ref_topk_ids, dtype=torch.long)
        np.testing.assert_allclose(ref.gather(1, ref_ids).numpy(), ref.topk(4, -1).values.numpy(), **tol)
        assert all(len(set(row)) == 4 for row in ref_ids.tolist())
        np.testing.assert_allclose(g.ref_topk_logprobs, ref.topk(4, -1).values.numpy(), **tol)
        mc = torch.as_tensor(g.mc_ids, dtype=torch.long)
        np.testing.assert_allclose(g.mc_sampling_logprobs, q.gather(1, mc).numpy(), **tol)
        assert np.isfinite(g.mc_sampling_logprobs).all()
        assert g.finish_reason in ("stop", "length")
        if g.finish_reason == "stop":
            assert g.response_ids[-1] == 1  # EOS is kept


def test_generation_passes_the_cache_under_the_installed_transformers_name(student, prompts):
    """transformers 5.2x renamed the decoder's past_key_values to cache (the old name warns on every step, which the
    demo printed): generation uses whichever the installed decoder takes and warns nothing."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a FutureWarning (or any warning) fails the test
        gens = student.generate([GenerateRequest(p, seed=i) for i, p in enumerate(prompts[:2])], SamplingConfig(max_new_tokens=5))
    assert all(len(g.response_ids) >= 1 for g in gens)


def test_greedy_has_zero_sampling_logprobs_and_follows_argmax(student, prompts):
    g = student.generate([GenerateRequest(prompts[0], seed=0)], SamplingConfig(temperature=0, max_new_tokens=20))[0]
    assert (g.sampling_logprobs == 0).all()
    logits = _full_logits(student.model, prompts[0], g.response_ids)
    np.testing.assert_array_equal(logits.argmax(-1).numpy(), g.response_ids)


def test_cut_responses_keep_finish_reason_length(student, prompts):
    g = student.generate([GenerateRequest(prompts[0], seed=0)], SamplingConfig(max_new_tokens=3))[0]
    assert g.finish_reason == "length" and len(g.response_ids) == 3


def test_a_sample_does_not_depend_on_its_batch(student, prompts):
    s = SamplingConfig(temperature=1.0, max_new_tokens=25)
    alone = student.generate([GenerateRequest(prompts[3], seed=42)], s)[0]
    batch = student.generate([GenerateRequest(p, seed=i) for i, p in enumerate(prompts)][:3] + [GenerateRequest(prompts[3], seed=42)], s)[-1]
    np.testing.assert_array_equal(alone.response_ids, batch.response_ids)
    np.testing.assert_allclose(alone.sampling_logprobs, batch.sampling_logprobs, atol=1e-5)


@pytest.mark.parametrize("steps_ahead", [7, 1000])
def test_uniforms_computed_ahead_give_the_step_by_step_samples(student, prompts, monkeypatch, steps_ahead):
    """Computing each row's uniforms several steps at a time must reproduce the plain step-by-step computation
    exactly: same tokens, same stored values, same finish reasons."""
    import opdcache.backends.hf as hf

    s = SamplingConfig(temperature=0.9, top_p=0.95, max_new_tokens=25, ref_top_k=2, mc_samples=2)
    reqs = [GenerateRequest(p, seed=10 + i) for i, p in enumerate(prompts)]
    monkeypatch.setattr(hf, "UNIFORM_BLOCK_STEPS", 1)  # one step at a time: the plain computation
    plain = student.generate(reqs, s)
    monkeypatch.setattr(hf, "UNIFORM_BLOCK_STEPS", steps_ahead)
    ahead = student.generate(reqs, s)
    for a, b in zip(plain, ahead):
        assert a.finish_reason == b.finish_reason
        for field in ("response_ids", "sampling_logprobs", "ref_logprobs", "ref_topk_ids", "ref_topk_logprobs", "mc_ids"):
            np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
    assert len({tuple(g.response_ids) for g in plain}) == len(plain)  # each row sampled its own response


def test_generation_batch_size_must_be_positive():
    from opdcache.errors import ConfigError
    from opdcache.backends import EngineConfig

    with pytest.raises(ConfigError, match="--batch-size must be at least 1, got 0"):
        EngineConfig(generate_batch_size=0)


def test_stored_teacher_values_equal_a_fresh_float32_forward(hf_cache, weights):
    """Each stored value against a lone float32 forward, within what two float32 evaluation orders may differ by at
    that position (tests/tolerance.py: measured against a float64 forward of the same weights, so the bound is the
    same on any CPU's kernels)."""
    model = AutoModelForCausalLM.from_pretrained(weights / "teacher", dtype=torch.float32).eval()
    model64 = AutoModelForCausalLM.from_pretrained(weights / "teacher", dtype=torch.float64).eval()
    cache = Cache(hf_cache)
    same = total = 0
    for rpath, tpath in zip(cache.shard_paths("rollouts"), cache.shard_paths("teachers/teacher")):
        r, t = shards.read_table(rpath), shards.read_table(tpath)
        off = shards.list_offsets(r["response_ids"])
        resp, ref_ids, mc_ids = (shards.token_values(r[c]) for c in ("response_ids", "ref_topk_ids", "mc_ids"))
        cols = {c: shards.token_values(t[c]) for c in ("logprobs", "logsumexp", "topk_ids", "topk_logprobs", "ref_topk_logprobs", "mc_logprobs")}
        for i, prompt in enumerate(r["prompt_ids"].to_pylist()):
            sl = slice(off[i], off[i + 1])
            logits = _full_logits(model, prompt, resp[sl])
            tol = logprob_tolerance(logits, _full_logits(model64, prompt, resp[sl]), width=1)  # [T, 1]
            logp = torch.log_softmax(logits, -1)
            sampled = logp.gather(1, torch.as_tensor(resp[sl], dtype=torch.long)[:, None]).squeeze(1)
            assert_close_within(cols["logprobs"][sl], sampled, tol[:, 0], "logprobs")
            assert_close_within(cols["logsumexp"][sl], torch.logsumexp(logits, -1), tol[:, 0], "logsumexp")
            # the stored top-6 is the fresh top-6: each stored id's fresh log-prob is the fresh value at its rank (two ids
            # within float32's rounding of each other may stand in either order), and no id twice in a row
            ids = torch.as_tensor(cols["topk_ids"][sl], dtype=torch.long)
            assert_close_within(logp.gather(1, ids), logp.topk(6, -1).values, tol, "the stored top-k ids' fresh log-probs")
            assert all(len(set(row)) == 6 for row in ids.tolist())
            same += int((ids == logp.topk(6, -1).indices).sum())
            total += ids.numel()
            assert_close_within(cols["topk_logprobs"][sl], logp.topk(6, -1).values, tol, "topk_logprobs")
            assert_close_within(cols["ref_topk_logprobs"][sl], logp.gather(1, torch.as_tensor(ref_ids[sl], dtype=torch.long)), tol, "ref_topk_logprobs")
            assert_close_within(cols["mc_logprobs"][sl], logp.gather(1, torch.as_tensor(mc_ids[sl], dtype=torch.long)), tol, "mc_logprobs")
    assert total > 1000 and same / total > 0.99  # ties are rare: nearly every stored id is the fresh id at its rank


def test_the_scored_cache_validates_including_hidden_reconstruction(hf_cache):
    assert validate(hf_cache) == []
    m = Cache(hf_cache).manifest
    assert m["lineage"]["sft_teacher"]["name_or_path"].endswith("teacher")
    assert m["tables"]["teachers/teacher"]["consistency"]["verdict"] == "consistent"
    assert m["tables"]["rollouts"]["model"]["engine"] == "transformers"


def test_deterministic_scores_are_bit_identical_across_batchings(hf_cache, weights):
    backend = TransformersBackend(weights / "teacher", dtype="float32", deterministic=True)
    rows = shards.read_table(Cache(hf_cache).shard_paths("rollouts")[0])
    off = shards.list_offsets(rows["response_ids"])
    resp = shards.token_values(rows["response_ids"])
    reqs = [ScoreRequest(p, resp[off[i]: off[i + 1]]) for i, p in enumerate(rows["prompt_ids"].to_pylist())]
    reqs = (reqs * 3)[:32]
    reference = backend.score(reqs, top_k=5, hidden=True)
    for size in (1, 7, 32):
        order = list(range(len(reqs)))
        random.Random(size).shuffle(order)
        got = [None] * len(reqs)
        for start in range(0, len(order), size):
            chunk = order[start: start + size]
            for i, sc in zip(chunk, backend.score([reqs[i] for i in chunk], top_k=5, hidden=True)):
                got[i] = sc
        for a, b in zip(reference, got):
            assert a.logprobs.tobytes() == b.logprobs.tobytes()
            assert a.logsumexp.tobytes() == b.logsumexp.tobytes()
            assert a.topk_logprobs.tobytes() == b.topk_logprobs.tobytes()
            assert torch.equal(a.hidden, b.hidden)


class _Head:
    """A stand-in model: an unembedding with bias, and Gemma-style soft-capping."""

    def __init__(self, V, H, softcap=None, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.head = torch.nn.Linear(H, V, bias=True)
        with torch.no_grad():
            self.head.weight.copy_(torch.randn(V, H, generator=g))
            self.head.bias.copy_(torch.randn(V, generator=g))
        self.config = type("C", (), {"final_logit_softcapping": softcap, "logit_scale": None})()

    def get_output_embeddings(self):
        return self.head


@pytest.mark.parametrize("order", ["random", "rising", "one-hot-rows"])
def test_running_top_k_merge_equals_one_top_k_over_the_whole_row(order):
    """The grouped merge against torch.topk over full rows: random rows (few late candidates), rows that rise
    along the vocabulary (every group of every slice qualifies, many groups per row) and rows whose best
    values all sit in one late slice."""
    import opdcache.backends.streamed as hf

    g = torch.Generator().manual_seed(3)
    P, V, C, k = 9, 5 * 1024 + 40, 1024, 20
    x = torch.randn(P, V, generator=g)
    if order == "rising":
        x = x * 0.01 + torch.linspace(0, 50, V)
    elif order == "one-hot-rows":
        x[:, 3 * C + 5: 3 * C + 5 + k] += 100.0
    vals = torch.full((P, k), float("-inf"))
    ids = torch.zeros((P, k), dtype=torch.long)
    for a in range(0, V, C):
        cm = hf._merge_top_k(x[:, a: a + C].clone(), a, vals, ids)
        assert torch.equal(cm, x[:, a: a + C].amax(-1))
    want = x.topk(k, -1)
    assert torch.equal(vals, want.values)
    assert torch.equal(ids, want.indices)


@pytest.mark.parametrize("P, V, k, softcap", [(1, 3001, 5, None), (37, 3001, 20, 30.0), (64, 1024, 1, None), (5, 2048, 7, None)])
def test_streamed_stats_match_the_plain_full_logits_reference(P, V, k, softcap, monkeypatch):
    import opdcache.backends.streamed as hf

    monkeypatch.setattr(hf, "LOGIT_BLOCK_BYTES", 1)  # force the smallest vocabulary slice (1,024 columns)
    model = _Head(V, 16, softcap)
    g = torch.Generator().manual_seed(1)
    h = torch.randn(P, 16, generator=g)
    sampled = torch.randint(0, V, (P,), generator=g)
    ref_ids = torch.randint(0, V, (P, 4), generator=g)
    mc_ids = torch.randint(0, V, (P, 3), generator=g)
    slices = []
    original = hf.head_transform
    monkeypatch.setattr(hf, "head_transform", lambda m: (lambda z: slices.append(z.shape) or original(m)(z)))
    got = hf.streamed_logit_stats(model, h, sampled, k, ref_ids, mc_ids)
    assert max(c for _, c in slices) <= 1024 < V or V == 1024  # never a [positions, vocabulary] block
    with torch.no_grad():  # the plain reference: full logits, full log-softmax
        logits = h @ model.head.weight.T + model.head.bias
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        logp = torch.log_softmax(logits.double(), -1)
    torch.testing.assert_close(got["logsumexp"].double(), torch.logsumexp(logits.double(), -1), atol=1e-5, rtol=0)
    torch.testing.assert_close(got["logprobs"].double(), logp.gather(1, sampled[:, None]).squeeze(1), atol=1e-5, rtol=0)
    torch.testing.assert_close(got["ref_topk_logprobs"].double(), logp.gather(1, ref_ids), atol=1e-5, rtol=0)
    torch.testing.assert_close(got["mc_logprobs"].double(), logp.gather(1, mc_ids), atol=1e-5, rtol=0)
    top = logp.topk(k, -1)
    assert torch.equal(got["topk_ids"], top.indices)
    torch.testing.assert_close(got["topk_logprobs"].double(), top.values, atol=1e-5, rtol=0)


def test_float32_scorer_log_probs_round_at_the_logit_not_at_the_partition():
    """log p = (z - m) - log s: against float64, the mean error is well below that of z - (m + log s)."""
    import torch

    from opdcache.backends.streamed import streamed_logit_stats

    class Head:
        def __init__(self, W):
            self.lin = torch.nn.Linear(W.shape[1], W.shape[0], bias=False)
            self.lin.weight.data = W
            self.config = type("C", (), {})()

        def get_output_embeddings(self):
            return self.lin

    g = torch.Generator().manual_seed(0)
    W = torch.randn(20000, 64, generator=g)
    h = torch.randn(512, 64, generator=g) * 0.9  # logits of scale ~7, log-partitions ~ 30
    z32 = h @ W.T
    ids = z32.topk(2, -1).indices[torch.arange(512), torch.arange(512) % 2]  # likely tokens, as sampled ones mostly are
    with torch.no_grad():
        stats = streamed_logit_stats(Head(W), h, ids, top_k=4)
    z64 = z32.double()  # the same float32 logits, in float64: what is measured is the log-softmax's rounding alone
    ref = torch.log_softmax(z64, -1).gather(1, ids[:, None]).squeeze(1)
    new_err = float((stats["logprobs"].double() - ref).abs().mean())
    old = z32.gather(1, ids[:, None]).squeeze(1) - stats["logsumexp"]  # the old formula, from the same float32 values
    old_err = float((old.double() - ref).abs().mean())
    assert float(stats["logsumexp"].mean()) > 20 and new_err < 0.6 * old_err, (new_err, old_err)
    torch.testing.assert_close(stats["topk_logprobs"].double(), torch.log_softmax(z64, -1).topk(4, -1).values, rtol=0, atol=2e-5)


@pytest.mark.parametrize("P, V, softcap", [(7, 3001, None), (5, 2048, 30.0), (3, 700, None)])
def test_streamed_draws_equal_the_plain_inverse_cdf(P, V, softcap, monkeypatch):
    """The sampled store's two-level draws (slice, then token) against a plain reference written apart: the float64
    inverse CDF over the whole vocabulary, token = min{v : F(v) > u}. Equal except where u lies within rounding of a
    CDF boundary; the drawn log-probs equal the full log-softmax at the drawn ids."""
    import opdcache.backends.streamed as hf

    monkeypatch.setattr(hf, "LOGIT_BLOCK_BYTES", 1)  # 1,024-column slices: draws cross slice boundaries
    model = _Head(V, 16, softcap)
    g = torch.Generator().manual_seed(3)
    h = torch.randn(P, 16, generator=g) * 0.3  # a flat-ish distribution: draws land in every slice
    u = torch.rand(P, 400, generator=g, dtype=torch.float64)
    got = hf.streamed_logit_stats(model, h, torch.zeros(P, dtype=torch.long), None, uniforms_PD=u)
    with torch.no_grad():
        logits = h @ model.head.weight.T + model.head.bias
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        logp = torch.log_softmax(logits.double(), -1)
    cdf = logp.exp().cumsum(-1)
    want = torch.searchsorted(cdf, u, right=True).clamp(max=V - 1)
    near = (cdf.gather(1, want) - u).abs().lt(1e-6) | (cdf.gather(1, (want - 1).clamp(min=0)) - u).abs().lt(1e-6)
    assert bool(((got["sampled_ids"] == want) | near).all()), int((got["sampled_ids"] != want).sum())
    assert float((got["sampled_ids"] == want).float().mean()) > 0.99
    assert len(torch.unique(got["sampled_ids"] // 1024)) > 1 or V <= 1024
    torch.testing.assert_close(got["sampled_logprobs"].double(), logp.gather(1, got["sampled_ids"]), atol=1e-5, rtol=0)


def test_sampled_store_is_reproducible_and_batch_invariant(hf_cache, weights):
    """Each row's draws depend on (seed, row id) alone: scoring a row alone or among others gives the same draws, and
    their frequencies follow the teacher's distribution."""
    from opdcache.format import shards
    from opdcache.backends.hf import TransformersBackend
    from opdcache.format.cache import Cache
    from opdcache.teacher.scoring import score_requests

    cache = Cache(hf_cache)
    rows = shards.read_table(cache.shard_paths("rollouts")[0], ["id", "prompt_ids", "response_ids"])
    backend = TransformersBackend(weights / "teacher", dtype="float32")
    reqs = score_requests(rows, draws=64, seed=5)
    together = backend.score(reqs)
    alone = backend.score(reqs[2:3])
    assert np.array_equal(together[2].sampled_ids, alone[0].sampled_ids)
    again = backend.score(score_requests(rows, draws=64, seed=5)[:1])
    assert np.array_equal(again[0].sampled_ids, together[0].sampled_ids)
    other_seed = backend.score(score_requests(rows, draws=64, seed=6)[:1])
    assert not np.array_equal(other_seed[0].sampled_ids, together[0].sampled_ids)
    # frequencies of the 64 draws at every position against the teacher's probabilities: a chi-square-like bound
    sc = together[0]
    probs = np.exp(sc.sampled_logprobs.astype(np.float64))
    for t in range(len(sc.sampled_ids)):
        ids, counts = np.unique(sc.sampled_ids[t], return_counts=True)
        p = probs[t][[list(sc.sampled_ids[t]).index(i) for i in ids]]
        assert np.all(np.abs(counts / 64 - p) <= 5 * np.sqrt(p * (1 - p) / 64) + 1 / 64)


def test_the_gpu_logit_block_is_capped_by_free_device_memory(monkeypatch):
    """No device needed: the block is 4 GiB where a quarter of the free memory allows, less on a small or full card,
    never under the floor; a CPU keeps its own measured block."""
    import torch

    from opdcache.backends import streamed

    cuda = torch.device("cuda")
    for free, want in ((130 << 30, 4 << 30), (8 << 30, 2 << 30), (100 << 20, streamed.GPU_MIN_BLOCK_BYTES)):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device, free=free: (free, 141 << 30))
        assert streamed.block_bytes(cuda) == want
    assert streamed.block_bytes(torch.device("cpu")) == streamed.LOGIT_BLOCK_BYTES == 8 << 20


def test_replay_feeds_stored_tokens_through_the_generation_path(student, prompts):
    """replay (audit's re-computation of a rollouts table) gives the generation's own temperature-1 log-probs for its
    tokens: the same path, batch and order, so bit for bit on a CPU; each row ends with its own response."""
    s = SamplingConfig(temperature=0.9, top_p=0.95, max_new_tokens=20, ref_top_k=2, mc_samples=2)
    reqs = [GenerateRequest(p, seed=50 + i) for i, p in enumerate(prompts)]
    gens = student.generate(reqs, s)
    again = student.replay(reqs, [g.response_ids for g in gens])
    for g, r in zip(gens, again):
        np.testing.assert_array_equal(r.response_ids, g.response_ids)
        np.testing.assert_array_equal(r.ref_logprobs, g.ref_logprobs)
    short = student.replay(reqs[:2], [gens[0].response_ids[:3], gens[1].response_ids[:1]])
    assert [len(x.response_ids) for x in short] == [3, 1]
    # another batch (2 rows, not 7): float32 rounding of batched kernels moves the last bits, nothing more
    np.testing.assert_allclose(short[0].ref_logprobs, gens[0].ref_logprobs[:3], atol=1e-5)
