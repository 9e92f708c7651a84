"""Model provenance: fingerprints with the facts that change a model's outputs, and SFT lineage.

``opdcache sft`` writes ``opdcache_lineage.json`` into the fine-tuned model's directory, naming the
teacher whose trajectories it learned from (papers/000, teacher consistency). ``build-rollouts`` reads it
(or ``--sft-teacher`` for a pi_ref trained elsewhere) into the cache's lineage, and ``score-teacher``
compares it with the scoring teacher.
"""

from __future__ import annotations

import json
from pathlib import Path

from opdcache.errors import ConfigError, TokenizerMismatchError
from opdcache.inputs.fingerprint import model_fingerprint, tokenizer_description, tokenizer_fingerprint
from opdcache.inputs.models import ModelRef, resolve_model

LINEAGE_FILE = "opdcache_lineage.json"


def model_info(model: "str | Path | ModelRef", **engine) -> dict:
    """The manifest's record of a model: local path or Hub repo id, the Hub commit, fingerprint, how it was run."""
    ref = resolve_model(model)
    path = ref.path
    cfg = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else {}
    info = {
        "name_or_path": ref.name,
        "revision": ref.commit,
        "fingerprint": model_fingerprint(path),
        "dtype": engine.get("dtype") or cfg.get("torch_dtype") or cfg.get("dtype"),
        "quantization": engine.get("quantization"),
        "engine": engine.get("engine"),
        "engine_version": engine.get("engine_version"),
    }
    if engine.get("logprobs_mode"):
        info["logprobs_mode"] = engine["logprobs_mode"]
    if engine.get("served"):  # what a served engine's servers were (kind, version, served name; never where)
        info["served"] = engine["served"]
    if engine.get("exact"):  # what fixes the exact arithmetic (opdcache/backends/exact.py); absent otherwise
        info["exact"] = engine["exact"]
    return info


def read_sft_lineage(model: "str | Path | ModelRef") -> dict | None:
    path = resolve_model(model).path / LINEAGE_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def write_sft_lineage(model_dir: str | Path, sft_teacher: dict, data_fingerprint: str, base_model: dict, settings: dict | None = None) -> None:
    """Record what an SFT run was trained from and how (``settings``: the SFT settings, so a rerun can recognise it)."""
    from opdcache.storage import write_text_atomic

    record = {"sft_teacher": sft_teacher, "sft_data_fingerprint": data_fingerprint, "base_model": base_model}
    if settings is not None:
        record["sft_settings"] = settings
    write_text_atomic(Path(model_dir) / LINEAGE_FILE, json.dumps(record, indent=2, sort_keys=True) + "\n")


def resolve_sft_teacher(pi_ref: str | Path, sft_teacher: str | Path | None) -> dict | None:
    """pi_ref's SFT teacher: from its lineage file, or from --sft-teacher; both must agree when both exist."""
    recorded = read_sft_lineage(pi_ref)
    recorded = recorded["sft_teacher"] if recorded else None
    if sft_teacher is None:
        return recorded
    given = model_info(resolve_model(sft_teacher, what="--sft-teacher"))
    if recorded and recorded["fingerprint"] != given["fingerprint"]:
        raise ConfigError(
            f"--sft-teacher {sft_teacher} (fingerprint {given['fingerprint'][:12]}) is not the teacher recorded in "
            f"{pi_ref}/{LINEAGE_FILE} ({recorded['name_or_path']}, {recorded['fingerprint'][:12]}); drop --sft-teacher or fix it"
        )
    return given


def check_same_tokenizer(expected_fp: str, tokenizer, what: str, expected_tokenizer=None, hint: str = "") -> None:
    """Refuse a tokenizer whose fingerprint differs, saying which special tokens or vocabulary entries differ (and
    ``hint``, what else the user can do)."""
    got = tokenizer_fingerprint(tokenizer)
    if got == expected_fp:
        return
    detail = ""
    if expected_tokenizer is not None:
        detail = "; " + tokenizer_difference(expected_tokenizer, tokenizer)
    raise TokenizerMismatchError(
        f"{what} uses a different tokenizer (fingerprint {got[:12]}, the cache has {expected_fp[:12]}){detail}. "
        "Teacher and student must share one tokenizer: token ids are compared position by position" + (hint or ".")
    )


