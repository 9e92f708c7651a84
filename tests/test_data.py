"""The DataLoader: every row exactly once per epoch across ranks and workers, deterministic shuffling,
exact mid-epoch resume, and tensors that match the cache."""

import numpy as np
import pytest
import torch

from opdcache.errors import ConfigError
from opdcache.format import shards
from opdcache.format.cache import Cache
from opdcache.training.data import CacheLoader, CacheLoaderConfig


def _ids(batches):
    # a row is identified by its response (tokens) and prompt; use the input ids row as bytes
    return [bytes(b["input_ids"][i][b["attention_mask"][i].bool()].numpy().tobytes()) for b in batches for i in range(len(b["input_ids"]))]


@pytest.mark.parametrize("world, workers", [(1, 0), (2, 0), (3, 2)])
def test_every_row_exactly_once_per_epoch(hf_cache, world, workers):
    rows = []
    for rank in range(world):
        loader = CacheLoader(CacheLoaderConfig(cache=hf_cache, teacher="teacher", batch_size=5, num_workers=workers, rank=rank, world_size=world))
        rows += _ids(list(loader))
    total = sum(s["rows"] for s in Cache(hf_cache).table("rollouts")["shards"])
    assert len(rows) == total
    # rows are sequences (prompt + response); the same prompt sampled twice can repeat the bytes, so compare multisets
    everything = _ids(list(CacheLoader(CacheLoaderConfig(cache=hf_cache, batch_size=100, shuffle=False))))
    assert sorted(rows) == sorted(everything)


def test_order_is_deterministic_and_changes_with_seed_and_epoch(hf_cache):
    cfg = CacheLoaderConfig(cache=hf_cache, teacher="teacher", batch_size=4, seed=3)
    a, b = CacheLoader(cfg), CacheLoader(cfg)
    ea, eb = _ids(list(a)), _ids(list(b))
    assert ea == eb
    assert _ids(list(a)) != ea  # the second epoch is shuffled differently
    assert _ids(list(CacheLoader(CacheLoaderConfig(cache=hf_cache, batch_size=4, seed=4)))) != ea


@pytest.mark.parametrize("shuffle, rank, world, batch_size", [(True, 0, 1, 5), (True, 2, 3, 4), (False, 1, 2, 7)])
def test_batches_are_the_plain_per_row_order_cut_into_runs(hf_cache, shuffle, rank, world, batch_size):
    """The loader's batches (numpy, a run of one shard at a time) against the plain reference: shards in an order drawn
    from (seed, epoch), each shard's rows in a permutation drawn next, every world-th row from rank on, cut every
    batch_size rows. A checkpoint's position means the same rows before and after the batches were vectorised."""
    loader = CacheLoader(CacheLoaderConfig(cache=hf_cache, batch_size=batch_size, shuffle=shuffle, seed=7, rank=rank, world_size=world))
    dataset = loader.dataset
    counts = [s["rows"] for s in Cache(hf_cache).table("rollouts")["shards"]]
    assert len(counts) > 1
    for epoch in (0, 1):
        rng = np.random.default_rng([7, epoch])
        shard_order = rng.permutation(len(counts)) if shuffle else range(len(counts))
        seq = [(int(s), int(r)) for s in shard_order for r in (rng.permutation(counts[s]) if shuffle else range(counts[s]))]
        seq = seq[rank::world]
        want = [seq[i: i + batch_size] for i in range(0, len(seq), batch_size)]
        got = [[(s, int(r)) for s, rows in batch for r in rows] for batch in dataset.batches(epoch)]
        assert got == want
        for batch in dataset.batches(epoch):  # runs are maximal: neighbours are of different shards
            assert all(a[0] != b[0] for a, b in zip(batch, batch[1:])) and all(len(rows) for _, rows in batch)
    assert any(len(batch) > 1 for batch in dataset.batches(0))  # some batch spans two shards


def test_mid_epoch_resume_is_exact(hf_cache):
    cfg = CacheLoaderConfig(cache=hf_cache, teacher="teacher", stores=("logprob", "topk", "hidden"), batch_size=3, num_workers=2)
    full = list(CacheLoader(cfg))
    first = CacheLoader(cfg)
    it = iter(first)
    head = [next(it) for _ in range(4)]
    state = first.state_dict()
    resumed = CacheLoader(cfg)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert len(head) + len(rest) == len(full)
    for x, y in zip(head + rest, full):
        assert x.keys() == y.keys()
        for k in x:
            assert torch.equal(x[k], y[k]), k
    with pytest.raises(ConfigError, match="cannot resume the loader: batch_size was 3, now 4"):
        CacheLoader(CacheLoaderConfig(cache=hf_cache, batch_size=4)).load_state_dict(state)


