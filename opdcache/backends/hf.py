"""The transformers engine: the exact reference, on any device.

Generation runs its own sampling loop over the model's KV cache, so every stored number is computed
from the logits the token was drawn from: temperature and top-p for ``sampling_logprobs``, temperature 1
for ``ref_logprobs`` and top-k. Every per-step operation runs on the model's device. Each sample's draws are
counter-based uniforms of its seed (opdcache/backends/draws.py), so a sample does not depend on which batch it ran in,
on the device or on any RNG state.

Scoring runs the decoder once over prompt + response (right-padded, length-sorted batches under a
token budget) and computes logits only at response positions, in blocks of positions sized so that no
[batch, length, vocabulary] float32 tensor is ever materialised. ``deterministic=True`` scores each
sequence on its own, with deterministic kernels, so its stored values are bit-identical whatever batch
or order it arrives in.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from opdcache.backends import draws
from opdcache.backends.loading import check_load, load_model, parse_device, resolve_dtype
from opdcache.backends.base import Capabilities, GenerateRequest, Generation, SamplingConfig, ScoreRequest, Scores, split_generations, split_scores, statistics
from opdcache.backends.streamed import head_transform, streamed_logit_stats
from opdcache.errors import ConfigError
from opdcache.progress import advance, detail

POSITION_BLOCK = 2048  # positions scored together: enough rows that the head matmul runs at full rate
UNIFORM_BLOCK_STEPS = 256  # generation: decode steps whose uniforms are computed together ([rows, steps, 1 + m] float64)
DONE_CHECK_EVERY = 16  # generation on a GPU: steps between reads of the "all rows finished" flag (the one host sync)
SCORE_BATCH_TOKENS = {"cpu": 1024, "cuda": 16384}  # default padded tokens per scoring batch (the GPU's: 8.9x faster, bench_gpu.py)


def _cache_argument(base) -> str:
    """The decoder's key/value cache argument: ``cache`` from transformers 5.2x on, ``past_key_values`` before (the
    old name still works there, with a FutureWarning on every call)."""
    import inspect

    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


def _cache_of(out):
    """The key/value cache a decoder forward returned, under either name (see :func:`_cache_argument`)."""
    return out["cache"] if "cache" in out.keys() else out.past_key_values


def _base(model):
    return getattr(model, model.base_model_prefix)


def _top_p_mask(scaled: torch.Tensor, top_p: float) -> torch.Tensor:
    """Logits with tokens outside the top-p nucleus set to -inf (the most likely token always kept)."""
    if top_p >= 1.0:
        return scaled
    probs_sorted, order = torch.softmax(scaled, -1).sort(-1, descending=True)
    drop_sorted = probs_sorted.cumsum(-1) - probs_sorted >= top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return scaled.masked_fill(drop, float("-inf"))


def log_softmax_into(logits: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits, -1) written into ``out`` (which may be ``logits``): (z - m) - log sum exp(z - m), with
    ``scratch`` (same shape) for the exponentials, so no [B, V] temporary is allocated."""
    m = logits.amax(-1, keepdim=True)
    torch.sub(logits, m, out=out)
    return out.sub_(torch.exp(out, out=scratch).sum(-1, keepdim=True).log_())


class _LastPositionHead:
    """The model's head (and logit transforms) applied to the last position's hidden state, into one [B, V] buffer on
    the model's device that every decode step reuses."""

    def __init__(self, model, batch: int):
        head = model.get_output_embeddings()
        self.weight, self.bias = head.weight, getattr(head, "bias", None)
        self.transform = head_transform(model)
        self.vocab_size = int(self.weight.shape[0])
        self.out = torch.empty((batch, self.vocab_size), dtype=self.weight.dtype, device=self.weight.device)

    def __call__(self, hidden_BLH: torch.Tensor) -> torch.Tensor:
        torch.matmul(hidden_BLH[:, -1], self.weight.T, out=self.out)
        if self.bias is not None:
            self.out += self.bias
        return self.transform(self.out)


TRIM_EVERY = 64  # decode steps between returns of freed heap memory to the OS


