"""The real teacher benchmarks measure on: SmolLM2-135M-Instruct's own chat-template math rollouts at temperature 1
(the model as its own pi_ref and teacher, as the storage frontier needs a real distribution, not a good student),
built once with opdcache's own build-rollouts and kept under ``~/.cache/opdcache/bench`` (``$OPDCACHE_BENCH_DATA``).

    python benchmarks/realdata.py            # builds it (about a minute on 2 cores) and prints its path
"""

from __future__ import annotations

import os
from pathlib import Path

PROMPTS, MAX_NEW_TOKENS, SHARDS = 64, 128, 4


def real_rollouts() -> tuple[Path, Path]:
    """(cache, model): the rollouts cache (64 prompts, 1 sample each, up to 128 tokens, 4 shards) and the model."""
    from opdcache.backends.base import SamplingConfig
    from opdcache.demo import real
    from opdcache.inputs.prompts import PromptConfig
    from opdcache.teacher.rollouts import GenerateJob, run_generate

    model = real.smollm2()
    root = Path(os.environ.get("OPDCACHE_BENCH_DATA", Path.home() / ".cache" / "opdcache" / "bench")) / f"smollm2-math-{PROMPTS}x{MAX_NEW_TOKENS}"
    cache = root / "cache"
    if not (cache / "opdcache.json").is_file():  # the manifest, written last
        root.mkdir(parents=True, exist_ok=True)
        prompts = real.write_math_prompts(root / "prompts.jsonl", PROMPTS)
        run_generate(GenerateJob(model=model, prompts=PromptConfig(prompts, messages_field="messages", system_prompt=real.MATH_SYSTEM),
                                 out=cache, num_shards=SHARDS, progress=False,
                                 sampling=SamplingConfig(temperature=1.0, max_new_tokens=MAX_NEW_TOKENS, samples=1)))
    return cache, model


if __name__ == "__main__":
    print(*real_rollouts())
