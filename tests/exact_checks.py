"""One check of an exact engine's contract, shared by the Triton-interpreter tests (tests/test_invariant.py) and the
CUDA tests (tests/test_gpu.py): decoding a row alone, in batches of other sizes and at other positions gives the same
bits; teacher-forced scoring (a full forward over rows padded together) gives back what KV-cache decoding stored; and
the trainer's forward (opdcache/training/student.py) in the engine's arithmetic recomputes the stored log-probs bit for bit."""

import numpy as np
import torch

from opdcache.backends.base import GenerateRequest, SamplingConfig, ScoreRequest

FIELDS = ("response_ids", "sampling_logprobs", "ref_logprobs", "ref_topk_ids", "ref_topk_logprobs", "mc_ids", "mc_sampling_logprobs")


def requests(n: int, seed: int = 0, vocab: int = 64) -> list[GenerateRequest]:
    rng = np.random.default_rng(seed)
    return [GenerateRequest(prompt_ids=rng.integers(2, vocab, size=int(rng.integers(2, 10))).tolist(), seed=i) for i in range(n)]


def check_engine_invariance(engine, n: int, batches=(7, 1), max_new_tokens: int = 5, seed: int = 0) -> int:
    """Asserts the contract on ``n`` rows (first decoded all together) and returns how many tokens were checked."""
    from opdcache.training.student import StudentForward

    reqs = requests(n, seed)
    sampling = SamplingConfig(temperature=0.9, top_p=0.9, max_new_tokens=max_new_tokens, ref_top_k=4, mc_samples=2)
    engine.generate_batch_size = n
    base = engine.generate(reqs, sampling)
    for batch in batches:  # reversed order: every row at another position; batch 1: the first and last rows alone
        order = list(range(n))[::-1] if batch > 1 else [0, n - 1]
        engine.generate_batch_size = batch
        for i, g in zip(order, engine.generate([reqs[i] for i in order], sampling)):
            for f in FIELDS:
                assert np.array_equal(getattr(g, f), getattr(base[i], f)), (batch, i, f)
    score_reqs = [ScoreRequest(r.prompt_ids, g.response_ids, ref_topk_ids=g.ref_topk_ids) for r, g in zip(reqs, base)]
    engine.max_batch_tokens = 40  # several scoring batches, of other shapes than decoding's
    for sc, g in zip(engine.score(score_reqs, top_k=4), base):
        assert np.array_equal(sc.logprobs, g.ref_logprobs)
        assert np.array_equal(sc.ref_topk_logprobs, g.ref_topk_logprobs)
        assert np.array_equal(sc.topk_ids, g.ref_topk_ids)
    forward = StudentForward(engine.model, chunk=64, exact_dtype=engine.decoder.dtype, exact_arithmetic=engine.arithmetic)
    L = max(len(r.prompt_ids) + len(g.response_ids) for r, g in zip(reqs, base))
    ids = torch.zeros(n, L, dtype=torch.long)
    positions = torch.zeros(n, max_new_tokens, dtype=torch.long)
    select = torch.zeros(n, max_new_tokens, dtype=torch.bool)
    for b, (r, g) in enumerate(zip(reqs, base)):
        P, T = len(r.prompt_ids), len(g.response_ids)
        ids[b, :P + T] = torch.as_tensor(list(r.prompt_ids) + list(g.response_ids))
        positions[b, :T] = torch.arange(P - 1, P - 1 + T)
        select[b, :T] = True
    picked = torch.as_tensor(np.concatenate([g.response_ids for g in base]).astype(np.int64))[:, None]
    device = engine.device
    with torch.no_grad():
        lp, _, _ = forward(ids.to(device), (ids != 0).to(device), positions.to(device), select.to(device), picked.to(device))
    assert np.array_equal(lp[:, 0].cpu().numpy(), np.concatenate([g.ref_logprobs for g in base]))
    return sum(len(g.response_ids) for g in base)


