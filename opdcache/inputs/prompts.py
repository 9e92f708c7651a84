"""Reading prompts: JSONL, Parquet, or a local ``datasets`` directory, into token ids.

The chat template is applied once, here, and its hash recorded; the ids it gives are the ids stored
and fed to the engines, never re-tokenised later. Malformed rows (bad JSON, missing or empty field) are
collected with their line numbers and reasons; prompts too long for the model are skipped and counted;
duplicates are reported. Nothing is dropped silently: every skipped row is in the errors list.
"""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from opdcache.errors import ConfigError, InputError
from opdcache.inputs.fingerprint import chat_template_hash


TEMPLATE_CALL_ARGUMENTS = frozenset({
    "conversation", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message", "tokenize",
    "padding", "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})
"""apply_chat_template's own arguments: a --chat-template-kwargs key among them would collide with opdcache's call."""


@dataclass(frozen=True)
class PromptConfig:
    """How prompts are read and turned into token ids."""

    path: Path
    """Prompts: .jsonl, .parquet, a datasets directory (save_to_disk), or a Hub dataset id org/name[@revision]
    (offline from the Hub cache)."""
    prompt_field: str | None = "prompt"
    """Field holding the user message (the chat template is applied to it)."""
    messages_field: str | None = None
    """Field holding a list of chat messages ({role, content}); overrides the prompt field (default: none,
    plain prompts)."""
    answer_field: str | None = "answer"
    """Field holding the reference answer, optional in the data (copied to the `answer` column)."""
    chat_template: bool = True
    """Apply the tokenizer's chat template (with the generation prompt); otherwise tokenise the raw text."""
    strict: bool = False
    """Stop at the first malformed row instead of recording it and going on."""
    limit: int | None = None
    """Read at most this many prompt rows (default: none, all of them)."""
    system_prompt: str | None = None
    """A system turn put before every prompt that has none."""
    chat_template_kwargs: dict | None = None
    """Extra variables for the chat template, e.g. {"enable_thinking": true} for Qwen3."""
    split: str = "train"
    """The split to read when the prompts are a Hub dataset id."""
    revision: str | None = None
    """Hub revision of a dataset id (or org/name@revision)."""

    def __post_init__(self) -> None:
        check_local_prompts(Path(self.path))  # a FIFO or a device is refused here, at argument checking
        if self.chat_template_kwargs is not None and not isinstance(self.chat_template_kwargs, dict):
            raise ConfigError(f"--chat-template-kwargs must be a JSON object, got {self.chat_template_kwargs!r}")
        taken = sorted(set(self.chat_template_kwargs or {}) & TEMPLATE_CALL_ARGUMENTS)
        if taken:
            raise ConfigError(f"--chat-template-kwargs may not set {', '.join(taken)}: opdcache passes those to "
                              "apply_chat_template itself (the template's own variables only, e.g. enable_thinking)")
        if not self.prompt_field and not self.messages_field:
            raise ConfigError("give --prompt-field or --messages-field")
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"--limit must be at least 1, got {self.limit}")


@dataclass(frozen=True)
class Prompt:
    index: int  # row (line) number in the input, 0-based
    prompt_ids: tuple[int, ...]
    answer: str | None
    metadata: str | None  # the row's other fields, JSON


@dataclass
class PromptSet:
    prompts: list[Prompt]
    errors: list[dict] = field(default_factory=list)  # {"line": 1-based, "reason": ...}
    too_long: int = 0
    duplicates: dict[str, list[int]] = field(default_factory=dict)  # prompt hash -> 1-based lines
    fingerprint: str = ""  # sha256 over every kept prompt's row index, token ids, answer and metadata
    prompt_tokens: int = 0  # token ids over all kept prompts
    unknown_tokens: int = 0  # of those, the tokenizer's unknown token (text it could not map)
    chat_template_sha256: str | None = None

    @property
    def malformed(self) -> int:
        return len(self.errors) - self.too_long

    @property
    def unknown_rate(self) -> float:
        return self.unknown_tokens / max(self.prompt_tokens, 1)

    def summary(self) -> str:
        dup_rows = sum(len(v) - 1 for v in self.duplicates.values())
        unk = f"; {self.unknown_tokens} unknown tokens ({self.unknown_rate:.2%} of prompt tokens)" if self.unknown_tokens else ""
        return (f"{len(self.prompts)} prompts read; {self.malformed} malformed rows skipped; {self.too_long} too long "
                f"for the model skipped; {dup_rows} duplicate rows kept (reported){unk}")


MAX_LINE_BYTES = 16 << 20  # a prompt line longer than this is skipped as malformed, never read whole


def check_local_prompts(path: Path, must_exist: bool = False) -> None:
    """Refuse, before any model loads, a --prompts that is neither a directory nor a regular file (a FIFO would block
    forever and a device such as /dev/zero never ends), and with ``must_exist`` (a job about to start) one that does not
    exist, unless it is a Hub dataset id (org/name, whose org is no folder here)."""
    import stat

    from opdcache.inputs.models import is_hub_id

    try:
        mode = path.stat().st_mode
    except OSError:
        if must_exist and (not is_hub_id(str(path)) or path.parent.is_dir() and path.parent != Path(".")):  # a local path
            raise InputError(f"prompt file {path} does not exist; check --prompts") from None
        return
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        kind = "a FIFO" if stat.S_ISFIFO(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode) else "not a regular file"
        raise InputError(f"--prompts {path} is {kind}, not a file; write the prompts to a .jsonl or .parquet file (or pass a datasets directory)")


def _bounded_lines(f) -> Iterator[tuple[bytes, bool]]:
    """(line, too long) for each line of a binary file; a line over MAX_LINE_BYTES is skipped in chunks, never held."""
    while True:
        raw = f.readline(MAX_LINE_BYTES + 1)
        if not raw:
            return
        if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
            while True:  # drop the rest of the line
                more = f.readline(MAX_LINE_BYTES)
                if not more or more.endswith(b"\n"):
                    break
            yield b"", True
            continue
        yield raw, False


def _rows(path: Path) -> Iterator[tuple[int, dict | None, str | None]]:
    """(1-based line, row or None, error) for each input row."""
    if not path.exists():
        raise InputError(f"prompt file {path} does not exist; check --prompts")
    check_local_prompts(path)
    if path.is_dir():
        import datasets

        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            raise InputError(f"{path} holds several splits ({', '.join(ds)}); point at one split's directory")
        for i, row in enumerate(ds):
            yield i + 1, row, None
    elif path.suffix == ".parquet":
        import pyarrow.parquet as pq

        for i, row in enumerate(pq.read_table(path).to_pylist()):
            yield i + 1, row, None
    elif path.suffix in (".jsonl", ".json", ".ndjson"):
        with open(path, "rb") as f:
            for i, (raw, too_long) in enumerate(_bounded_lines(f)):
                if too_long:
                    yield i + 1, None, f"line longer than {MAX_LINE_BYTES >> 20} MiB"
                    continue
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:  # one bad line, not the whole file
                    yield i + 1, None, f"undecodable bytes (not UTF-8) at byte {exc.start}"
                    continue
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    yield i + 1, None, f"invalid JSON: {exc.msg} at column {exc.colno}"
                    continue
                except RecursionError:  # e.g. a 200,000-deep nested list: one bad line, not the whole job
                    yield i + 1, None, "invalid JSON: nested too deeply to read"
                    continue
                if not isinstance(row, dict):
                    yield i + 1, None, f"expected a JSON object, got {type(row).__name__}"
                    continue
                yield i + 1, row, None
    else:
        raise InputError(f"cannot read prompts from {path}: use .jsonl, .parquet, or a datasets directory")


def resolve_prompts(cfg: PromptConfig) -> Path:
    """A local prompts path, or a Hub dataset id (org/name[@revision]) resolved to the split's data in the local Hub
    cache (downloaded only when missing and HF_HUB_OFFLINE is not set): a Parquet or JSONL file of the snapshot whose
    path names the split."""
    from opdcache.inputs.models import hub_snapshot, is_hub_id

    local = Path(cfg.path).expanduser()
    text = str(cfg.path)
    if local.exists() or not is_hub_id(text):
        return local

    snapshot = hub_snapshot(text, cfg.revision, "--prompts", repo_type="dataset")
    files = sorted(p for p in snapshot.rglob("*") if p.is_file() and p.suffix in (".parquet", ".jsonl", ".json")
                   and cfg.split in p.relative_to(snapshot).as_posix())
    if not files:
        raise InputError(f"--prompts {text}: no .parquet or .jsonl file of split {cfg.split!r} in the dataset snapshot {snapshot}")
    if len(files) > 1:
        raise InputError(f"--prompts {text}: split {cfg.split!r} has {len(files)} files ({', '.join(f.name for f in files[:3])}, ...); "
                         "point --prompts at one of them in the snapshot")
    return files[0]


def _messages(row: dict, cfg: PromptConfig) -> tuple[list[dict] | None, str | None]:
    if cfg.messages_field:
        msgs = row.get(cfg.messages_field)
        if msgs is None:
            return None, f"missing field {cfg.messages_field!r}"
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) and "role" in m and "content" in m for m in msgs):
            return None, f"field {cfg.messages_field!r} must be a non-empty list of {{role, content}} messages"
        if not any(str(m["content"]).strip() for m in msgs):
            return None, "empty prompt"
        return msgs, None
    text = row.get(cfg.prompt_field)
    if text is None:
        return None, f"missing field {cfg.prompt_field!r}"
    if not isinstance(text, str):
        return None, f"field {cfg.prompt_field!r} must be a string, got {type(text).__name__}"
    if not text.strip():
        return None, "empty prompt"
    return [{"role": "user", "content": text}], None


