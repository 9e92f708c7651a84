"""Fingerprints: short, stable hashes of what determines a cache's content.

* :func:`config_fingerprint` -- sha256 of the sorted-key JSON of a config dict, chained to a parent.
* :func:`model_fingerprint`  -- a model directory's config plus the sha256 of each weight file, read in
  blocks and never loaded into memory as tensors; in a Hub cache snapshot, taken from the blob's name
  (Git LFS objects are named by their sha256), so tens of GB are not re-read.
* :func:`tokenizer_fingerprint` -- vocabulary, merges, normaliser and pre-tokeniser, special and added
  tokens, and the chat template.

Everything is hashed from explicit JSON (never pickle), so fingerprints agree across processes,
machines and Python versions. A test checks that they do, and that meaningful changes move them.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from opdcache.errors import ConfigError

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
# Files that hold nothing that changes a model's outputs (docs, licences, training state).
_IGNORED_FILES = {"README.md", "LICENSE", "opdcache_lineage.json", "training_args.bin", "trainer_state.json"}


def canonical_json(obj: Any) -> str:
    """Compact sorted-key JSON: the one serialisation every fingerprint hashes."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def hash_json(obj: Any) -> str:
    return hashlib.sha256(canonical_json(obj).encode()).hexdigest()


def config_fingerprint(config: dict, parent: str | None = None) -> str:
    """Hash of everything that determines a table's content, chained to the parent cache's fingerprint."""
    return hash_json({"config": config, "parent": parent})


def sha256_file(path) -> str:
    """sha256 of a local file or an object-store object (opdcache.storage paths)."""
    from opdcache.storage import as_path, sha256_of

    return sha256_of(as_path(path))


def _cached_file_hash(path: Path) -> str:
    """sha256 of a weight file, memoised on (absolute path, size, mtime) so large models hash once."""
    from opdcache.inputs.models import hub_blob_sha256

    named = hub_blob_sha256(path)  # a Hub cache snapshot: the blob's name is the content's sha256
    if named is not None:
        return named
    stat = path.stat()
    key = hash_json([str(path.resolve()), stat.st_size, stat.st_mtime_ns])
    cache_dir = Path(os.environ.get("OPDCACHE_HASH_CACHE", Path.home() / ".cache" / "opdcache" / "hashes"))
    memo = cache_dir / key
    try:
        return memo.read_text().strip()
    except OSError:
        pass
    digest = sha256_file(path)
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(digest)
        tmp.replace(memo)
    except OSError:
        pass  # a read-only home only costs a re-hash next time
    return digest


def model_fingerprint(path: str | os.PathLike) -> str:
    """Fingerprint of a local Hugging Face model directory: its config.json plus every weight file's sha256.

    The generation config is included (it changes sampling defaults); the tokenizer is fingerprinted
    separately. Weights are hashed as bytes on disk, so the same checkpoint saved with a different shard
    layout gets a different fingerprint -- a deliberate, conservative choice.
    """
    root = Path(path)
    config_path = root / "config.json"
    if not config_path.is_file():
        raise ConfigError(f"{root} is not a model directory: no config.json (pass a local Hugging Face model folder)")
    config = json.loads(config_path.read_text())
    # Keys that name where or how a file was saved, not what the model computes.
    for key in ("_name_or_path", "transformers_version", "_commit_hash"):
        config.pop(key, None)
    gen_path = root / "generation_config.json"
    generation = json.loads(gen_path.read_text()) if gen_path.is_file() else None
    if generation:
        generation.pop("transformers_version", None)
    weights = {
        p.relative_to(root).as_posix(): _cached_file_hash(p)
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.suffix in WEIGHT_SUFFIXES and p.name not in _IGNORED_FILES
    }
    if not weights:
        raise ConfigError(f"{root} has no weight files ({', '.join(WEIGHT_SUFFIXES)})")
    return hash_json({"config": config, "generation_config": generation, "weights": weights})


def tokenizer_description(tokenizer) -> dict:
    """Everything about a tokenizer that changes the ids it produces or the prompts it builds."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        spec = json.loads(backend.to_str())
        spec.pop("truncation", None)
        spec.pop("padding", None)
    else:  # slow tokenizers: the vocabulary is what we can see
        spec = {"vocab": tokenizer.get_vocab()}
    template = getattr(tokenizer, "chat_template", None)
    return {
        "spec": spec,
        "special_tokens": {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())},
        "chat_template": template,
    }


def tokenizer_fingerprint(tokenizer) -> str:
    return hash_json(tokenizer_description(tokenizer))


def chat_template_hash(tokenizer) -> str | None:
    template = getattr(tokenizer, "chat_template", None)
    return hashlib.sha256(template.encode()).hexdigest() if template else None


def row_id(prompt_ids, sample_index: int) -> str:
    """Stable row id: 16 hex chars of the sha256 of the prompt token ids, then the sample index."""
    import numpy as np

    digest = hashlib.sha256(np.asarray(prompt_ids, dtype="<i4").tobytes()).hexdigest()[:16]
    return f"{digest}-{sample_index}"