def check_vocab_sizes(tokenizer, model_vocab: int, model_name: str) -> int:
    """Return how many ids the tokenizer can decode; refuse a tokenizer with ids the model cannot score.

    A tokenizer larger than the model's vocabulary is an error (prompt ids past the unembedding). A smaller one
    is normal (Qwen3 pads 151,669 tokens to 151,936 rows) and allowed; a sampled id past the tokenizer is then
    quarantined with its row (:func:`undecodable_reason`), never written."""
    size = len(tokenizer)
    if size > model_vocab:
        raise TokenizerMismatchError(
            f"the tokenizer of {model_name} has {size} tokens but the model's vocabulary has {model_vocab} rows: ids "
            f"{model_vocab}..{size - 1} cannot be scored. Use the tokenizer saved with the model")
    return size


def undecodable_reason(response_ids, decodable: int, model_vocab: int) -> str | None:
    """Why a sampled response cannot be kept: an id the tokenizer cannot decode (None if every id decodes)."""
    if decodable >= model_vocab or len(response_ids) == 0:
        return None
    worst = int(max(response_ids))
    if worst < decodable:
        return None
    return (f"sampled token id {worst} that the tokenizer cannot decode (tokenizer {decodable} tokens, "
            f"model vocabulary {model_vocab})")


def tokenizer_difference(a, b) -> str:
    """A short human description of how two tokenizers differ."""
    da, db = tokenizer_description(a), tokenizer_description(b)
    parts = []
    sa, sb = da["special_tokens"], db["special_tokens"]
    for key in sorted(set(sa) | set(sb)):
        if sa.get(key) != sb.get(key):
            parts.append(f"special token {key}: {sa.get(key)!r} vs {sb.get(key)!r}")
    va, vb = a.get_vocab(), b.get_vocab()
    only_a = sorted(set(va) - set(vb))
    only_b = sorted(set(vb) - set(va))
    moved = sorted(t for t in set(va) & set(vb) if va[t] != vb[t])
    if only_a:
        parts.append(f"{len(only_a)} tokens only in the cache's tokenizer (e.g. {only_a[:3]})")
    if only_b:
        parts.append(f"{len(only_b)} tokens only in the new one (e.g. {only_b[:3]})")
    if moved:
        parts.append(f"{len(moved)} tokens with different ids (e.g. {moved[0]!r}: {va[moved[0]]} vs {vb[moved[0]]})")
    if da["chat_template"] != db["chat_template"]:
        parts.append("chat templates differ")
    if not parts:
        parts.append("normaliser, pre-tokeniser or merges differ")
    return "; ".join(parts)


def recorded_model(record: dict, override: "str | Path | None", flag: str, what: str) -> Path:
    """The weights to re-compute ``what`` with. ``override`` (the user's ``flag``) must carry the recorded fingerprint
    when the record has one. Without it, the path the manifest records is a hint from an untrusted file, used only
    when it holds a model whose weights are safetensors (nothing loaded through pickle) and whose fingerprint is the
    recorded one; the caller is told which model was taken. Anything else is refused in one line asking for ``flag``."""
    from opdcache.inputs.fingerprint import WEIGHT_SUFFIXES

    fingerprint = record.get("fingerprint")
    short = str(fingerprint)[:12]
    if override is not None:
        path = Path(override)
        if not (path / "config.json").is_file():
            raise ConfigError(f"{flag} {path} is not a local Hugging Face model directory (no config.json)")
        if fingerprint and model_fingerprint(path) != fingerprint:
            raise ConfigError(f"{flag} {path} (fingerprint {model_fingerprint(path)[:12]}) is not the model that wrote {what} "
                              f"({short}); pass the same weights")
        return path
    hint = str(record.get("name_or_path") or "")
    ask = f"pass {flag} PATH (the model {hint[:200]!r}, fingerprint {short})"
    path = Path(hint)
    if not fingerprint or not hint or not (path / "config.json").is_file():
        raise ConfigError(f"{what}'s model is not at the path the cache records; {ask}")
    pickled = sorted(p.name for p in path.rglob("*") if p.suffix in WEIGHT_SUFFIXES and p.suffix != ".safetensors")
    if pickled:
        raise ConfigError(f"the recorded model folder {hint[:200]!r} holds weights that load through pickle ({', '.join(pickled[:3])}); "
                          f"a cache's recorded path is only a hint: {ask}")
    if model_fingerprint(path) != fingerprint:
        raise ConfigError(f"the model at the recorded path {hint[:200]!r} does not carry the recorded fingerprint {short}; {ask}")
    print(f"note: {what}: the recorded model, fingerprint {short}, at\n  {hint[:200]}")
    return path
