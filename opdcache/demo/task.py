"""The embedded task: multi-digit addition solved with a written, column-by-column trace.

A prompt is ``"347+589"`` (operands zero-padded to ``digits`` digits). The reference solution walks
the columns from the right, writing each column's digits, the incoming carry and the two-digit column
sum, then the answer::

    347+589  ->  7+9+0=16;4+8+1=13;3+5+1=09;=0936

Two trace styles exist so that two teachers of the same task can differ in style (the teacher
consistency ablation): ``"columns"`` (above) and ``"carry"`` (``c0:7+9=16;c1:4+8=13;c1:3+5=09;=0936``).
The checker reads only the number after the last ``=``, so both styles are graded the same way. Each column's terms
may come in any order (addition commutes), so a problem has many valid traces, and the teachers are trained on
traces in random orders (see :func:`solution`).

Prompts are generated deterministically from a seed; the ``train``, ``opd`` and ``heldout`` splits
draw from disjoint operand pairs.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path

STYLES = ("columns", "carry")
SPLITS = ("train", "opd", "heldout")


@dataclass(frozen=True)
class Problem:
    a: int
    b: int
    digits: int

    @property
    def prompt(self) -> str:
        return f"{self.a:0{self.digits}d}+{self.b:0{self.digits}d}"

    @property
    def answer(self) -> str:
        return f"{self.a + self.b:0{self.digits + 1}d}"


def solution(problem: Problem, style: str = "columns", rng: random.Random | None = None) -> str:
    """A trace of ``problem`` in ``style``: the canonical one, or with ``rng`` one of the several valid ones.

    Addition commutes, so each column's two digits may be written in either order. A teacher trained on traces in
    random orders spreads its mass over the valid continuations (about ln 2 nats at a column's first digit when the
    digits differ) and stays near-certain on sums and answers: the shape of an LLM teacher's entropy on a reasoning
    trace (uncertain wording, certain arithmetic), rather than a teacher that puts every token at probability 1.
    """
    if style not in STYLES:
        raise ValueError(f"style must be one of {STYLES}, got {style!r}")
    a, b = f"{problem.a:0{problem.digits}d}", f"{problem.b:0{problem.digits}d}"
    carry, steps = 0, []
    for da, db in zip(reversed(a), reversed(b)):
        s = int(da) + int(db) + carry
        x, y = (db, da) if rng is not None and rng.random() < 0.5 else (da, db)
        if style == "columns":
            steps.append(f"{x}+{y}+{carry}={s:02d}")
        else:
            steps.append(f"c{carry}:{x}+{y}={s:02d}")
        carry = s // 10
    return ";".join(steps) + f";={problem.answer}"


def extract_answer(text: str) -> str | None:
    """The number after the last '=' of a response, or None."""
    if "=" not in text:
        return None
    tail = text.rsplit("=", 1)[1].strip()
    digits = ""
    for ch in tail:
        if not ch.isdigit():
            break
        digits += ch
    return digits or None


def is_correct(response: str, answer: str) -> bool:
    got = extract_answer(response)
    return got is not None and int(got) == int(answer)


def verify_addition(response: str, task: dict) -> float:
    """The demo's verifier (registered under the ``opdcache.inputs.verifiers`` entry points as ``addition``)."""
    return float(is_correct(response, task["answer"]))


def _split_of(a: int, b: int) -> str:
    """Deterministic split of an operand pair: 80% train, 10% opd, 10% held-out, by hash."""
    h = int(hashlib.sha256(f"{a}+{b}".encode()).hexdigest()[:8], 16) % 10
    return "train" if h < 8 else ("opd" if h == 8 else "heldout")


def problems(split: str, n: int, seed: int = 0, digits: int = 3) -> list[Problem]:
    """``n`` distinct problems of ``split``, drawn deterministically from ``seed``."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    rng = random.Random(f"{seed}-{split}-{digits}")
    hi = 10**digits - 1
    seen, out = set(), []
    while len(out) < n:
        a, b = rng.randint(0, hi), rng.randint(0, hi)
        if (a, b) in seen or _split_of(a, b) != split:
            continue
        seen.add((a, b))
        out.append(Problem(a, b, digits))
    return out


def write_prompts(path: str | Path, split: str, n: int, seed: int = 0, digits: int = 3) -> Path:
    """Write a prompts JSONL file (fields ``prompt`` and ``answer``) for the CLI commands."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for p in problems(split, n, seed, digits):
            f.write(json.dumps({"prompt": p.prompt, "answer": p.answer}) + "\n")
    return path