def _tokenize(row: dict, cfg: PromptConfig, tokenizer) -> tuple[tuple[int, ...] | None, str | None, str | None, str | None]:
    """(prompt ids, metadata JSON, answer, error) of one row; raises on whatever the row's content makes fail."""
    msgs, error = _messages(row, cfg)
    if error is not None:
        return None, None, None, error
    if cfg.system_prompt and not any(m.get("role") == "system" for m in msgs):
        msgs = [{"role": "system", "content": cfg.system_prompt}] + list(msgs)
    if cfg.chat_template:
        text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False, **(cfg.chat_template_kwargs or {}))
    else:
        text = "".join(str(m["content"]) for m in msgs)
    text.encode("utf-8")  # a lone surrogate (valid JSON, not valid text) fails here, for this row
    ids = tuple(tokenizer(text, add_special_tokens=not cfg.chat_template)["input_ids"])
    extra = {k: v for k, v in row.items() if k not in (cfg.prompt_field, cfg.messages_field, cfg.answer_field)}
    meta = json.dumps(extra, sort_keys=True, default=str) if extra else None
    if meta is not None:
        meta.encode("utf-8")
    answer = row.get(cfg.answer_field) if cfg.answer_field else None
    answer = None if answer is None else str(answer)
    if answer is not None:
        answer.encode("utf-8")
    return ids, meta, answer, None


