"""Packed batches (opdcache/training/packing.py): the same rows and values as the padded batches, no padding, zero-copy
views of the decoded shard where the rows are consecutive, and a model attending within each packed sequence only."""

import json
import numpy as np
import pytest
import torch

from opdcache.training.data import CacheLoader, CacheLoaderConfig, collate_decoded
from opdcache.training.packing import _ranges, collate_packed, unpack

ROLLOUT_STORES = ("ref_topk", "mc")
TEACHER_STORES = ("logprob", "topk", "hidden", "svd", "sampled")


def _loaders(cache, **kw):
    common = dict(cache=cache, teacher="teacher", stores=TEACHER_STORES, rollout_stores=ROLLOUT_STORES, batch_size=5) | kw
    return CacheLoader(CacheLoaderConfig(**common)), CacheLoader(CacheLoaderConfig(**common, pack=True))


def test_ranges_is_the_concatenation_of_aranges():
    starts, lengths = np.array([5, 0, 9, 3]), np.array([2, 0, 3, 1])
    assert _ranges(starts, lengths).tolist() == [5, 6, 9, 10, 11, 3]
    assert _ranges(np.array([], np.int64), np.array([], np.int64)).tolist() == []


@pytest.mark.parametrize("shuffle", [False, True])
def test_packed_batches_hold_the_padded_batches_values_without_padding(hf_cache, shuffle):
    padded_loader, packed_loader = _loaders(hf_cache, shuffle=shuffle)
    batches = 0
    for padded, packed in zip(padded_loader, packed_loader, strict=True):
        batches += 1
        mask = padded["response_mask"].bool()
        n = mask.sum(1)
        assert torch.equal(packed["cu_response"], torch.cat([torch.zeros(1, dtype=torch.long), n.cumsum(0)]))
        assert torch.equal(packed["response_ids"], padded["response_ids"][mask])
        assert torch.equal(packed["sequence_index"], torch.arange(len(n)).repeat_interleave(n))
        seq = padded["attention_mask"].sum(1)
        assert torch.equal(packed["cu_seqlens"].long(), torch.cat([torch.zeros(1, dtype=torch.long), seq.cumsum(0)]))
        assert torch.equal(packed["input_ids"][0], padded["input_ids"][padded["attention_mask"].bool()])
        assert torch.equal(packed["position_ids"][0], torch.cat([torch.arange(int(s)) for s in seq]))
        # a logit position points at the same token in the packed sequence as in the padded row
        starts = packed["cu_seqlens"].long()[packed["sequence_index"]]
        assert torch.equal(packed["logit_positions"] - starts, padded["logit_positions"][mask])
        names = [k for k in padded if k not in ("input_ids", "attention_mask", "response_ids", "response_mask", "logit_positions")]
        assert set(names) <= set(packed) and any(k.startswith("teacher_hidden") for k in names)
        for name in names:
            want = padded[name][mask]
            got = packed[name]
            assert got.dtype == want.dtype or (got.dtype == torch.int32 and want.dtype == torch.int64), name
            assert torch.equal(got.to(want.dtype), want), name
            assert torch.equal(unpack(packed, name).to(want.dtype)[mask], want) and unpack(packed, name).shape[:2] == mask.shape
    assert batches == len(padded_loader) > 1


def test_a_batch_of_consecutive_rows_is_a_view_of_the_decoded_shard(hf_cache):
    """Rows in order from one shard: every per-token column of the packed batch shares memory with the shard's decoded
    buffers (no copy); a shuffled batch gathers, and the two agree."""
    _, packed_loader = _loaders(hf_cache, shuffle=False, prefetch=False)
    dataset = packed_loader.dataset
    decoded = dataset._decode(0)
    packed = collate_packed([(decoded, np.arange(3))])
    for name in ("sampling_logprobs", "teacher_logprobs", "teacher_topk_ids", "teacher_hidden", "teacher_sampled_counts"):
        assert np.shares_memory(packed[name].view(torch.int16).numpy() if packed[name].dtype == torch.bfloat16 else packed[name].numpy(),
                                decoded.cols[name]), name
    scattered = collate_packed([(decoded, np.array([2, 0, 1]))])
    assert not np.shares_memory(scattered["teacher_logprobs"].numpy(), decoded.cols["teacher_logprobs"])
    back = {r: i for i, r in enumerate([2, 0, 1])}
    for name in ("teacher_logprobs", "teacher_topk_ids"):
        for r in range(3):
            i = back[r]
            a, b = packed["cu_response"][r], packed["cu_response"][r + 1]
            c, d = scattered["cu_response"][i], scattered["cu_response"][i + 1]
            assert torch.equal(packed[name][a:b], scattered[name][c:d])
    padded = collate_decoded([(decoded, r) for r in range(3)])
    assert torch.equal(packed["teacher_logprobs"], padded["teacher_logprobs"][padded["response_mask"].bool()])