def release_free_heap() -> None:
    """Give freed heap pages back to the OS (glibc ``malloc_trim``). The KV cache grows by one position per step,
    each step's new, larger tensors leave the old ones' space in the heap unusable for the next, and RSS creeps
    up by MBs per step though nothing leaks; trimming every few steps keeps it at what is live. A no-op
    where glibc is absent."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            import ctypes

            _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim = None


def sampling_logprobs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """log q for q = softmax(logits / T) restricted to the top-p nucleus, renormalised. [B, V] float32."""
    return torch.log_softmax(_top_p_mask(logits / temperature, top_p), -1)


@contextmanager
def _deterministic(enabled: bool):
    if not enabled:
        yield
        return
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=False)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous)


class TransformersBackend:
    name = "transformers"

    def __init__(self, model_path: str | Path, dtype: str = "auto", device: str = "auto", quantize: str | None = None,
                 deterministic: bool = False, max_batch_tokens: int | None = None, generate_batch_size: int = 64):
        """Checks the settings and reads the model's configuration; the weights load on first use (:meth:`load`), so a
        job that finds its work done never loads them. What the engine reports before then (dtype, vocabulary, context,
        hidden size, device) is what the loaded model is checked to have."""
        import transformers

        from opdcache.backends.quant import QuantScheme, parse_quantize
        from opdcache.inputs.models import model_facts

        spec = None if quantize is None else parse_quantize(quantize).spec()  # the canonical spec is what the manifest records
        dev = check_load(model_path, dtype, device, spec)
        self.facts = facts = model_facts(model_path)
        self._model, self._load_args = None, (model_path, dtype, device, spec)
        self.path, self.quantize = Path(model_path), spec
        self.version = transformers.__version__
        self.device = dev if dev.type != "cuda" or dev.index is not None else torch.device("cuda", torch.cuda.current_device())
        int8 = spec is not None and not QuantScheme.parse(spec).emulated  # torch's int8 layers run around a float32 head
        self.dtype = "float32" if int8 else str(resolve_dtype(dtype, dev)).replace("torch.", "")
        self.max_batch_tokens = max_batch_tokens or SCORE_BATCH_TOKENS.get(self.device.type, 1024)
        self.deterministic, self.generate_batch_size = deterministic, generate_batch_size
        self.vocab_size, self.max_length, self.hidden_size = facts.vocab_size, facts.max_length, facts.hidden_size

    def _attach(self, model, deterministic: bool, max_batch_tokens: int | None, generate_batch_size: int) -> None:
        import transformers

        from opdcache.inputs.models import facts_of

        self._model = model
        self.version = transformers.__version__
        self.device = next(model.parameters()).device
        self.dtype = str(next(model.get_output_embeddings().parameters()).dtype).replace("torch.", "")
        self.max_batch_tokens = max_batch_tokens or SCORE_BATCH_TOKENS.get(self.device.type, 1024)
        self.deterministic, self.generate_batch_size = deterministic, generate_batch_size
        facts = facts_of(model)
        self.vocab_size, self.max_length, self.hidden_size = facts.vocab_size, facts.max_length, facts.hidden_size
        eos = model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])

    @classmethod
    def from_model(cls, model, deterministic: bool = False) -> "TransformersBackend":
        """Wrap a model already in memory (the online baseline samples from the student being trained)."""
        self = cls.__new__(cls)
        self.path, self.quantize = None, None
        self._attach(model, deterministic, None, 64)
        return self

    def load(self) -> None:
        """Bring the weights into memory now (before a job writes anything, so a model that cannot load leaves nothing
        behind); refused in one line if the loaded model is not what its configuration said."""
        if self._model is not None:
            return
        from opdcache.inputs.models import check_facts

        said = (self.dtype, self.device)
        self._attach(load_model(*self._load_args), self.deterministic, self.max_batch_tokens, self.generate_batch_size)
        check_facts(self._model, self.facts, self.path)
        if said != (self.dtype, self.device):  # what the engine reported before the load (the manifest may hold it)
            raise ConfigError(f"{self.path}: loaded in {self.dtype} on {self.device}, not the {said[0]} on {said[1]} its settings "
                              "gave; report this with the model's config.json")

    @property
    def model(self):
        """The model, loaded on first use."""
        self.load()
        return self._model

    def close(self) -> None:
        """Nothing to release (the model is freed with the object); here so every engine can be closed alike."""

    def model_info(self) -> dict:
        return {"engine": self.name, "engine_version": self.version, "dtype": self.dtype, "quantization": self.quantize}

    # ------------------------------------------------------------ generation

    @torch.no_grad()
    def generate(self, requests: Sequence[GenerateRequest], sampling: SamplingConfig) -> list[Generation]:
        order = sorted(range(len(requests)), key=lambda i: len(requests[i].prompt_ids))
        out: list[Generation | None] = [None] * len(requests)
        for start in range(0, len(order), self.generate_batch_size):
            idx = order[start: start + self.generate_batch_size]
            where = f"decoding {len(idx)} sequences"
            model = self.model  # loads the weights on first use (and with them the stop tokens)
            for i, gen in zip(idx, decode_batch(model, [requests[i] for i in idx], sampling, self.eos_ids, where)):
                out[i] = gen
            advance(len(idx))
        return out  # type: ignore[return-value]

    @torch.no_grad()
    def replay(self, requests: Sequence[GenerateRequest], responses: Sequence[np.ndarray]) -> list[Generation]:
        """Each request's stored response fed through the generation path (left-padded batches of
        ``generate_batch_size``, the KV cache, the last-position head) instead of sampled: pi_ref's temperature-1
        log-probs as the rollout engine computed them, for audit. Batches by prompt length, as generate does."""
        order = sorted(range(len(requests)), key=lambda i: len(requests[i].prompt_ids))
        out: list[Generation | None] = [None] * len(requests)
        for start in range(0, len(order), self.generate_batch_size):
            idx = order[start: start + self.generate_batch_size]
            steps = max(1, max(len(responses[i]) for i in idx))
            model = self.model  # loads the weights on first use (and with them the stop tokens)
            gens = decode_batch(model, [requests[i] for i in idx], SamplingConfig(temperature=1.0, max_new_tokens=steps),
                                self.eos_ids, f"replaying {len(idx)} sequences", forced=[responses[i] for i in idx])
            for i, gen in zip(idx, gens):
                out[i] = gen
        return out  # type: ignore[return-value]

    # ------------------------------------------------------------ scoring

    def _batches(self, requests: Sequence[ScoreRequest]) -> list[list[int]]:
        if self.deterministic:
            return [[i] for i in range(len(requests))]
        order = sorted(range(len(requests)), key=lambda i: len(requests[i].prompt_ids) + len(requests[i].response_ids))
        batches, current, longest = [], [], 0
        for i in order:
            n = len(requests[i].prompt_ids) + len(requests[i].response_ids)
            if current and max(longest, n) * (len(current) + 1) > self.max_batch_tokens:  # padded tokens
                batches.append(current)
                current, longest = [], 0
            current.append(i)
            longest = max(longest, n)
        if current:
            batches.append(current)
        return batches

    def batching(self) -> dict | None:
        """What decides the last bits of a scored batch besides the requests themselves (None in deterministic mode,
        where nothing does): the token budget that cuts a shard's rows into decoder batches, the head's pooling
        (fixed), and torch's threads. Recorded in each shard's footer, so an audit can replay them."""
        return None if self.deterministic else {"max_batch_tokens": int(self.max_batch_tokens), "threads": torch.get_num_threads()}

    @contextmanager
    def replaying(self, batching: dict):
        """Score as a recorded :meth:`batching` did: its token budget and threads, restored afterwards."""
        budget, threads = self.max_batch_tokens, torch.get_num_threads()
        self.max_batch_tokens = int(batching["max_batch_tokens"])
        torch.set_num_threads(int(batching["threads"]))
        try:
            yield self
        finally:
            self.max_batch_tokens = budget
            torch.set_num_threads(threads)

    @torch.no_grad()
    def score(self, requests: Sequence[ScoreRequest], top_k: int | None = None, hidden: bool = False,
              hidden_dtype: str | None = None) -> list[Scores]:
        """Decoder forwards in small batches (bounded activation memory); their hidden rows are pooled into
        blocks of about POSITION_BLOCK positions for the streamed head pass (a large matmul runs at full rate).
        In deterministic mode every sequence is its own batch and its own block. Every position also gets the full
        distribution's entropy and variance (opdcache/format/fidelity.py); with ``hidden_dtype`` narrower than the model's,
        also the KL to the full distribution of the logits of the states rounded to it (the caller rounds what it stores)."""
        out: list[Scores | None] = [None] * len(requests)
        pending: list[tuple[int, torch.Tensor]] = []
        pooled = 0  # positions in `pending`

        def flush() -> None:
            idx = [i for i, _ in pending]
            for i, sc in zip(idx, self._score_rows([requests[i] for i in idx], torch.cat([h for _, h in pending]), top_k, hidden,
                                                        hidden_dtype)):
                out[i] = sc
            pending.clear()
            advance(len(idx))

        with _deterministic(self.deterministic):
            for batch in self._batches(requests):
                hidden_NH, lengths = self.final_hidden([requests[i] for i in batch])
                pending.extend(zip(batch, torch.split(hidden_NH, lengths)))
                pooled += sum(lengths)
                if self.deterministic or pooled >= POSITION_BLOCK:
                    flush()
                    pooled = 0
            if pending:
                flush()
        return out  # type: ignore[return-value]

    @torch.no_grad()
    def hidden_states(self, requests: Sequence[ScoreRequest]) -> torch.Tensor:
        """Final hidden states at every response position of ``requests``, in order: [sum T, H], decoded in the
        same token-budget batches as scoring (activation memory bounded by ``max_batch_tokens``)."""
        parts: list[torch.Tensor | None] = [None] * len(requests)
        for batch in self._batches(requests):
            hidden_NH, lengths = self.final_hidden([requests[i] for i in batch])
            for i, h in zip(batch, torch.split(hidden_NH, lengths)):
                parts[i] = h
        return torch.cat(parts)  # type: ignore[arg-type]

    def final_hidden(self, requests: Sequence[ScoreRequest]) -> tuple[torch.Tensor, list[int]]:
        """Final post-norm hidden states at the response positions, flattened: [sum T, H], and each row's T."""
        for r in requests:
            if len(r.prompt_ids) == 0:
                raise ConfigError("cannot score a sequence with an empty prompt")
        B = len(requests)
        seqs = [list(r.prompt_ids) + list(r.response_ids) for r in requests]
        L = max(map(len, seqs))
        input_ids = torch.zeros((B, L), dtype=torch.long)
        mask = torch.zeros((B, L), dtype=torch.long)
        for b, seq in enumerate(seqs):  # right padding: positions are 0..len-1, causal attention ignores the tail
            input_ids[b, : len(seq)] = torch.as_tensor(seq)
            mask[b, : len(seq)] = 1
        h = _base(self.model)(input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device)).last_hidden_state  # [B, L, H]
        # the value for response token t is predicted at position len(prompt) + t - 1
        rows = [h[b, len(r.prompt_ids) - 1: len(r.prompt_ids) - 1 + len(r.response_ids)] for b, r in enumerate(requests)]
        return torch.cat(rows), [len(r.response_ids) for r in requests]

    def _score_rows(self, requests: Sequence[ScoreRequest], hidden_NH: torch.Tensor, top_k: int | None, want_hidden: bool,
                    hidden_dtype: str | None = None) -> list[Scores]:
        lengths = [len(r.response_ids) for r in requests]
        N = hidden_NH.shape[0]
        sampled = torch.cat([torch.as_tensor(np.asarray(r.response_ids, dtype=np.int64)) for r in requests]).to(self.device)
        ref_ids = torch.cat([torch.as_tensor(r.ref_topk_ids.astype(np.int64)) for r in requests]).to(self.device) if requests[0].ref_topk_ids is not None else None
        mc_ids = torch.cat([torch.as_tensor(r.mc_ids.astype(np.int64)) for r in requests]).to(self.device) if requests[0].mc_ids is not None else None
        uniforms = torch.cat([torch.as_tensor(r.uniforms, dtype=torch.float64) for r in requests]) if requests[0].uniforms is not None else None
        parts: dict[str, list[torch.Tensor]] = {k: [] for k in ("logprobs", "logsumexp", "topk_ids", "topk_logprobs", "ref_topk_logprobs", "mc_logprobs", "sampled_ids", "sampled_logprobs", "entropy", "variance", "rounding_kl")}
        rounded = None
        if want_hidden and hidden_dtype is not None and getattr(torch, hidden_dtype) != hidden_NH.dtype:
            rounded = hidden_NH.to(getattr(torch, hidden_dtype))  # what the store keeps; the KL is of its logits
        blocks = max(1, round(N / POSITION_BLOCK))  # equal blocks near POSITION_BLOCK: no small tail block re-reading the whole head
        bounds = [N * i // blocks for i in range(blocks + 1)]
        for start, end in zip(bounds, bounds[1:]):
            sl = slice(start, end)
            stats = streamed_logit_stats(self.model, hidden_NH[sl], sampled[sl], top_k,
                                         None if ref_ids is None else ref_ids[sl], None if mc_ids is None else mc_ids[sl],
                                         None if uniforms is None else uniforms[sl], moments=True,
                                         rounded_PH=None if rounded is None else rounded[sl].to(hidden_NH.dtype))
            for key, value in stats.items():
                parts[key].append(value)
        cat = {k: torch.cat(v).cpu() for k, v in parts.items() if v}
        if want_hidden:
            cat["hidden"] = hidden_NH.detach().cpu()
        return split_scores(cat, lengths)


@torch.no_grad()
def decode_batch(model, requests: Sequence[GenerateRequest], s: SamplingConfig, eos_ids: set, where: str = "",
                 forced: Sequence[np.ndarray] | None = None) -> list[Generation]:
    """Sample one batch on the model's device: left-padded prompts, then ``s.max_new_tokens`` decode steps, each drawing
    its token by inverse CDF from the sampling distribution with a counter-based uniform of the row's seed
    (opdcache/backends/draws.py), and storing pi_ref's temperature-1 log-probs (and top-k, MC draws) from the same
    logits. Every per-step operation runs on the device; the host reads the batch's "all finished" flag once every
    ``DONE_CHECK_EVERY`` steps on a GPU (every step on a CPU, where it costs nothing) and the results once at the end.
    ``where``: the progress detail's prefix. Memory: the KV cache, allocated once at prompt + max_new_tokens
    positions (opdcache/backends/kvcache.py), a few [batch, vocabulary] float32 buffers reused by every step and one
    [batch, vocabulary] float64 cumulative sum per draw, and the stored values [batch, max_new_tokens, k + m].
    ``forced``: each row's response ids, fed step by step instead of drawn (the same decode path, teacher-forced: what
    audit replays a table's log-probs with); a row ends with its own ids."""
    device = next(model.parameters()).device
    on_cpu = device.type == "cpu"
    B = len(requests)
    lengths = [len(r.prompt_ids) for r in requests]
    L = max(lengths)
    input_ids = torch.zeros((B, L), dtype=torch.long)
    mask = torch.zeros((B, L), dtype=torch.long)
    for b, r in enumerate(requests):  # left padding: every row's next token goes at the same column
        input_ids[b, L - lengths[b]:] = torch.as_tensor(r.prompt_ids)
        mask[b, L - lengths[b]:] = 1
    input_ids, mask = input_ids.to(device), mask.to(device)
    seeds = torch.tensor([r.seed for r in requests], dtype=torch.int64).to(device)
    position = (mask.cumsum(-1) - 1).clamp(min=0)
    # the decoder, then the head at the last position only ([B, V], never [B, L, V]), into buffers reused by every
    # step: a fresh [B, V] logits tensor per step (the model's own forward) fragments the CPU heap and RSS creeps
    from opdcache.backends import kvcache  # imports transformers

    head = _LastPositionHead(model, B)
    past_arg = _cache_argument(_base(model))
    cache = kvcache.preallocated(model, L + s.max_new_tokens)  # written in place: no copy of the whole cache a step
    out = _base(model)(input_ids=input_ids, attention_mask=mask, position_ids=position, use_cache=True,
                       **({past_arg: cache} if cache is not None else {}))
    past = _cache_of(out)
    V = head.vocab_size
    logits = torch.empty((B, V), device=device)
    ref_logp = torch.empty((B, V), device=device)
    scratch = torch.empty((B, V), device=device)
    samp_buf = torch.empty((B, V), device=device) if s.temperature not in (0, 1) or s.top_p < 1 else None
    logits.copy_(head(out.last_hidden_state))
    next_pos = position[:, -1:] + 1
    done = torch.zeros(B, dtype=torch.bool, device=device)  # stopped at an end-of-sequence token (else cut at max_new_tokens)
    n_tokens = torch.zeros(B, dtype=torch.long, device=device)
    eos = torch.tensor(sorted(eos_ids), dtype=torch.long, device=device)
    steps: dict[str, list[torch.Tensor]] = {k: [] for k in ("tok", "slp", "rlp", "kid", "klp", "mid", "mlp")}
    draws_per_step = 1 + (s.mc_samples or 0)  # draw 0 picks the token, draws 1..m the MC samples
    u_block, u_at = None, 0
    check_every = 1 if on_cpu else DONE_CHECK_EVERY
    if forced is not None:
        forced_BT = torch.zeros((B, s.max_new_tokens), dtype=torch.long)
        for b, ids in enumerate(forced):
            forced_BT[b, : len(ids)] = torch.as_tensor(np.asarray(ids, dtype=np.int64))
        forced_BT = forced_BT.to(device)
        forced_len = torch.tensor([len(ids) for ids in forced], dtype=torch.long, device=device)
        done |= forced_len == 0
    for t in range(s.max_new_tokens):
        detail(f"{where}: token {t + 1}/{s.max_new_tokens}")
        log_softmax_into(logits, ref_logp, scratch)  # [B, V], temperature 1
        if s.temperature == 0:
            tok = ref_logp.argmax(-1)
            samp_logp = torch.full_like(ref_logp, float("-inf")).scatter(-1, tok[:, None], 0.0)
        elif samp_buf is None:
            samp_logp = ref_logp  # temperature 1, no nucleus: the sampling distribution is pi_ref's
        elif s.top_p < 1:
            samp_logp = sampling_logprobs(logits, s.temperature, s.top_p)
        else:
            samp_logp = log_softmax_into(torch.div(logits, s.temperature, out=samp_buf), samp_buf, scratch)
        if s.temperature > 0 or s.mc_samples:
            if u_block is None or t - u_at == u_block.shape[1]:
                u_at = t
                u_block = draws.uniforms(seeds, t, min(UNIFORM_BLOCK_STEPS, s.max_new_tokens - t), draws_per_step)  # [B, steps, 1 + m]
            u = u_block[:, t - u_at]
            picked = draws.inverse_cdf(samp_logp, u if s.temperature > 0 else u[:, 1:])  # [B, 1 + m] (or [B, m] greedy)
            if s.temperature > 0:
                tok, picked = picked[:, 0], picked[:, 1:]
            if s.mc_samples:
                steps["mid"].append(picked)
                steps["mlp"].append(samp_logp.gather(-1, picked))
        if forced is not None:
            tok = forced_BT[:, t]
        steps["tok"].append(tok)
        steps["slp"].append(samp_logp.gather(-1, tok[:, None]).squeeze(-1))
        steps["rlp"].append(ref_logp.gather(-1, tok[:, None]).squeeze(-1))
        if s.ref_top_k:
            klp, kid = ref_logp.topk(s.ref_top_k, -1)
            steps["kid"].append(kid)
            steps["klp"].append(klp)
        n_tokens += ~done
        done |= torch.isin(tok, eos) if forced is None else forced_len <= t + 1
        if t == s.max_new_tokens - 1 or (t % check_every == check_every - 1 and bool(done.all())):
            break
        mask = torch.cat([mask, torch.ones((B, 1), dtype=mask.dtype, device=device)], dim=1)
        out = _base(model)(input_ids=tok[:, None], attention_mask=mask, position_ids=next_pos, use_cache=True, **{past_arg: past})
        past = _cache_of(out)
        logits.copy_(head(out.last_hidden_state))
        next_pos = next_pos + 1
        if on_cpu and t % TRIM_EVERY == TRIM_EVERY - 1:
            release_free_heap()
    stacked = {k: torch.stack(v, 1).cpu().numpy() for k, v in steps.items() if v}  # [B, steps, ...]: one copy per batch
    return split_generations(stacked, n_tokens.cpu(), done.cpu(), s)


CAPABILITIES = Capabilities(
    summary="the reference: any device, the whole distribution streamed, hidden states, opdcache's emulated low-bit schemes",
    statistics=statistics("logits", "log_partition", "candidates", "full_distribution", "hidden_states"),
    batch_size_changes_bits=True,
    quantization="emulated", reference=True)


def check(engine) -> dict:
    """The transformers engine's rules on an EngineConfig (before any model loads): its quantization schemes, in
    their canonical spelling (what the manifest records); the device is a device's name."""
    parse_device(engine.device)
    if engine.quantize is None:
        return {}
    from opdcache.backends.quant import QuantScheme

    return {"quantize": QuantScheme.parse(engine.quantize).spec()}


def from_model(model, engine=None) -> TransformersBackend:
    """The engine around a model already in memory (online training's student); ``engine``'s settings: deterministic."""
    return TransformersBackend.from_model(model, deterministic=bool(engine and engine.deterministic))


def build(model, engine, **_extra) -> TransformersBackend:
    return TransformersBackend(model, dtype=engine.dtype, device=engine.device, quantize=engine.quantize,
                               deterministic=engine.deterministic, max_batch_tokens=engine.max_batch_tokens,
                               generate_batch_size=engine.generate_batch_size)
