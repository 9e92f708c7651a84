"""The decode loop's key/value cache written in place (opdcache/backends/kvcache.py) against transformers' own."""

import numpy as np
import pytest
import torch

from opdcache.backends import kvcache
from opdcache.backends.base import GenerateRequest, SamplingConfig

FIELDS = ("response_ids", "sampling_logprobs", "ref_logprobs", "ref_topk_ids", "ref_topk_logprobs", "mc_ids", "mc_sampling_logprobs")


def test_a_layer_holds_what_concatenation_holds_through_growth_crop_and_reorder():
    """The plain reference is torch.cat, step by step; the layer must return the same keys and values after a prefill,
    single-token steps, a step past its capacity, a crop and a batch reorder (which replaces its views)."""
    from transformers.cache_utils import DynamicLayer

    g = torch.Generator().manual_seed(0)
    ours, plain = kvcache.PreallocatedLayer(capacity=7), DynamicLayer()

    def step(m):
        k, v = torch.randn(3, 2, m, 4, generator=g), torch.randn(3, 2, m, 4, generator=g)
        a, b = ours.update(k, v), plain.update(k, v)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        assert ours.get_seq_length() == plain.get_seq_length()

    step(5)  # prefill
    buffer = ours._buffers[0]
    assert buffer.shape[-2] == 7
    step(1)
    step(1)
    assert ours._buffers[0] is buffer  # written in place up to the capacity
    step(1)  # one past it: reallocated, the filled part copied once
    assert ours._buffers[0] is not buffer and ours._buffers[0].shape[-2] == 16
    ours.crop(-2), plain.crop(-2)
    step(1)
    index = torch.tensor([2, 0, 1])
    ours.batch_select_indices(index), plain.batch_select_indices(index)
    step(1)
    step(3)


def _config(**kw):
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, **kw)


def test_only_an_all_full_attention_model_gets_it():
    """A sliding-window model attends over a window, not the whole cache: it keeps transformers' own cache."""
    from types import SimpleNamespace

    full = kvcache.preallocated(SimpleNamespace(config=_config()), 10)
    assert full is not None and all(isinstance(layer, kvcache.PreallocatedLayer) for layer in full.layers)
    sliding = _config(use_sliding_window=True, sliding_window=4, max_window_layers=0)
    assert kvcache.preallocated(SimpleNamespace(config=sliding), 10) is None


@pytest.mark.parametrize("sampling", [dict(temperature=0.9, top_p=0.95, ref_top_k=3), dict(temperature=1.0, mc_samples=2)])
def test_generations_are_bit_identical_to_transformers_own_cache(student, weights, monkeypatch, sampling):
    """Left-padded prompts of different lengths: every stored field equal bit for bit to the same decode with the
    model's default (concatenating) cache, and the cache allocated once at the longest prompt + max_new_tokens."""
    from transformers import AutoTokenizer

    from opdcache.demo.evaluate import chat_prompt_ids

    tok = AutoTokenizer.from_pretrained(weights / "student")
    prompts = [chat_prompt_ids(tok, p) for p in ("347+589", "1+2", "999+999", "12+305", "555+445")]
    prompts[1] = prompts[1] + prompts[3]  # a much longer row: the others are left-padded
    reqs = [GenerateRequest(p, seed=i) for i, p in enumerate(prompts)]
    s = SamplingConfig(max_new_tokens=24, **sampling)
    used = []
    real = kvcache.preallocated
    monkeypatch.setattr(kvcache, "preallocated", lambda model, capacity: used.append(capacity) or real(model, capacity))
    ours = student.generate(reqs, s)
    assert used == [max(map(len, prompts)) + 24]
    monkeypatch.setattr(kvcache, "preallocated", lambda model, capacity: None)
    plain = student.generate(reqs, s)
    for a, b in zip(ours, plain):
        assert a.finish_reason == b.finish_reason
        for field in FIELDS:
            if getattr(b, field) is not None:
                np.testing.assert_array_equal(getattr(a, field), getattr(b, field), err_msg=field)
