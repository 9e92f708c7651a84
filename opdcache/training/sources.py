"""Where the trainer's batches come from: a finished cache (``CacheSource``), fresh online rollouts
(opdcache/training/online.py), or the async learner's queue (opdcache/asyncopd), and the teacher head the full-vocabulary
losses need beside them.

Every batch source has ``next_batch()``, ``state_dict()`` and ``load_state_dict()``; it may also have
``after_step(trainer, record, saved)`` (called once a step is checkpointed: the async learner's ledger and snapshots),
``after_resume(trainer)`` and ``step_stats()``. Memory: the loader's (opdcache/training/data.py) and, for the full-vocabulary
losses, the teacher's unembedding [vocabulary, hidden] (or, from an svd store, the decoder [vocabulary, rank]).
"""

from __future__ import annotations

from opdcache.errors import ConfigError
from opdcache.training.trainconfig import stores_for


class CacheSource:
    """The offline learner's batches: a CacheLoader over a finished cache, epoch after epoch."""

    def __init__(self, config):
        from opdcache.training.data import CacheLoader

        self.loader = CacheLoader(config)
        self._iter = self._first = None

    def prime(self) -> None:
        """Take the first batch now: its shards read, checked and decoded (the next ones start decoding in the
        loader's threads). Called before the student's weights load, so that damage there is refused before minutes
        of loading, and the decoding overlaps the load."""
        self._iter = iter(self.loader)
        self._first = next(self._iter, None)

    def next_batch(self) -> dict:
        if self._first is not None:
            batch, self._first = self._first, None
            return batch
        if self._iter is None:
            self._iter = iter(self.loader)
        try:
            return next(self._iter)
        except StopIteration:
            self._iter = iter(self.loader)
            return next(self._iter)

    def state_dict(self) -> dict:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self._iter = self._first = None  # a primed first batch is not where the run resumes
        self.loader.load_state_dict(state)


def check_rollout_model(cfg, cache, model_path) -> None:
    """Lightning OPD trains pi_ref on pi_ref's own rollouts: refuse another --model unless told (the importance
    weights, the KL penalty and the cached ref_logprobs would all describe a different policy)."""
    from opdcache.inputs.fingerprint import model_fingerprint

    sampler = (cache.table(cache.base_table).get("model") or {}) if cache.base_table == "rollouts" else {}
    if not sampler.get("fingerprint") or cfg.allow_other_model:
        return
    mine = model_fingerprint(model_path)
    if mine != sampler["fingerprint"]:
        raise ConfigError(f"--model {cfg.model} (fingerprint {mine[:12]}) is not the model that sampled the cache's rollouts, "
                          f"{sampler.get('name_or_path')} ({sampler['fingerprint'][:12]}); train that model, or pass "
                          "--allow-other-model to train this one on them anyway")


def open_online(cfg, model, device):
    """(live rollouts of ``model``, the teacher head for the full-vocabulary losses or None), for ``cfg.online``."""
    from opdcache.training.online import OnlineSource

    source = OnlineSource(cfg, model, device)
    if source.want_hidden:
        from opdcache.stores.head import head_of

        return source, head_of(source.teacher.model)
    return source, None


def open_cache(cfg, facts, model_path):
    """(the cache's loader, the teacher head for the full-vocabulary losses or None), checked against the student's
    :class:`~opdcache.inputs.models.ModelFacts` (its vocabulary and context) before its weights load, after checking
    the cache's rollouts were sampled by ``model_path``: every shard's footer, and the values of the shards the first
    batch reads (the others are checked as they are first read)."""
    from opdcache.format.cache import Cache
    from opdcache.training.data import CacheLoaderConfig

    cache = Cache(cfg.cache)
    check_rollout_model(cfg, cache, model_path)
    names = cfg.teachers or (None,)
    table = cache.teacher_table(names[0])  # the only teacher when not named
    params, vocab = cache.params(table), facts.vocab_size
    stores, rstores = stores_for(cfg.loss, cfg.topk_support, params.stores)
    source = CacheSource(CacheLoaderConfig(cache=cfg.cache, teacher=table.split("/", 1)[1], more_teachers=names[1:],
                                           route_field=cfg.teacher_route, stores=stores, rollout_stores=rstores,
                                           batch_size=cfg.batch_size, seed=cfg.seed, num_workers=cfg.num_loader_workers,
                                           max_length=facts.max_length, vocab_size=vocab, pack=cfg.pack))
    source.prime()  # the first batch's shards checked against the student's vocabulary and context
    from opdcache.stores import REGISTRY

    vectors = [REGISTRY[name] for name in stores if name in REGISTRY and REGISTRY[name].head is not None]
    if not vectors:
        return source, None
    head, width, path = vectors[0].head(cache, table, params)  # the hidden store's head, or the svd store's decoder
    return source, checked_head(head, vocab, width, path)


def check_teacher_table(cfg) -> None:
    """Refuse, from the manifest before any model loads, a loss the cache's teacher table cannot feed (a teacher with
    its own tokenizer and a loss that compares token ids, a missing store)."""
    if cfg.online or cfg.cache is None:
        return
    from opdcache.format.cache import Cache

    cache = Cache(cfg.cache)
    from opdcache.stores import gives, giving
    from opdcache.training.estimators import ESTIMATORS

    names = cfg.teachers or (None,)
    params = [cache.params(cache.teacher_table(name)) for name in names]
    tables = [p.stores for p in params]
    needs = [stores_for(cfg.loss, cfg.topk_support, stores)[0] for stores in tables]
    if ESTIMATORS[cfg.loss].span_topk and any(p.top_k is None for p in params):
        raise ConfigError(f"--loss {cfg.loss} reads the teacher's top-k where each group starts: score the teacher with "
                          "`score-teacher --prompts ... --top-k K`")
    if len(names) > 1:
        if any(gives(stores, "groups") for stores in tables):
            raise ConfigError("several teachers must share the student's tokenizer for now; a table with its own "
                              "(the aligned store) trains alone")
        if any(n != (giving("sampled_logprob"),) for n in needs):
            raise ConfigError(f"--loss {cfg.loss} reads each teacher's own support or vectors; several teachers combine the "
                              "losses that read only their log-probs (lightning, is, mc, ppo, span, topk-* with --topk-support ref)")


def checked_head(head, vocab: int, width: int, path):
    """The teacher's head (or an svd decoder) as the losses will use it: [vocab, width] with a [vocab] bias or none,
    vocab the student's, width the stored vectors'. A side file of other shapes is refused in one line, before a step
    would fail inside a matmul."""
    from opdcache.errors import SchemaError

    shape, bias = tuple(head.weight.shape), None if head.bias is None else tuple(head.bias.shape)
    if shape != (vocab, width) or bias not in (None, (vocab,)):
        raise SchemaError(f"{path} holds a [{', '.join(map(str, shape))}] matrix" + (f" and a {list(bias)} bias" if bias else "")
                          + f", where the student's vocabulary and the stored vectors need [{vocab}, {width}]; "
                          "score the teacher again for this student, or run `opdcache validate` on the cache")
    return head
