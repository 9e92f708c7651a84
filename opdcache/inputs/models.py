"""Where a model comes from: a local directory, or a Hub id (``org/name``, ``org/name@revision``) resolved through
``huggingface_hub`` to a snapshot in its cache.

Resolution never guesses: an existing directory is a local model (and must hold ``config.json``); a string that
looks like a path (``/``, ``./``, ``~``, a Windows drive) and does not exist is a missing directory, never a Hub
id; anything of the form ``org/name[@revision]`` that is not a local directory is a Hub id. A Hub id is looked up
in the local Hub cache first (no network); only if it is not there, and ``HF_HUB_OFFLINE`` is not set, is it
downloaded. The resolved commit is recorded in the manifest with the repo id.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from opdcache.errors import ConfigError

_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<rev>[\w./-]+))?$")


@dataclass(frozen=True)
class ModelRef:
    """A model resolved to a local directory, with its Hub identity when it came from the Hub."""

    path: Path
    """Local directory holding config.json and the weights (a Hub cache snapshot for Hub ids)."""
    repo_id: str | None = None
    """Hub repository id, or None for a local directory."""
    commit: str | None = None
    """The Hub commit the snapshot is at."""

    @property
    def name(self) -> str:
        """What the manifest and messages call the model: the repo id, or the local path."""
        return self.repo_id or str(self.path)


def is_hub_id(spec: str) -> bool:
    """``org/name`` or ``org/name@revision``, and not something that looks like a filesystem path."""
    return _HUB_ID.match(spec) is not None and not _looks_like_path(spec)


def _looks_like_path(spec: str) -> bool:
    return spec.startswith(("/", "./", "../", "~")) or bool(re.match(r"^[A-Za-z]:[\\/]", spec)) or spec in (".", "..")


def resolve_model(spec: str | os.PathLike, revision: str | None = None, what: str = "--model") -> ModelRef:
    """Resolve ``spec`` (a local directory or a Hub id, optionally ``@revision``) to a local model directory."""
    if isinstance(spec, ModelRef):
        return spec
    text = os.fspath(spec)
    local = Path(text).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise ConfigError(f"{what} {text} is a directory but not a Hugging Face model (no config.json); "
                              "pass the folder that holds config.json and the weights")
        return ModelRef(local)
    if local.exists() or not is_hub_id(text):
        raise ConfigError(f"{what} {text}: no such model directory (and not a Hub id of the form org/name); check the path")
    if local.parent.is_dir() and local.parent != Path("."):  # models/pi_ref with a models/ folder here: a mistyped path
        raise ConfigError(f"{what} {text}: no such directory ({local.parent}/ exists here, so this is read as a local path, "
                          "not a Hub id); check the path")
    path = hub_snapshot(text, revision, what)
    if not (path / "config.json").is_file():
        raise ConfigError(f"{what} {text}: the Hub snapshot {path} has no config.json; it is not a transformers model")
    return ModelRef(path, repo_id=_HUB_ID.match(text)["repo"], commit=path.name)  # the snapshot directory is named by its commit


def hub_snapshot(spec: str, revision: str | None, what: str, repo_type: str = "model") -> Path:
    """The local snapshot directory of a Hub repo ``org/name[@revision]``: from the Hub cache, downloaded only when it is
    missing there and HF_HUB_OFFLINE is not set."""
    from huggingface_hub import snapshot_download

    match = _HUB_ID.match(spec)
    if match is None:
        raise ConfigError(f"{what} {spec}: not a Hub id of the form org/name[@revision]")
    repo_id, at = match["repo"], match["rev"]
    if at and revision and at != revision:
        raise ConfigError(f"{what} {spec} names revision {at!r} but --revision says {revision!r}; give one")
    revision = at or revision

    cache_dir = os.environ.get("HF_HUB_CACHE") or None  # read at call time (huggingface_hub reads it once, at import)
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    try:
        path = snapshot_download(repo_id, revision=revision, repo_type=repo_type, cache_dir=cache_dir, local_files_only=True)
    except Exception as cached_exc:  # not in the local cache (or an incomplete snapshot)
        if offline:
            raise ConfigError(f"{what} {spec}: no local folder of that name here, and {repo_id}{'@' + revision if revision else ''} is not in the local Hub cache and HF_HUB_OFFLINE is set; "
                              f"download it first (`hf download {repo_id}{' --repo-type dataset' if repo_type == 'dataset' else ''}`) "
                              "or unset HF_HUB_OFFLINE") from cached_exc
        try:
            path = snapshot_download(repo_id, revision=revision, repo_type=repo_type, cache_dir=cache_dir)
        except Exception as exc:
            raise ConfigError(f"{what} {spec}: no local folder of that name here, and the Hub could not give {repo_id} "
                              f"({type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}); check the path, or "
                              "the network and the repo id") from exc
    return Path(path)


def hub_blob_sha256(path: Path) -> str | None:
    """The sha256 of a file in a Hub cache snapshot, from its blob's name, without reading it.

    Snapshot files are links to ``blobs/<name>``; Git LFS files (every weight file) are stored under their LFS
    object id, which is the sha256 of the content. Small non-LFS files are named by their git sha1 (40 hex
    digits) and return None, to be hashed as usual.
    """
    if not path.is_symlink():
        return None
    target = path.resolve()
    if target.parent.name == "blobs" and re.fullmatch(r"[0-9a-f]{64}", target.name):
        return target.name
    return None


def _has_auto_map(path) -> bool:
    """Whether a folder's config names custom code (auto_map), which opdcache never runs."""
    for name in ("config.json", "tokenizer_config.json"):
        try:
            if "auto_map" in json.loads((Path(path) / name).read_text()):
                return True
        except (OSError, ValueError, TypeError):
            continue
    return False


