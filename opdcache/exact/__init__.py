"""One exact arithmetic for sampling, scoring and learning (papers/003, VeXact), on any CPU or a CUDA GPU.

``arith``: the primitives (dot products, sums and transcendental functions whose float32 result is a function of
the mathematics only, never of the batch, padding, kernel or thread count); ``decoder``: the decoder forward built
from them (Llama, Qwen2, Qwen3, Mistral), with a KV cache that gives the same bits as a full forward; ``head``: the
unembedding and its log-partition, top-k and draws in the same arithmetic. ``invariant``: the same contract on a GPU
(batch-invariant Triton kernels), recorded as its own arithmetic. :data:`ARITHMETICS` names them; the decoder and the
head take the primitives' module as a parameter.
"""

CPU_ARITHMETIC = "opdcache-exact-1"  # arith.py's definition (with decoder.py and head.py): bump on any change
GPU_ARITHMETIC = "opdcache-invariant-2"  # invariant.py's (with its kernels, decoder.py and head.py): bump on any change
ARITHMETICS = {CPU_ARITHMETIC: "opdcache.exact.arith", GPU_ARITHMETIC: "opdcache.exact.invariant"}


def arithmetic_for_device(device) -> str:
    """The exact arithmetic a device runs: the CPU's (the same bits on any machine) on ``cpu`` and ``auto``, the
    batch-invariant kernels' on a CUDA device."""
    return GPU_ARITHMETIC if str(device).startswith("cuda") else CPU_ARITHMETIC


def primitives(name: str):
    """The module of arithmetic ``name`` (a key of :data:`ARITHMETICS`)."""
    import importlib

    return importlib.import_module(ARITHMETICS[name])


def require(name, device, what: str, fix: str) -> None:
    """Refuse in one line an exact arithmetic this opdcache does not implement, or one ``device`` cannot run (the GPU's
    without a usable CUDA GPU and triton; Triton's interpreter stands in for the tests). ``what`` names the table."""
    from opdcache.errors import ConfigError

    if name not in ARITHMETICS:
        raise ConfigError(f"{what} was computed in {name!r}, this opdcache implements {', '.join(map(repr, ARITHMETICS))}; {fix}")
    if name == GPU_ARITHMETIC:
        reason = primitives(name).unavailable_reason(device)
        if reason is not None:
            raise ConfigError(f"{what} was computed in {name}, the GPU's batch-invariant arithmetic: it re-computes on a CUDA "
                              f"GPU (here: {reason}); run this on a GPU machine")
