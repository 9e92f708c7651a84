"""A loader over a cache (a torch IterableDataset, run in DataLoader workers when asked): rollouts plus one teacher's
stores (or several teachers', side by side), as padded or packed training batches.

Usable on its own with any trainer::

    loader = CacheLoader(CacheLoaderConfig(cache="c", teacher="teacher", stores=("logprob", "topk"), batch_size=16))
    for batch in loader:            # dict of tensors, see `collate`
        ...
    state = loader.state_dict()     # resume mid-epoch exactly: loader.load_state_dict(state)

Order: each epoch shuffles the shard order and the rows inside each shard from (seed, epoch), and
concatenates them, so consecutive rows come from one shard (one shard in use at a time; with ``prefetch``
the next ``decode_threads`` are read, checked and decoded in background threads meanwhile). Rank r of
a world of size W takes every W-th row of that sequence; the rank's rows are cut into batches and batch i
goes to loader worker i % num_workers, so every row is read exactly once per epoch across ranks and
workers, and the loader yields batches in a fixed order that a saved count can skip to.
"""

from __future__ import annotations

import atexit
import os
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from opdcache.format import shards

from opdcache.errors import ConfigError
from opdcache.format.cache import Cache
from opdcache.stores import ALWAYS
from opdcache.training.decoded import DecodedShard, verify_shard
from opdcache.training.packing import BIT_COLUMNS, collate_packed


@dataclass(frozen=True)
class CacheLoaderConfig:
    """What to load and how."""

    cache: Path | str
    """The cache: a directory or an object-store URL (s3://, gs://, hf://datasets/...), read in place."""
    teacher: str | None = None
    """Teacher table name (teachers/<name>); None loads rollouts only."""
    more_teachers: tuple[str, ...] = ()
    """Further teacher tables, loaded beside the first with the same stores, their columns prefixed ``teacher1_``,
    ``teacher2_``, ... (the first's ``teacher_``)."""
    route_field: str | None = None
    """A field of the rows' metadata (the prompt's other fields) whose value names each row's teacher, one of
    ``teacher`` and ``more_teachers``: yields ``row_teacher`` [B, T], the index of the row's teacher (0 the first).
    A row whose value names none is refused in one line."""
    stores: tuple[str, ...] = ALWAYS
    """Teacher stores to load (opdcache/stores/: logprob, topk, hidden, svd, sampled, entropy, ...)."""
    rollout_stores: tuple[str, ...] = ("base",)
    """Rollout stores to load besides the base columns: ref_topk, mc."""
    batch_size: int = 16
    """Sequences per batch."""
    seed: int = 0
    """Shuffling seed."""
    shuffle: bool = True
    """Shuffle shards and rows each epoch."""
    num_workers: int = 0
    """DataLoader worker processes."""
    rank: int | None = None
    """Distributed rank (default: torch.distributed, then RANK, then 0)."""
    world_size: int | None = None
    """Distributed world size (default: torch.distributed, then WORLD_SIZE, then 1)."""
    verify: bool = True
    """Check each shard's size and sha256 against the manifest before decoding it (once per shard and process)."""
    max_length: int | None = None
    """Refuse a row whose prompt + response is longer than this (the model's context: Trainer sets it)."""
    vocab_size: int | None = None
    """Refuse token ids outside [0, vocab_size) (the model's vocabulary: Trainer sets it; default the manifest's)."""
    keep_decoded_bytes: int = 1 << 30
    """Decoded shards kept across epochs, up to this many bytes per process (0: none): a cache that fits is read,
    hashed, checked and decoded once, and every later epoch slices the kept buffers. Memory: at most this plus the
    shard in use and (``prefetch``) the ``decode_threads`` next ones."""
    prefetch: bool = True
    """Decode the next shards in background threads while this one's batches are handed out (reading, the sha256 and
    Parquet decoding release the GIL), so a training step hides them."""
    pack: bool = False
    """Yield packed batches (:func:`collate_packed`: one flat sequence of the batch's rows, ``position_ids`` and
    ``cu_seqlens`` marking where each starts, every per-token column flat; zero-copy views of the decoded shard where
    the rows are consecutive) instead of padded ones. Memory: the batch's tokens, not its longest row times the batch
    size. The same rows in the same order either way."""
    decode_threads: int = 2
    """With ``prefetch``: shards read, checked and decoded at once, each in its own thread, as many ahead of the one in
    use. On 2 cores two threads took a cold epoch from 0.78-0.81 s to 0.49-0.63 s (BENCHMARKS.md, "DataLoader");
    each is one more decoded shard in memory."""

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ConfigError(f"--batch-size must be at least 1, got {self.batch_size}")
        if self.num_workers < 0:
            raise ConfigError(f"--num-loader-workers must be at least 0, got {self.num_workers}")
        if self.decode_threads < 1:
            raise ConfigError(f"decode_threads must be at least 1, got {self.decode_threads}")
        if self.keep_decoded_bytes < 0:
            raise ConfigError(f"keep_decoded_bytes must be at least 0, got {self.keep_decoded_bytes}")
        if (self.more_teachers or self.route_field) and self.teacher is None:
            raise ConfigError("several teachers (or routing rows to them) need the first teacher named")
        names = (self.teacher,) + tuple(self.more_teachers)
        if len(set(names)) != len(names):
            raise ConfigError(f"--teacher names a table twice: {', '.join(names)}")

    @property
    def teachers(self) -> tuple[str, ...]:
        """Every teacher table loaded, the first first."""
        return () if self.teacher is None else (self.teacher,) + tuple(self.more_teachers)