def test_batch_tensors_match_the_cache(hf_cache):
    batch = next(iter(CacheLoader(CacheLoaderConfig(cache=hf_cache, teacher="teacher", stores=("logprob", "topk", "hidden"),
                                                    rollout_stores=("base", "ref_topk", "mc"), batch_size=64, shuffle=False))))
    cache = Cache(hf_cache)
    r = shards.read_table(cache.shard_paths("rollouts")[0])
    t = shards.read_table(cache.shard_paths("teachers/teacher")[0])
    off = shards.list_offsets(r["response_ids"])
    resp, lp, hidden = (shards.token_values(x) for x in (r["response_ids"], t["logprobs"], t["hidden"]))
    for i, prompt in enumerate(r["prompt_ids"].to_pylist()):
        T = off[i + 1] - off[i]
        assert batch["response_mask"][i].sum() == T
        np.testing.assert_array_equal(batch["response_ids"][i, :T], resp[off[i]: off[i + 1]])
        np.testing.assert_array_equal(batch["teacher_logprobs"][i, :T], lp[off[i]: off[i + 1]])
        np.testing.assert_array_equal(batch["teacher_hidden"][i, :T], hidden[off[i]: off[i + 1]])
        np.testing.assert_array_equal(batch["input_ids"][i, : len(prompt)], prompt)
        # logit_positions point at the position predicting each response token
        pos = batch["logit_positions"][i, :T]
        assert torch.equal(batch["input_ids"][i, pos + 1], batch["response_ids"][i, :T])
    assert batch["ref_topk_ids"].shape[-1] == 5 and batch["mc_ids"].shape[-1] == 3 and batch["teacher_topk_ids"].shape[-1] == 6


def test_missing_stores_are_named(hf_cache):
    with pytest.raises(ConfigError, match="teacher 'teacher' has no svdx store"):
        CacheLoader(CacheLoaderConfig(cache=hf_cache, teacher="teacher", stores=("svdx",)))


def test_a_consumer_that_stops_at_len_gets_the_next_epoch(hf_cache):
    """transformers' Trainer takes exactly len(loader) batches per epoch and never asks for one more: the loader must
    still move to the next epoch (it used to hand out nothing from then on)."""
    import itertools

    loader = CacheLoader(CacheLoaderConfig(cache=hf_cache, batch_size=16))
    n = len(loader)
    first = [b["response_ids"] for b in itertools.islice(iter(loader), n)]
    second = [b["response_ids"] for b in itertools.islice(iter(loader), n)]
    assert len(first) == len(second) == n and loader.state_dict()["epoch"] == 2
    assert not all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(first, second))  # epoch 1 reshuffled


def test_kept_decoded_shards_give_the_same_batches_and_are_not_reread(hf_cache, monkeypatch):
    """Warm epochs slice the shards decoded in the first (within keep_decoded_bytes): the same batches as a loader
    that keeps nothing, and no shard read again."""
    from opdcache.training import data as D

    reads = []
    original = D.shards.read_table
    monkeypatch.setattr(D.shards, "read_table", lambda *a, **k: reads.append(a[0]) or original(*a, **k))
    cfg = dict(cache=hf_cache, teacher="teacher", stores=("logprob", "topk"), batch_size=5)
    kept, plain = CacheLoader(CacheLoaderConfig(**cfg)), CacheLoader(CacheLoaderConfig(**cfg, keep_decoded_bytes=0))
    for epoch in range(2):
        reads.clear()
        a = list(kept)
        kept_reads = len(reads)
        b = list(plain)
        assert len(a) == len(b) > 1
        for x, y in zip(a, b):
            assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
        assert kept_reads == (2 * 3 if epoch == 0 else 0)  # 3 shards, rollouts + teacher each, in the first epoch only
    assert kept.dataset.kept_bytes > 0 and plain.dataset.kept_bytes == 0