def read_prompts(cfg: PromptConfig, tokenizer, max_prompt_tokens: int | None) -> PromptSet:
    """Read and tokenise prompts; ``max_prompt_tokens`` is the model's limit minus max new tokens."""
    template = getattr(tokenizer, "chat_template", None)
    if cfg.chat_template and not template:
        raise ConfigError("the tokenizer has no chat template; pass --no-chat-template to tokenise the raw prompt text")
    out = PromptSet(prompts=[], chat_template_sha256=chat_template_hash(tokenizer) if cfg.chat_template else None)
    seen: dict[str, list[int]] = defaultdict(list)
    digest = hashlib.sha256()
    unk = getattr(tokenizer, "unk_token_id", None)
    for line, row, error in _rows(resolve_prompts(cfg)):
        if cfg.limit is not None and line > cfg.limit:
            break
        ids = None
        if error is None:
            try:  # anything one row does (a lone surrogate, a template error, an odd type) fails that row only
                ids, extra, answer, error = _tokenize(row, cfg, tokenizer)
            except Exception as exc:  # noqa: BLE001
                first = (str(exc).strip().splitlines() or [""])[0][:200]
                error = f"could not turn the row into prompt ids: {type(exc).__name__}: {first}"
        if error is not None:
            if cfg.strict:
                raise InputError(f"{cfg.path} line {line}: {error} (drop --strict to skip such rows)")
            out.errors.append({"line": line, "reason": error})
            continue
        if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
            out.too_long += 1
            out.errors.append({"line": line, "reason": f"prompt has {len(ids)} tokens, more than the {max_prompt_tokens} allowed "
                                                       "(model limit minus --max-new-tokens)"})
            continue
        key = hashlib.sha256(json.dumps(ids).encode()).hexdigest()
        seen[key].append(line)
        prompt = Prompt(line - 1, ids, answer, extra)
        out.prompts.append(prompt)
        out.prompt_tokens += len(ids)
        if unk is not None:
            out.unknown_tokens += ids.count(unk)
        # everything a stored row copies from its prompt: a changed answer, metadata or row number changes the cache
        digest.update(json.dumps([prompt.index, key, prompt.answer, prompt.metadata]).encode())
    out.duplicates = {k: v for k, v in seen.items() if len(v) > 1}
    out.fingerprint = digest.hexdigest()
    if not out.prompts:
        raise InputError(f"no usable prompts in {cfg.path}: {out.summary()}"
                         + (f"; first problem: line {out.errors[0]['line']}: {out.errors[0]['reason']}" if out.errors else ""))
    return out


def write_errors(path, prompts: PromptSet):
    """Write the skipped rows and duplicate report next to a cache (errors.jsonl); None when there are none."""
    from opdcache.storage import write_text_atomic

    if not prompts.errors and not prompts.duplicates:
        return None
    lines = [json.dumps(e) + "\n" for e in prompts.errors]
    lines += [json.dumps({"lines": lines, "reason": "duplicate prompt (all copies kept)"}) + "\n" for lines in prompts.duplicates.values()]
    write_text_atomic(path, "".join(lines))
    return path