def test_a_model_given_packed_position_ids_attends_within_each_sequence(hf_cache, weights):
    """The demo student on a packed batch (position_ids, no attention mask) gives every response position the logits
    it gives in the padded batch: attention never crosses a sequence boundary (transformers' packed-sequence mask)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(weights / "student", dtype=torch.float64, attn_implementation="sdpa").eval()
    padded_loader, packed_loader = _loaders(hf_cache, shuffle=True)
    padded, packed = next(iter(padded_loader)), next(iter(packed_loader))
    mask = padded["response_mask"].bool()
    with torch.no_grad():
        want = model(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"]).logits
        got = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"], use_cache=False).logits[0]
    want = want[torch.arange(len(mask))[:, None].expand_as(mask)[mask], padded["logit_positions"][mask]]
    got = got[packed["logit_positions"]]
    assert torch.allclose(got, want, atol=1e-10, rtol=0), (got - want).abs().max()
    crossed = model(input_ids=packed["input_ids"], attention_mask=torch.ones_like(packed["input_ids"]), use_cache=False).logits[0]
    assert not torch.allclose(crossed[packed["logit_positions"]], want, atol=1e-6)  # one causal mask over all would differ


def _one_step_padded_and_packed(common: dict, tmp_path, model_dtype: torch.dtype | None = None) -> list[tuple]:
    """(loss, logged numbers, every parameter's gradient) of one step on the first batch, padded then packed
    (``model_dtype``: the student cast to it after the trainer is built)."""
    from opdcache.training.train import TrainConfig, Trainer

    results = []
    for pack in (False, True):
        torch.manual_seed(0)
        trainer = Trainer(TrainConfig(out=tmp_path / str(pack), pack=pack, **common))
        if model_dtype is not None:
            trainer.model.to(model_dtype)
        batch = trainer.source.next_batch()
        assert ("cu_seqlens" in batch) == pack
        loss_value, stats = trainer.loss_and_stats(batch)
        loss_value.backward()
        results.append((loss_value.detach(), stats, {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}))
    return results


def _assert_gradients_close(ga: dict, gb: dict, tolerance: float) -> None:
    assert ga.keys() == gb.keys() and len(ga) > 10
    for name in ga:
        relative = float((gb[name] - ga[name]).norm() / ga[name].norm().clamp_min(1e-30))
        assert relative < tolerance, (name, relative)


@pytest.mark.parametrize("loss", ["lightning", "is", "mc", "ppo", "topk-fkl", "topk-rkl", "sampled-fkl", "full-fkl", "full-rkl", "jsd",
                                  "span"])
def test_a_packed_train_step_equals_the_padded_one(hf_cache, weights, tmp_path, loss):
    """Every loss: the same rows packed and padded give the same loss and the same gradient of every parameter (float32,
    to its rounding: the attention sums run over differently masked rows), and the same logged numbers."""
    from opdcache.training.estimators import ESTIMATORS
    from opdcache.training.losses import Corrections

    # every loss: here on one tokenizer's table; uld and gold (a teacher of another tokenizer) in tests/test_crossteacher.py
    assert set(ESTIMATORS) == {"lightning", "is", "mc", "ppo", "topk-fkl", "topk-rkl", "sampled-fkl", "full-fkl", "full-rkl", "jsd",
                               "span", "uld", "gold"}
    common = dict(model=weights / "student", cache=hf_cache, steps=1, batch_size=6, seed=1, loss=loss, dtype="float32",
                  corrections=Corrections(tis_cap=2.0) if loss == "is" else Corrections())
    (a, sa, ga), (b, sb, gb) = _one_step_padded_and_packed(common, tmp_path)
    assert float(a) != 0 and float(b) == pytest.approx(float(a), rel=1e-5, abs=1e-7)
    _assert_gradients_close(ga, gb, 1e-5)  # float32's rounding, summed over a parameter's entries
    assert sb.keys() == sa.keys() and sb["tokens"] == sa["tokens"]
    for key in sa:
        assert sb[key] == pytest.approx(sa[key], rel=1e-4, abs=1e-6), key


@pytest.mark.parametrize("loss", ["lightning", "is", "mc", "ppo", "topk-fkl", "topk-rkl", "sampled-fkl", "full-fkl", "full-rkl", "jsd",
                                  "span"])
def test_a_packed_step_of_a_float64_student_has_the_padded_steps_gradients_to_float64s_rounding(hf_cache, weights, tmp_path, loss):
    """The same parity with the student in float64: every parameter's gradient to 1e-12 (measured 2e-16 to 6e-16), so
    what float32's 1e-5 above allows is rounding, not a slightly wrong position, mask or offset. The head pass and the
    losses compute in float32 either way (the loss equal to the bit); with --tis-cap the token weights are float32
    exp()s, which torch's CPU kernel rounds by the value's offset in its tensor (vectorised body, scalar tail), so a
    weight may differ by an ulp between the [B, T] and the flat layout: 1e-6 there (measured 3e-7)."""
    from opdcache.training.losses import Corrections

    common = dict(model=weights / "student", cache=hf_cache, steps=1, batch_size=6, seed=1, loss=loss, dtype="float32",
                  corrections=Corrections(tis_cap=2.0) if loss == "is" else Corrections())
    (a, sa, ga), (b, sb, gb) = _one_step_padded_and_packed(common, tmp_path, model_dtype=torch.float64)
    assert next(iter(ga.values())).dtype == torch.float64
    assert float(a) != 0 and float(b) == pytest.approx(float(a), rel=1e-6)
    _assert_gradients_close(ga, gb, 1e-6 if loss == "is" else 1e-12)


@pytest.mark.parametrize("loss,dtype", [("lightning", "float32"), ("lightning", "bfloat16"), ("topk-fkl", "float32"),
                                        ("full-fkl", "float32"), ("is", "float32")])
def test_a_packed_exact_train_step_has_the_padded_steps_bits(hf_cache, weights, tmp_path, loss, dtype):
    """--pack --exact: the student's log-probs, the loss and every logged number are the padded step's to the bit (each
    sequence's values are its padded row's bits); the gradients agree to float32's rounding (the backward's sums run
    over other shapes)."""
    from opdcache.training.losses import Corrections

    common = dict(model=weights / "student", cache=hf_cache, steps=1, batch_size=6, seed=1, loss=loss, dtype=dtype, exact=True,
                  corrections=Corrections(tis_cap=2.0) if loss == "is" else Corrections())
    (a, sa, ga), (b, sb, gb) = _one_step_padded_and_packed(common, tmp_path)
    assert float(a) != 0 and torch.equal(a, b), (float(a), float(b))
    assert sa == sb
    _assert_gradients_close(ga, gb, 1e-5 if dtype == "float32" else 1e-2)


def test_train_packs_by_default_except_online_and_pack_is_refused_with_online():
    from pathlib import Path

    from opdcache.errors import ConfigError
    from opdcache.training.train import TrainConfig

    common = dict(model=Path("m"), cache="c", out=Path("o"))
    assert TrainConfig(**common).pack is True and TrainConfig(**common, pack=False).pack is False
    assert TrainConfig(**common, online=True, teacher_model=Path("t"), loss="is").pack is False
    with pytest.raises(ConfigError, match="--pack lays a cache's rows end to end for the student's forward; --online generates"):
        TrainConfig(**common, pack=True, online=True)


def test_packed_attention_runs_each_sequence_alone_and_gives_the_padded_logits(hf_cache, weights, monkeypatch):
    """The trainer's packed attention (opdcache/training/student.py): the padded batch's logits at every response position
    (float64), from one attention call per sequence of at most that sequence's length: nothing [N, N] over the batch."""
    from transformers import AutoModelForCausalLM

    from opdcache.training.student import enable_packed_attention

    padded_loader, packed_loader = _loaders(hf_cache, shuffle=True)
    padded, packed = next(iter(padded_loader)), next(iter(packed_loader))
    mask = padded["response_mask"].bool()
    reference = AutoModelForCausalLM.from_pretrained(weights / "student", dtype=torch.float64).eval()
    model = AutoModelForCausalLM.from_pretrained(weights / "student", dtype=torch.float64).eval()
    enable_packed_attention(model)
    lengths = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording(q, k, v, **kw):
        lengths.append((q.shape[2], k.shape[2]))
        return sdpa(q, k, v, **kw)

    with torch.no_grad():
        want = reference(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"]).logits
        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
        offsets = tuple(packed["cu_seqlens"].tolist())
        got = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"], use_cache=False, packed_offsets=offsets).logits[0]
    want = want[torch.arange(len(mask))[:, None].expand_as(mask)[mask], padded["logit_positions"][mask]]
    assert torch.allclose(got[packed["logit_positions"]], want, atol=1e-10, rtol=0)
    seq = np.diff(offsets)
    layers = model.config.num_hidden_layers
    assert sorted(lengths) == sorted([(int(n), int(n)) for n in seq] * layers)  # one call a sequence a layer, none wider


def test_a_model_running_packed_attention_still_takes_a_padded_batch(hf_cache, weights):
    """A source that yields padded batches (the async learner's, a user's) beside a packed run's model: without
    ``packed_offsets`` the packed attention is transformers' SDPA with the batch's mask, the same logits to the bit."""
    from transformers import AutoModelForCausalLM

    from opdcache.training.student import enable_packed_attention

    padded = next(iter(_loaders(hf_cache, shuffle=True)[0]))
    mask = padded["attention_mask"]
    assert not mask.bool().all()  # rows of several lengths
    reference = AutoModelForCausalLM.from_pretrained(weights / "student", dtype=torch.float64, attn_implementation="sdpa").eval()
    model = AutoModelForCausalLM.from_pretrained(weights / "student", dtype=torch.float64).eval()
    enable_packed_attention(model)
    with torch.no_grad():
        want = reference(input_ids=padded["input_ids"], attention_mask=mask).logits
        got = model(input_ids=padded["input_ids"], attention_mask=mask).logits
    assert torch.equal(got[mask.bool()], want[mask.bool()])


def _graph_nodes(t: torch.Tensor) -> list[str]:
    seen, stack, names = set(), [t.grad_fn], []
    while stack:
        f = stack.pop()
        if f is None or f in seen:
            continue
        seen.add(f)
        names.append(type(f).__name__)
        stack.extend(g for g, _ in f.next_functions)
    return names


@pytest.mark.parametrize("exact", [False, True])
def test_a_packed_forwards_backward_does_not_grow_with_sequences_times_tokens(weights, exact, monkeypatch):
    """Packed attention takes each sequence's queries, keys and values apart with one split a tensor, not one slice a
    sequence: a slice's backward writes its gradient into a zero tensor of the whole packed length, so B sequences
    would cost B x N a layer in the backward (and the exact decoder's query blocks Q / 256 x Q). The graph of a
    packed forward has as many slice nodes for 12 sequences as for 2, and for a 100-token sequence (seven query
    blocks of 16 here) as for a 16-token one."""
    from transformers import AutoModelForCausalLM

    from opdcache.training.student import enable_packed_attention

    model = AutoModelForCausalLM.from_pretrained(weights / "student", dtype=torch.float32)
    if exact:
        from opdcache.exact import primitives
        from opdcache.exact import decoder as exact_decoder
        from opdcache.exact.decoder import ExactDecoder

        monkeypatch.setattr(exact_decoder, "QUERY_BLOCK", 16)
        decoder = ExactDecoder(model, torch.float32, arith=primitives("opdcache-exact-1"))
    else:
        enable_packed_attention(model)

    def slices(lengths: list[int]) -> int:
        offsets = tuple(int(x) for x in np.concatenate([[0], np.cumsum(lengths)]))
        ids = torch.randint(3, model.config.vocab_size, (1, offsets[-1]))
        pos = torch.cat([torch.arange(n) for n in lengths])[None]
        if exact:
            h = decoder.forward_packed(ids, pos, offsets)
        else:
            h = model.model(input_ids=ids, position_ids=pos, use_cache=False, packed_offsets=offsets).last_hidden_state
        names = _graph_nodes(h.sum())
        assert "SplitWithSizesBackward0" in names
        return sum(name.startswith("SliceBackward") for name in names)

    assert slices([20] * 2) == slices([20] * 12) == slices([16]) == slices([100])
    if exact:  # the rotary tables are sized from the host's offsets, never by reading the positions back from a device
        ends = []
        tables = decoder.rope.tables
        monkeypatch.setattr(decoder.rope, "tables", lambda positions, end=None: ends.append(end) or tables(positions, end))
        slices([7, 30, 12])
        assert ends == [30] * model.config.num_hidden_layers


def test_a_run_resumes_with_or_without_pack(hf_cache, weights, tmp_path):
    """Packing lays the same rows out differently: a run stopped with --pack resumes without it (and a checkpoint
    written before the setting existed resumes), at the step it stopped."""
    import json

    from opdcache.training.train import TrainConfig, Trainer

    common = dict(model=weights / "student", cache=hf_cache, out=tmp_path / "run", batch_size=4, seed=2, dtype="float32",
                  checkpoint_every=1)
    Trainer(TrainConfig(steps=3, stop_after=2, pack=True, **common)).fit()
    state = tmp_path / "run" / "checkpoint"
    assert state.exists()
    again = Trainer(TrainConfig(steps=3, pack=False, **common))
    assert again.maybe_resume() and again.step == 2  # resumed, not refused and not restarted
    again.fit()
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]


