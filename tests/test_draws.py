"""The counter-based uniforms of the transformers engine's sampler (opdcache/backends/draws.py): equal to their plain
integer reference, uniform, independent of the batch, and the engine's draws follow the stored distribution."""

import numpy as np
import pytest
import torch

from opdcache.backends import draws
from opdcache.backends.base import GenerateRequest, SamplingConfig


def test_uniforms_equal_the_python_integer_reference():
    rng = np.random.default_rng(0)
    seeds = [0, 1, (1 << 63) - 1, (1 << 32) - 1, 1 << 32] + [int(x) for x in rng.integers(0, 1 << 63, 11, dtype=np.int64)]
    got = draws.uniforms(torch.tensor(seeds, dtype=torch.int64), 5, 9, 4)  # steps 5..13, draws 0..3
    assert got.shape == (len(seeds), 9, 4) and got.dtype == torch.float64
    for b, seed in enumerate(seeds):
        for t in range(9):
            for d in range(4):
                assert got[b, t, d].item() == draws.uniform_reference(seed, 5 + t, d), (seed, t, d)
    assert ((got >= 0) & (got < 1)).all()


def test_a_rows_uniforms_do_not_depend_on_its_batch():
    target = 123456789012345
    alone = draws.uniforms(torch.tensor([target]), 0, 32, 3)[0]
    for size in (7, 64):
        others = torch.randint(0, 1 << 62, (size,), generator=torch.Generator().manual_seed(size))
        where = size // 2
        others[where] = target
        np.testing.assert_array_equal(draws.uniforms(others, 0, 32, 3)[where].numpy(), alone.numpy())
    # a block of steps computed later gives the same numbers as the whole range at once
    np.testing.assert_array_equal(draws.uniforms(torch.tensor([target]), 20, 12, 3)[0].numpy(), alone[20:].numpy())


def test_uniforms_pass_a_chi_square_test_and_differ_across_seeds_steps_and_draws():
    u = draws.uniforms(torch.arange(2000, dtype=torch.int64), 0, 50, 2).flatten().numpy()  # 200,000 values
    bins = 100
    counts = np.bincount((u * bins).astype(int), minlength=bins)
    expected = u.size / bins
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 160, chi2  # 99 degrees of freedom: P(chi2 > 160) < 1e-4 for uniform draws
    assert abs(u.mean() - 0.5) < 0.005 and abs(u.var() - 1 / 12) < 0.002
    assert len(np.unique(u)) == u.size  # no collisions across (seed, step, draw) at 53 bits
    # consecutive values (seed-major, then step, then draw) are uncorrelated
    assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < 0.01


def test_inverse_cdf_never_draws_a_token_of_zero_probability():
    logp = torch.log(torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0, 1.0]]))
    u = torch.tensor([[0.0, 0.4999, 0.5, 1 - 2.0 ** -53], [0.0, 0.3, 0.7, 1 - 2.0 ** -53]], dtype=torch.float64)
    got = draws.inverse_cdf(logp, u)
    assert got.tolist() == [[1, 1, 3, 3], [4, 4, 4, 4]]


def test_inverse_cdf_draws_follow_the_distribution():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    u = draws.uniforms(torch.arange(1, dtype=torch.int64), 0, 40000, 1)[0, :, 0]
    ids = draws.inverse_cdf(torch.log(probs)[None].expand(1, 4), u[None])[0]
    freq = np.bincount(ids.numpy(), minlength=4) / ids.numel()
    np.testing.assert_allclose(freq, probs.numpy(), atol=0.01)


@pytest.fixture(scope="module")
def prompts(weights):
    from transformers import AutoTokenizer

    from opdcache.demo.evaluate import chat_prompt_ids

    tok = AutoTokenizer.from_pretrained(weights / "student")
    rng = np.random.default_rng(3)
    return [chat_prompt_ids(tok, f"{a:03d}+{b:03d}") for a, b in rng.integers(0, 1000, (64, 2))]


def test_a_sample_is_the_same_alone_and_in_batches_of_7_and_64(student, prompts):
    s = SamplingConfig(temperature=0.9, top_p=0.95, max_new_tokens=20, mc_samples=2)
    target = GenerateRequest(prompts[5], seed=987654321)
    alone = student.generate([target], s)[0]
    for size in (7, 64):
        reqs = [GenerateRequest(p, seed=i) for i, p in enumerate(prompts[:size])]
        reqs[size // 2] = target
        got = student.generate(reqs, s)[size // 2]
        np.testing.assert_array_equal(got.response_ids, alone.response_ids)
        np.testing.assert_array_equal(got.mc_ids, alone.mc_ids)
        np.testing.assert_allclose(got.sampling_logprobs, alone.sampling_logprobs, atol=1e-5)


def test_the_engines_token_is_the_inverse_cdf_of_its_stored_distribution(student, prompts):
    """Replaying the draw from the stored values: the token the engine sampled at each step is the inverse-CDF pick of
    the row's own uniform under the sampling distribution of a fresh full forward (exact where no float rounding puts
    the uniform within 1e-4 of a bin edge)."""
    from opdcache.backends.hf import sampling_logprobs

    s = SamplingConfig(temperature=0.7, top_p=0.9, max_new_tokens=24, mc_samples=3)
    reqs = [GenerateRequest(p, seed=1000 + i) for i, p in enumerate(prompts[:6])]
    checked = 0
    for r, g in zip(reqs, student.generate(reqs, s)):
        ids = torch.tensor([list(r.prompt_ids) + list(g.response_ids)])
        with torch.no_grad():
            logits = student.model(ids).logits[0, len(r.prompt_ids) - 1: len(r.prompt_ids) - 1 + len(g.response_ids)].float()
        q = sampling_logprobs(logits, s.temperature, s.top_p)  # [T, V]
        u = draws.uniforms(torch.tensor([r.seed]), 0, len(g.response_ids), 1 + s.mc_samples)[0]  # [T, 1 + m]
        picks = draws.inverse_cdf(q, u)
        cdf = q.exp().double().cumsum(-1)
        margin = (cdf - (u[:, :1] * cdf[:, -1:])).abs().min(-1).values  # distance of the token's target to a bin edge
        clear = margin > 1e-4
        np.testing.assert_array_equal(picks[clear, 0].numpy(), g.response_ids[clear.numpy()])
        np.testing.assert_array_equal(picks[clear, 1:].numpy(), g.mc_ids[clear.numpy()])
        checked += int(clear.sum())
    assert checked > 60
