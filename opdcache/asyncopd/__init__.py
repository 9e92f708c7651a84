"""AsyncOPD over the cache (papers/001): rollout, teacher scoring and learner run at once, connected only by a cache.

The cache is the queue. Rollout batch b is shard b of the ``rollouts`` table, sampled by student snapshot
v(b) = max(0, b - K) (K = ``staleness``, papers/001 App. B: the target cache depth in train-batch steps); the teacher
worker writes shard b of ``teachers/<slug>`` as soon as rollout shard b exists; the learner consumes batch b at step
b + 1, recomputing log pi_theta and the advantage A_theta = T - log pi_theta at learner time with the unclipped
old-to-current weight pi_theta / pi_old (papers/001 eq. 7, or its m-sample form eq. 15), then publishes snapshot
v = b + 1 for the rollout worker. K = 0 is strict synchronous OPD; K >= steps never refreshes (Lightning OPD).

Because the snapshot of every batch is fixed by (b, K), a run is deterministic whatever the stages' relative speed: a
replay, a resume after any stage was killed, and an uninterrupted run write the same shards. Only *when* a batch is
produced depends on the machine (with K > 0 the rollout worker runs up to K batches ahead of the learner).

Modules: ``config`` (the settings), ``queue`` (where each batch and snapshot lives, waiting on them), ``stages`` (the
three workers), ``run`` (the supervisor that starts them, stops them on a failure, and finalizes the cache).
"""

from opdcache.asyncopd.config import AsyncConfig, learner
from opdcache.asyncopd.run import run_async

__all__ = ["AsyncConfig", "learner", "run_async"]