@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.parametrize("loss", ["lightning", "topk-fkl"])
def test_max_batch_tokens_gives_the_whole_batchs_loss_and_gradient(hf_cache, weights, tmp_path, pack, loss):
    """A batch cut into groups of at most --max-batch-tokens tokens (here about three rows each), one forward and
    backward a group: the same loss and gradient as the batch at once, and each group within its budget."""
    from opdcache.training.packing import split_batch
    from opdcache.training.train import TrainConfig, Trainer

    results = []
    for budget in (None, 60):
        torch.manual_seed(0)
        trainer = Trainer(TrainConfig(out=tmp_path / str(budget), model=weights / "student", cache=hf_cache, steps=1,
                                      batch_size=8, seed=3, loss=loss, dtype="float32", pack=pack, max_batch_tokens=budget))
        batch = trainer.source.next_batch()
        total = 0.0
        for value, stats, share in trainer._groups(batch):
            (value * share).backward()
            total += float(value.detach()) * share
        results.append((total, {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}))
        if budget:
            groups = split_batch(batch, budget)
            assert len(groups) >= 3
            sizes = [int(g["cu_seqlens"][-1]) if pack else int(g["attention_mask"].sum()) for g in groups]
            rows = [len(g["cu_seqlens"]) - 1 if pack else len(g["input_ids"]) for g in groups]
            assert all(n <= budget or r == 1 for n, r in zip(sizes, rows)) and sum(rows) == 8
    (a, ga), (b, gb) = results
    assert b == pytest.approx(a, rel=1e-5, abs=1e-7)
    for name in ga:
        assert float((gb[name] - ga[name]).norm() / ga[name].norm().clamp_min(1e-30)) < 1e-5, name