def _dist() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def _pad(rows: list[np.ndarray], length: int, fill=0) -> np.ndarray:
    out = np.full((len(rows), length) + rows[0].shape[1:], fill, dtype=rows[0].dtype)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out




def _column_tensor(name: str, padded: np.ndarray, vector_dtypes: dict | None) -> torch.Tensor:
    """A padded [B, T, ...] column as the batch's tensor: vectors in their stored dtype (``vector_dtypes``, by column;
    float32 where it names none), other integers as int64."""
    if name in BIT_COLUMNS:  # 16-bit vectors arrive as their bits: a typed tensor, no bit changed
        return shards.hidden_to_torch(padded, (vector_dtypes or {}).get(name) or "float32")
    return torch.from_numpy(padded.astype(np.int64, copy=False) if padded.dtype.kind in "iu" else padded)


def collate(rows: list[dict], vector_dtypes: dict | None = None) -> dict[str, torch.Tensor]:
    """Rows (dicts of numpy arrays: prompt_ids, response_ids, per-token columns) -> padded tensors.

    Shapes (B sequences, T = longest response, L = longest prompt + response): input_ids [B, L] (prompt +
    response, right-padded), attention_mask [B, L], response_ids [B, T], response_mask [B, T] (1 on real
    response tokens), logit_positions [B, T] (index in input_ids of the position whose logits predict
    response token t: prompt length + t - 1), then every per-token column as [B, T] or [B, T, k] (teacher
    columns prefixed with ``teacher_``; hidden states and svd vectors in their stored dtype). Padding values are 0.
    """
    prompts = [r["prompt_ids"] for r in rows]
    responses = [r["response_ids"] for r in rows]
    B = len(rows)
    T = max(1, max(len(r) for r in responses))
    L = max(len(p) + len(r) for p, r in zip(prompts, responses))
    input_ids = np.zeros((B, L), np.int64)
    attention = np.zeros((B, L), np.int64)
    positions = np.zeros((B, T), np.int64)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        input_ids[i, : len(p)] = p
        input_ids[i, len(p): len(p) + len(r)] = r
        attention[i, : len(p) + len(r)] = 1
        positions[i, : len(r)] = len(p) - 1 + np.arange(len(r))
    batch = {"input_ids": torch.from_numpy(input_ids), "attention_mask": torch.from_numpy(attention),
             "response_ids": torch.from_numpy(_pad([r.astype(np.int64) for r in responses], T)),
             "response_mask": torch.from_numpy(_pad([np.ones(len(r), np.float32) for r in responses], T)),
             "logit_positions": torch.from_numpy(positions)}
    for name in rows[0]:
        if name in ("prompt_ids", "response_ids"):
            continue
        batch[name] = _column_tensor(name, _pad([r[name] for r in rows], T), vector_dtypes)
    return batch