def _untrusted_load(what: str, path, load):
    """Run a transformers loader with remote code refused; any failure is one line naming ``what`` and the folder."""
    try:
        return load()
    except Exception as exc:  # noqa: BLE001 (transformers raises ValueError, OSError, JSONDecodeError, TypeError ...)
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:240]
        custom = "custom code" in first or "trust_remote_code" in first or _has_auto_map(path)
        hint = ("opdcache never runs code that comes with a model or a cache (auto_map); use a model whose architecture "
                "transformers ships" if custom else "check that the folder is a complete Hugging Face model/tokenizer")
        raise ConfigError(f"{path}: the {what} cannot be loaded ({type(exc).__name__}: {first}); {hint}") from None


def load_tokenizer(path):
    """A tokenizer from a local folder, never running code from it (trust_remote_code=False), errors in one line."""
    from transformers import AutoTokenizer

    return _untrusted_load("tokenizer", path, lambda: AutoTokenizer.from_pretrained(path, trust_remote_code=False))


def load_causal_lm(path, dtype):
    """A causal LM from a local folder, never running code from it (trust_remote_code=False), errors in one line."""
    from transformers import AutoModelForCausalLM

    return _untrusted_load("model", path, lambda: AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=False))


@dataclass(frozen=True)
class ModelFacts:
    """What a command checks its inputs against before a model's weights load: read from its config.json."""

    vocab_size: int
    """The output head's rows (transformers builds the head from the text config's ``vocab_size``)."""
    max_length: int
    """The longest sequence the model takes (``max_position_embeddings``; 2**20 when the config states none)."""
    hidden_size: int
    """The width of the vectors the head reads (``hidden_size``)."""


def _facts(text_config, vocab_size: int, hidden_size: int) -> ModelFacts:
    return ModelFacts(vocab_size=int(vocab_size), hidden_size=int(hidden_size),
                      max_length=int(getattr(text_config, "max_position_embeddings", None) or 1 << 20))


def model_facts(path) -> ModelFacts:
    """The :class:`ModelFacts` of a local model folder, from its configuration alone (no weights, no code run): a cache
    or a prompt file is checked against them in seconds whatever the model's size. :func:`check_facts` confirms them
    once the weights are in memory."""
    from transformers import AutoConfig

    config = _untrusted_load("model configuration", path, lambda: AutoConfig.from_pretrained(path, trust_remote_code=False))
    text = config.get_text_config()
    return _facts(text, text.vocab_size, text.hidden_size)


def facts_of(model) -> ModelFacts:
    """The :class:`ModelFacts` of a model in memory: its head's rows and width, its configuration's context."""
    head = model.get_output_embeddings().weight
    return _facts(model.config.get_text_config(), head.shape[0], head.shape[1])


def check_facts(model, facts: ModelFacts, path) -> None:
    """Refuse, in one line, a loaded model that is not what its config.json said (its inputs were checked against the
    configuration): its head's rows and width, its context."""
    found = facts_of(model)
    differ = [f"{name} {said} by its configuration, {got} loaded" for name, said, got in
              (("vocabulary rows", facts.vocab_size, found.vocab_size), ("hidden size", facts.hidden_size, found.hidden_size),
               ("context", facts.max_length, found.max_length)) if said != got]
    if differ:
        raise ConfigError(f"{path}: the model is not what its config.json says ({'; '.join(differ)}); fix the folder's config.json")