def test_decoding_ahead_in_a_thread_changes_no_batch_and_no_refusal(hf_cache, tmp_path):
    """prefetch (the next shard read, hashed, checked and decoded in a background thread) yields the same batches as
    decoding in turn; a damaged shard is still refused when it is reached, after the batches before it, with the same
    message; an epoch cut short leaves no decoding thread behind."""
    import shutil
    import threading

    from opdcache.errors import SchemaError

    cfg = dict(cache=hf_cache, teacher="teacher", stores=("logprob", "topk"), batch_size=5, keep_decoded_bytes=0)
    inline = list(CacheLoader(CacheLoaderConfig(**cfg, prefetch=False)))
    for threads in (1, 2, 3):  # shards decoded at once, as many ahead
        ahead = list(CacheLoader(CacheLoaderConfig(**cfg, decode_threads=threads)))
        assert len(ahead) == len(inline) > 2
        for x, y in zip(ahead, inline):
            assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    with pytest.raises(ConfigError, match="decode_threads must be at least 1, got 0"):
        CacheLoaderConfig(**cfg, decode_threads=0)

    broken = tmp_path / "cache"
    shutil.copytree(hf_cache, broken)
    last = Cache(broken).shard_paths("teachers/teacher")[-1]
    data = bytearray(last.read_bytes())
    data[len(data) // 2] ^= 0xFF
    last.write_bytes(bytes(data))
    before_last = sum(s["rows"] for s in Cache(broken).table("rollouts")["shards"][:-1]) // 5
    for prefetch, threads in ((True, 2), (True, 1), (False, 1)):
        got = []
        with pytest.raises(SchemaError, match=r"does not match the manifest's size and sha256 \(corrupted or replaced\); run `opdcache validate"):
            for batch in CacheLoader(CacheLoaderConfig(**cfg | {"cache": broken, "shuffle": False, "prefetch": prefetch,
                                                                "decode_threads": threads})):
                got.append(batch)
        assert len(got) >= before_last  # every batch wholly before the damaged shard came first

    earlier = set(threading.enumerate())  # another test's loader left unclosed may still hold its threads
    it = iter(CacheLoader(CacheLoaderConfig(**cfg)))
    next(it)
    it.close()
    assert not [t for t in set(threading.enumerate()) - earlier if t.name.startswith("opdcache-decode")]


@pytest.mark.parametrize("cache, teacher, stores, rollout_stores", [
    ("hf_cache", "teacher", ("logprob", "topk", "hidden", "svd", "sampled"), ("base", "ref_topk", "mc")),
    ("synth_cache", "synth", ("logprob", "topk", "hidden"), ("base", "ref_topk", "mc")),  # bfloat16 hidden states
])
def test_the_loaders_collate_equals_the_plain_reference(request, cache, teacher, stores, rollout_stores):
    """collate_decoded (what the loader yields) against collate, the plain reference, on the same rows: every store's
    tensors equal in dtype, shape and value, for shuffled batches, a batch that spans shards and a batch of one."""
    from opdcache.training.data import CacheDataset, collate, collate_decoded

    ds = CacheDataset(CacheLoaderConfig(cache=request.getfixturevalue(cache), teacher=teacher, stores=stores,
                                        rollout_stores=rollout_stores, prefetch=False))
    decoded = [ds._decode(s) for s in range(len(ds.rollout_paths))]
    rows = [(d, r) for d in decoded for r in range(len(d.offsets) - 1)]
    order = np.random.default_rng(0).permutation(len(rows))
    batches = [[rows[j] for j in order[i: i + 7]] for i in range(0, len(rows), 7)] + [rows[:1], rows[len(decoded[0].offsets) - 3:][:5]]
    for batch in batches:
        fast = collate_decoded(batch)
        plain = collate([d.row(r) for d, r in batch], batch[0][0].vector_dtypes)
        assert list(fast) == list(plain)
        for name in plain:
            assert fast[name].dtype == plain[name].dtype and torch.equal(fast[name], plain[name]), name
    assert {"teacher_hidden", "mc_ids", "ref_topk_ids"} <= set(fast) and fast["teacher_hidden"].dtype == (
        torch.bfloat16 if cache == "synth_cache" else torch.float32)


def test_a_process_that_exits_with_an_epoch_open_prints_nothing(hf_cache, weights, tmp_path):
    """A script that leaves a trainer (its loader mid-epoch, decoding threads alive) in a global and exits: the epoch is
    closed at exit while the modules are whole, so no ignored exception from a half-torn-down thread pool is printed."""
    import subprocess
    import sys

    script = tmp_path / "script.py"
    script.write_text(
        "from pathlib import Path\n"
        "from opdcache.training.train import TrainConfig, Trainer\n"
        f"trainer = Trainer(TrainConfig(model=Path({str(weights / 'student')!r}), cache={str(hf_cache)!r}, out=Path({str(tmp_path / 'run')!r}),"
        " steps=1, batch_size=2, checkpoint='none'))\n"
        "trainer.fit()\n"
        "print('trained')\n")
    for _ in range(2):
        proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0 and "trained" in proc.stdout, proc.stderr[-2000:]
        assert "Exception ignored" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