def check_grouped_query_decoder(family: str, arith) -> None:
    """A random Llama or Qwen3 with four query heads on two key heads (the demo's models have one each), in the
    arithmetic ``arith``: the exact forward is transformers' maths (to 1e-4), a row alone and KV-cache decoding
    give the full forward's bits."""
    import transformers

    from opdcache.exact.decoder import ExactDecoder

    torch.manual_seed(0)
    common = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=128)
    cfg = transformers.LlamaConfig(**common) if family == "llama" else transformers.Qwen3Config(**common)
    model = (transformers.LlamaForCausalLM if family == "llama" else transformers.Qwen3ForCausalLM)(cfg).eval()
    dec = ExactDecoder(model, arith=arith)
    ids = torch.randint(2, 64, (3, 19), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = dec.forward(ids)
        assert (full - model.model(input_ids=ids).last_hidden_state).abs().max() < 1e-4
        assert torch.equal(dec.forward(ids[1:2]), full[1:2])
        cache = dec.new_cache(3, 19)
        steps = [dec.step(ids[:, :7], torch.arange(7).expand(3, 7), cache)]
        for t in range(7, 19):
            steps.append(dec.step(ids[:, t: t + 1], torch.full((3, 1), t), cache))
    assert torch.equal(torch.cat(steps, 1), full)


def primitives_that_vary(A, device, dtype=torch.float32) -> list[str]:
    """The names of the arithmetic ``A``'s primitives (and the sampler's steps built on them) whose result for a row
    changes with the batch it sits in or its position there: [64, C] against its first 7 rows and row 61 alone."""
    from opdcache.exact import head as H

    g = torch.Generator().manual_seed(11)
    z = (torch.randn(64, 503, generator=g) * 5).to(device)
    x, w = torch.randn(64, 200, generator=g).to(device, dtype), torch.randn(96, 200, generator=g).to(device, dtype)
    p, v = torch.rand(64, 2, 1, 40, generator=g).to(device, dtype), torch.randn(64, 2, 40, 16, generator=g).to(device, dtype)
    ops = {
        "linear": (x, lambda t: A.linear(t, w)),
        "matmul": (p, lambda t: A.matmul(t, v[: t.shape[0]] if t.shape[0] > 1 else v[61:62])),
        "sum_last": (z, A.sum_last), "cumsum64": (z, A.cumsum64),
        "exp": (z, A.exp), "log": (z.abs() + 1e-3, A.log), "rsqrt": (z.abs() + 1e-3, A.rsqrt), "silu": (z, A.silu),
        "temperature": (z, lambda t: t / 0.9), "log_softmax": (z, lambda t: H.log_softmax(t, A)),
        "top_p_mask": (H.log_softmax(z, A), lambda t: H.top_p_mask(t, 0.9, A)),
    }
    # the decoder's composites (the GPU arithmetic computes them in its own kernels)
    norm_w = (torch.rand(200, generator=g) + 0.5).to(device, dtype)
    ops["rms_norm"] = (x, lambda t: A.rms_norm(t, norm_w, 1e-6, dtype))
    # each row sees its first 1-40 keys, a function of its own values (the slices keep row and limit together)
    # [batch rows, 1 group, 2 heads x 1 query, 40 keys]; each query's position from its row's values
    ops["attention_probs"] = (z[:, :80].reshape(64, 1, 2, 40),
                              lambda t: A.attention_probs(t, (t[:, 0, 0, :1].abs() * 7).long() % 40, 0.125, dtype))
    from opdcache.exact.decoder import RotaryTable

    cos, sin = RotaryTable(10000.0, 16).tables(torch.arange(20, device=device))
    ops["rotary"] = (z[:, :96].reshape(64, 3, 2, 16).to(dtype),  # [tokens, Q, heads, D], positions from each row's values
                     lambda t: A.rotary(t, (t[:, :, 0, 0].float().abs() * 5).long() % 20, cos, sin, dtype))
    varying = []
    for name, (t, f) in ops.items():
        full = f(t)
        if not (torch.equal(f(t[:7]), full[:7]) and torch.equal(f(t[61:62]), full[61:62])):
            varying.append(name)
    return varying


def log_softmax_slice_by_slice(z_PV, A):
    """The plain reference of opdcache.exact.head.log_softmax: each vocabulary slice's statistics by its own call."""
    from opdcache.exact import head as H

    stats = [H.slice_stats(z_PV[:, a: a + H.VOCAB_BLOCK], A) for a in range(0, z_PV.shape[1], H.VOCAB_BLOCK)]
    M, log_s = H.combine(torch.stack([m for m, _ in stats], -1), torch.stack([s for _, s in stats], -1), A)
    return (z_PV - M[:, None]) - log_s[:, None]


def wide_logits(seed: int = 5):
    """[3, 3 slices + 17] logits with a slice masked whole in every row and one more in row 1 (top-p leaves such)."""
    from opdcache.exact import head as H

    z = torch.randn(3, 3 * H.VOCAB_BLOCK + 17, generator=torch.Generator().manual_seed(seed)) * 3
    z[:, H.VOCAB_BLOCK: 2 * H.VOCAB_BLOCK] = float("-inf")
    z[1, : H.VOCAB_BLOCK] = float("-inf")
    return z


def check_packed_has_padded_bits(decoder) -> None:
    """forward_packed: sequences laid end to end, each at positions 0, 1, ..., give token for token the bits forward
    gives them as right-padded rows of a batch; one sequence over all of them would not."""
    g = torch.Generator().manual_seed(3)
    lengths = [5, 17, 1, 9]
    rows = [torch.randint(2, 64, (n,), generator=g) for n in lengths]
    padded = torch.randint(2, 64, (len(rows), max(lengths)), generator=g)  # padding of other tokens: it must not matter
    for i, r in enumerate(rows):
        padded[i, : len(r)] = r
    want = decoder.forward(padded)
    offsets = (0, *torch.tensor(lengths).cumsum(0).tolist())
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    got = decoder.forward_packed(torch.cat(rows)[None], positions, offsets)[0]
    for i, (a, b) in enumerate(zip(offsets[:-1], offsets[1:])):
        assert torch.equal(got[a:b], want[i, : b - a]), i
    whole = decoder.forward_packed(torch.cat(rows)[None], torch.arange(offsets[-1])[None], (0, offsets[-1]))[0]
    assert not torch.equal(whole[offsets[1]: offsets[2]], want[1, : lengths[1]])  # one sequence over all would differ


AOT_SCRIPT = r'''
import sys, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from opdcache.exact import invariant, invariantkernels as K

P, I, F = "*fp32", "i32", "fp32"
def ptr(dtype): return {"float32": "*fp32", "bfloat16": "*bf16"}[dtype]
capability = int(sys.argv[1])
for dtype in ("float32", "bfloat16"):
    rnd = dtype == "bfloat16"
    kernels = [
        (K.matmul_tiles, [ptr(dtype), ptr(dtype), ptr(dtype)] + [I] * 12,
         dict(IEEE=dtype == "float32", SPELLED=False, ROUND=rnd, BM=64, BN=64, BK=32)),
        (K.row_sums, [P, P, I, I, I], dict(ROWS=16, BLOCK=1024)),
        (K.row_cumsums, [P, "*fp64", I, I], dict(BLOCK=1024)),
        (K.rms_norm_rows, [ptr(dtype), ptr(dtype), ptr(dtype), I, I, I, F], dict(ROUND=rnd, ROWS=16, BLOCK=1024)),
        (K.scores_shifted, [P, "*i64", P, I, I, I, I, F], dict(ROUND=rnd, ROWS=16, BLOCK=1024)),
        (K.rows_normalized, [P, ptr(dtype), I, I], dict(ROUND=rnd, ROWS=16, BLOCK=1024)),
        (K.rotary_rows, [ptr(dtype), "*i64", P, P, ptr(dtype), I, I, I, I], dict(ROUND=rnd, D=128, ROWS=16)),
    ]
    for fn, types, consts in kernels:
        names = fn.arg_names
        sig = dict(zip([n for n in names if n not in consts], types))
        sig.update({n: "constexpr" for n in consts})
        compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts),
                                  target=GPUTarget("cuda", capability, 32), options=dict(invariant.COMPILE_OPTIONS))
        assert "cubin" in compiled.asm and len(compiled.asm["cubin"]) > 0, fn.__name__
        print(fn.__name__, dtype, "sm_%d" % capability, len(compiled.asm["cubin"]))
'''


def compile_for_gpu(capability: int) -> str:
    """Compile every batch-invariant kernel, in both dtypes, for a CUDA GPU of ``capability`` (80: A100, 90: H100 and
    H200) with the installed triton's own ptxas, in a process without TRITON_INTERPRET (no GPU needed): a kernel the
    interpreter runs but the compiler refuses would otherwise surface only on a GPU. Returns the script's output."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", AOT_SCRIPT, str(capability)], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout
