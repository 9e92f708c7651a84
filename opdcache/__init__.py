"""opdcache: offline on-policy distillation caches.

Teacher signals are computed once over rollouts of the SFT student (pi_ref), stored as sharded Parquet
with a versioned schema and a manifest, and trained from without a live teacher (Lightning OPD).
"""

__version__ = "0.1.0"
