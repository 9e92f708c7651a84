"""A resumable writer job run as a subprocess by test_resume.py (so it can be killed with SIGKILL)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from opdcache.format import schema as S  # noqa: E402
from opdcache.format.cache import TableJob, finalize_table, run_table_job  # noqa: E402
from synth import TOKENIZER, VOCAB, rollout_rows  # noqa: E402

PARAMS = S.StoreParams(stores=("base", "ref_topk", "mc", "task"), ref_top_k=4, mc_samples=3)


def job(root: str, num_shards: int, temperature: float = 0.8) -> TableJob:
    return TableJob(root, "rollouts", "rollouts", PARAMS, {"vocab_size": VOCAB, "sampling": {"temperature": temperature}}, num_shards)


def main(root: str, num_shards: int, temperature: float) -> None:
    j = job(root, num_shards, temperature)
    run_table_job(j, lambda i: rollout_rows(i, n_rows=400))
    finalize_table(j, tokenizer=TOKENIZER)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]) if len(sys.argv) > 3 else 0.8)