def collate_decoded(rows: list[tuple[DecodedShard, int]]) -> dict[str, torch.Tensor]:
    """:func:`collate` of rows of decoded shards, (shard, row index) each: the same tensors, written straight into the
    padded batch, one copy a row and column with ids widened to int64 as they are copied, and the masks and positions
    computed for the whole batch at once. :func:`collate`, the plain reference, builds a dict a row and pads and
    widens in separate passes; tests/test_data.py holds the two equal. Memory: the batch's tensors."""
    first = rows[0][0]
    spans = np.array([(d.offsets[r], d.offsets[r + 1], d.prompt_offsets[r], d.prompt_offsets[r + 1]) for d, r in rows], np.int64)
    n, prompt = spans[:, 1] - spans[:, 0], spans[:, 3] - spans[:, 2]
    B, T, L = len(rows), max(1, int(n.max())), int((n + prompt).max())
    t = np.arange(T)
    real = t < n[:, None]
    names = [name for name in first.cols if name not in ("prompt_ids", "response_ids")]
    widened = {name: np.int64 if v.dtype.kind in "iu" and name not in BIT_COLUMNS else v.dtype for name, v in first.cols.items()}
    out = {name: np.zeros((B, T) + first.cols[name].shape[1:], widened[name]) for name in names}
    input_ids, response = np.zeros((B, L), np.int64), np.zeros((B, T), np.int64)
    for i, ((d, _), (a, b, p0, p1)) in enumerate(zip(rows, spans)):
        tokens = d.cols["response_ids"][a:b]
        input_ids[i, : p1 - p0] = d.cols["prompt_ids"][p0:p1]
        input_ids[i, p1 - p0: p1 - p0 + b - a] = tokens
        response[i, : b - a] = tokens
        for name in names:
            out[name][i, : b - a] = d.cols[name][a:b]
    batch = {"input_ids": torch.from_numpy(input_ids),
             "attention_mask": torch.from_numpy((np.arange(L) < (prompt + n)[:, None]).astype(np.int64)),
             "response_ids": torch.from_numpy(response), "response_mask": torch.from_numpy(real.astype(np.float32)),
             "logit_positions": torch.from_numpy(np.where(real, prompt[:, None] - 1 + t, 0))}
    for name in names:
        batch[name] = _column_tensor(name, out[name], first.vector_dtypes)
    return batch