def test_max_batch_tokens_is_checked_in_one_line():
    from pathlib import Path

    from opdcache.errors import ConfigError
    from opdcache.training.train import TrainConfig

    with pytest.raises(ConfigError, match="--max-batch-tokens must be at least 1, got 0"):
        TrainConfig(model=Path("m"), cache="c", out=Path("o"), max_batch_tokens=0)
    with pytest.raises(ConfigError, match="--max-batch-tokens cuts a cached batch on one process; drop it with --fsdp"):
        TrainConfig(model=Path("m"), cache="c", out=Path("o"), max_batch_tokens=64, fsdp=True)


def test_the_logged_numbers_mean_the_same_whatever_max_batch_tokens_cuts(hf_cache, weights, tmp_path):
    """metrics.jsonl's step record with the batch at once and cut into groups: every number equal, stds included
    (the groups' stds were averaged: advantage_std 0.796 / 0.704 / 0.449 for one batch at three budgets)."""
    from opdcache.training.train import TrainConfig, run_train

    records = []
    for budget in (None, 120, 40):
        run_train(TrainConfig(out=tmp_path / str(budget), model=weights / "student", cache=hf_cache, steps=1, batch_size=8,
                              seed=3, loss="lightning", dtype="float32", max_batch_tokens=budget, checkpoint="none"))
        records.append(json.loads((tmp_path / str(budget) / "metrics.jsonl").read_text().splitlines()[0]))
    whole = records[0]
    assert {"advantage_std", "is_weight_std", "tokens"} <= whole.keys()
    for cut in records[1:]:
        for key in ("loss", "advantage_mean", "advantage_std", "is_weight_mean", "is_weight_std", "k1", "k3", "clip_fraction", "tokens"):
            assert cut[key] == pytest.approx(whole[key], rel=1e-5, abs=1e-6), key


def test_merge_stats_is_the_union_of_its_parts():
    """Against the statistics of the concatenated values, for parts of unequal weights."""
    from opdcache.training.objective import merge_stats

    rng = np.random.default_rng(0)
    chunks = [rng.normal(i, 1 + i, size=n) for i, n in enumerate((5, 17, 2))]
    union = np.concatenate(chunks)
    parts = [({"x_mean": c.mean(), "x_std": c.std(), "rho_max": c.max(), "tokens": len(c)}, len(c) / len(union)) for c in chunks]
    merged = merge_stats(parts)
    assert merged["x_mean"] == pytest.approx(union.mean()) and merged["x_std"] == pytest.approx(union.std())
    assert merged["rho_max"] == union.max() and merged["tokens"] == len(union)