class CacheDataset(torch.utils.data.IterableDataset):
    """Yields whole collated batches; use with ``DataLoader(batch_size=None)`` (CacheLoader does)."""

    def __init__(self, config: CacheLoaderConfig):
        self.config = config
        cache = Cache(config.cache)
        base = cache.base_table
        self.rollout_paths = cache.shard_paths(base)
        self.expected = {p: s for p, s in zip(self.rollout_paths, cache.table(base)["shards"])}  # path -> manifest entry
        self.verified: set = set()
        self.kept: dict[int, DecodedShard] = {}  # decoded shards kept across epochs (config.keep_decoded_bytes)
        self.kept_bytes = 0
        self.rows_per_shard = [s["rows"] for s in cache.table(base)["shards"]]
        self.tokens_per_shard = [s["tokens"] for s in cache.table(base)["shards"]]
        rparams = cache.params(base)
        self.vocab = config.vocab_size or cache.table(base)["config"].get("vocab_size")
        self.teacher_params = None
        cols = ["prompt_ids", "response_ids", "sampling_logprobs"] + (["ref_logprobs"] if base == "rollouts" else [])
        if "ref_topk" in config.rollout_stores:
            if not rparams.ref_top_k:
                raise ConfigError("the cache has no pi_ref top-k (build-rollouts --ref-top-k)")
            cols += ["ref_topk_ids", "ref_topk_logprobs"]
        if "mc" in config.rollout_stores:
            if not rparams.mc_samples:
                raise ConfigError("the cache has no Monte-Carlo samples (build-rollouts --mc-samples)")
            cols += ["mc_ids", "mc_sampling_logprobs"]
        self.rollout_cols = cols
        # each shard's footer, before anything is sized by the manifest: its rows and tokens, and the types of the
        # columns this loader reads (a wrong type is refused here, before a model loads or a batch is read)
        for path, rows, tokens in zip(self.rollout_paths, self.rows_per_shard, self.tokens_per_shard):
            shards.check_shard_footer(path, rows, tokens=tokens, max_row_tokens=config.max_length, columns=cols)
        self.teacher_paths, self.teacher_cols = None, []
        self.more = []  # further teachers: (prefix, shard paths, columns, params) each
        for i, name in enumerate(config.teachers):
            table = cache.teacher_table(name)
            tparams = cache.params(table)
            missing = set(config.stores) - set(tparams.stores)
            if missing:
                raise ConfigError(f"teacher {name!r} has no {', '.join(sorted(missing))} store; it has {', '.join(tparams.stores)}")
            from opdcache.format import schema as S

            columns = [c.name for c in S.columns("teacher", tparams) if c.store in config.stores and c.shape != "row"]
            paths = cache.shard_paths(table)
            self.expected.update(zip(paths, cache.table(table)["shards"]))
            rule_params = tparams.to_dict() | {"teacher_vocab_size": cache.table(table)["config"].get("vocab_size")}
            if i == 0:
                self.teacher_cols, self.teacher_paths, self.teacher_params = columns, paths, rule_params
            else:
                self.more.append((f"teacher{i}_", paths, columns, rule_params))
        rank, world = _dist()
        self.rank = config.rank if config.rank is not None else rank
        self.world = config.world_size if config.world_size is not None else world
        self.epoch = 0
        self.start_batch = 0
        self._batches: tuple = (None, [])

    def order(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """This rank's (shard, row) sequence for an epoch, as two int64 arrays: the shard of each row and its index there."""
        rng = np.random.default_rng([self.config.seed, epoch])
        shard_order = rng.permutation(len(self.rollout_paths)) if self.config.shuffle else np.arange(len(self.rollout_paths))
        counts = [self.rows_per_shard[s] for s in shard_order]
        rows = [rng.permutation(n) if self.config.shuffle else np.arange(n) for n in counts]
        shard_of = np.repeat(shard_order.astype(np.int64), counts)
        row_of = np.concatenate(rows).astype(np.int64) if rows else np.zeros(0, np.int64)
        return shard_of[self.rank:: self.world], row_of[self.rank:: self.world]

    def batches(self, epoch: int) -> list[list[tuple[int, np.ndarray]]]:
        """This rank's batches for an epoch, each its rows in order as runs of one shard: [(shard, row indices), ...]
        (the last epoch's kept: an epoch asks for them more than once). Built with one pass of numpy a batch, never a
        Python step a row."""
        if self._batches[0] != epoch:
            shard_of, row_of = self.order(epoch)
            bs, out = self.config.batch_size, []
            for a in range(0, len(shard_of), bs):
                s, r = shard_of[a: a + bs], row_of[a: a + bs]
                cuts = [0, *(np.flatnonzero(s[1:] != s[:-1]) + 1).tolist(), len(s)]
                out.append([(int(s[i]), r[i:j]) for i, j in zip(cuts[:-1], cuts[1:])])
            self._batches = (epoch, out)
        return self._batches[1]

    def __len__(self) -> int:
        return len(self.batches(self.epoch))

    def _decode(self, shard: int) -> DecodedShard:
        """Read, check and decode one shard (run in a decoding thread: it touches no state of the loader but
        ``verified``, which only decoding threads write, each for its own shard's paths)."""
        sources = [self.rollout_paths[shard], None if self.teacher_paths is None else self.teacher_paths[shard]]
        sources += [paths[shard] for _, paths, _, _ in self.more]
        if self.config.verify:
            for k, path in enumerate(sources):
                if path is not None and path not in self.verified:
                    sources[k] = verify_shard(path, self.expected[path], self.config.cache)
                    self.verified.add(path)
        more = tuple((prefix, source, columns, params) for (prefix, _, columns, params), source in zip(self.more, sources[2:]))
        route = (self.config.route_field, self.config.teachers) if self.config.route_field else None
        return DecodedShard(*sources[:2], self.rollout_cols, self.teacher_cols, where=str(self.rollout_paths[shard]),
                            max_length=self.config.max_length, rows=self.rows_per_shard[shard], vocab=self.vocab, params=self.teacher_params,
                            tokens=self.tokens_per_shard[shard], more=more, route=route,
                            teacher_where=self._teacher_where(shard))

    def _teacher_where(self, shard: int) -> dict[str, str]:
        """Each teacher's shard of this index, as messages name it, by its columns' prefix."""
        named = {} if self.teacher_paths is None else {"teacher_": str(self.teacher_paths[shard])}
        return named | {prefix: str(paths[shard]) for prefix, paths, _, _ in self.more}

    def _keep(self, shard: int, decoded: DecodedShard) -> None:
        if shard not in self.kept and self.kept_bytes + decoded.nbytes <= self.config.keep_decoded_bytes:
            self.kept[shard] = decoded
            self.kept_bytes += decoded.nbytes

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        mine = [batch for i, batch in enumerate(self.batches(self.epoch)) if i >= self.start_batch and i % nw == wid]
        todo = [s for s in dict.fromkeys(s for batch in mine for s, _ in batch) if s not in self.kept]  # in order of first use
        position = {s: j for j, s in enumerate(todo)}
        ahead = self.config.decode_threads if self.config.prefetch else 0
        pool = ThreadPoolExecutor(max(1, ahead), thread_name_prefix="opdcache-decode")
        try:
            pending = {}  # shard -> future: the next shards, decoded in the thread while this one's batches are collated
            in_use: dict[int, DecodedShard] = {}

            def load(shard: int) -> DecodedShard:
                if shard in self.kept:
                    return self.kept[shard]
                if shard not in in_use:
                    in_use.clear()  # one shard in use at a time (besides the kept ones)
                    j = position[shard]
                    for nxt in [shard] + todo[j + 1: j + 1 + ahead]:
                        if nxt not in pending and nxt not in self.kept:
                            pending[nxt] = pool.submit(self._decode, nxt)
                    in_use[shard] = pending.pop(shard).result()  # a refusal is raised here, when the shard is needed
                    self._keep(shard, in_use[shard])
                return in_use[shard]

            for batch in mine:
                runs = [(load(s), rows) for s, rows in batch]
                yield collate_packed(runs) if self.config.pack else collate_decoded([(d, r) for d, rows in runs for r in rows.tolist()])
        finally:  # an epoch cut short (the consumer stopped): nothing more is decoded
            pool.shutdown(wait=True, cancel_futures=True)


_OPEN_EPOCHS: weakref.WeakSet = weakref.WeakSet()
"""Epochs still open (a loader's batches not all taken, its decoding threads alive), closed at exit."""


@atexit.register
def _close_open_epochs() -> None:
    """At exit, while every module is still whole: each open epoch stops its decoding threads (closed later, during
    the interpreter's teardown, its thread pool would find its own modules gone and print an ignored exception)."""
    for epoch in list(_OPEN_EPOCHS):
        epoch.close()


class CacheLoader:
    """Batches from a cache with an exact, resumable position: epoch and batches consumed. ``num_workers`` > 0 runs the
    dataset in a torch DataLoader's worker processes; 0 iterates it in this process."""

    def __init__(self, config: CacheLoaderConfig):
        self.config = config
        self.dataset = CacheDataset(config)
        self.epoch = 0
        self.consumed = 0  # batches of the current epoch already handed out

    def __len__(self) -> int:
        return len(self.dataset.batches(self.epoch))

    def __iter__(self):
        self.dataset.epoch, self.dataset.start_batch = self.epoch, self.consumed
        if self.config.num_workers:
            loader = torch.utils.data.DataLoader(self.dataset, batch_size=None, num_workers=self.config.num_workers,
                                                 persistent_workers=False, prefetch_factor=4)
        else:  # the dataset's own batches: a DataLoader in the main process adds only its per-batch overhead (10% of a kept epoch)
            loader = iter(self.dataset)
            _OPEN_EPOCHS.add(loader)
        total = len(self.dataset.batches(self.epoch))
        for batch in loader:
            self.consumed += 1
            if self.consumed == total:  # the epoch ends with its last batch handed out, not when a consumer asks for
                self.epoch, self.consumed = self.epoch + 1, 0  # one more (a Trainer that stops at len() never does)
            yield batch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "consumed": self.consumed, "seed": self.config.seed, "batch_size": self.config.batch_size,
                "rank": self.dataset.rank, "world_size": self.dataset.world}

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "batch_size", "world_size"):
            if state[key] != self.state_dict()[key]:
                raise ConfigError(f"cannot resume the loader: {key} was {state[key]}, now {self.state_dict()[key]}")
        self.epoch, self.consumed = state["epoch"], state["consumed"]
