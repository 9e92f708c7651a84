"""The engines: one file each (``hf.py``, ``vllm.py``, ``exact.py``) behind the contract of ``base.py``, chosen by
name from one :class:`EngineConfig`.

An engine's file defines ``build(model, engine, **extra)`` (load the model, return the backend) and ``check(engine)``
(its own rules on the settings, checked before any model loads; it returns canonical spellings to store). Adding an
engine is its file plus one line in :data:`ENGINES`. :func:`engine_for_table` is the one place that works out which
engine, in which arithmetic, reproduces a table the manifest records (audit and mismatch-report use it).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path

from opdcache.errors import ConfigError

ENGINES = {  # name -> its module, imported only when that engine is configured
    "transformers": "opdcache.backends.hf",
    "vllm": "opdcache.backends.vllm",
    "exact": "opdcache.backends.exact",
}


def engine_module(name: str):
    if name not in ENGINES:
        raise ConfigError(f"--backend must be one of {', '.join(ENGINES)}, got {name!r}")
    return importlib.import_module(ENGINES[name])


@dataclass(frozen=True)
class EngineConfig:
    """Which engine runs the model, and how."""

    backend: str = "transformers"
    """transformers (the reference, any device), vllm (the fast engine) or exact (the exact arithmetic, as --exact)."""
    dtype: str = "auto"
    """auto (bfloat16 on GPU, float32 on CPU), float32, bfloat16 or float16."""
    device: str = "auto"
    """transformers backend: auto, cpu, cuda, cuda:N."""
    quantize: str | None = None
    """Low-bit rollouts: a scheme of opdcache/quant.py on the transformers engine (w4a16[:g<N>][:sym|:asym], w8a8,
    fp8[:per-tensor|:per-channel], emulated; int8, torch dynamic, CPU), or a vLLM quantization method (fp8, awq, ...)."""
    deterministic: bool = False
    """transformers scoring: bit-identical values whatever the batch (one sequence at a time)."""
    tensor_parallel_size: int = 1
    """vllm: GPUs per model."""
    gpu_memory_utilization: float = 0.85
    """vllm: fraction of accelerator (or, on CPU, host) memory the engine may reserve."""
    max_batch_tokens: int | None = None
    """transformers scoring: padded tokens per decoder batch (activation memory; head blocks are pooled separately);
    None: 1,024 on a CPU, 16,384 on a GPU."""
    generate_batch_size: int = 64
    """transformers generation: sequences decoded together (KV-cache memory; larger is faster for small models)."""
    exact: bool = False
    """The exact arithmetic (opdcache/exact/): stored numbers equal the trainer's exact recompute bit for bit, whatever
    the batch, padding, KV cache or thread count; transformers models of the Llama/Mistral/Qwen2/Qwen3 families. On the
    CPU (device cpu or auto) the CPU arithmetic, on cuda the batch-invariant GPU kernels (opdcache/exact/__init__.py).
    The user's spelling of ``backend="exact"``: either sets both."""

    inject: str | None = None
    """--exact only: controlled mismatch injected into the engine (opdcache/backends/exact.py, Injection), recorded."""

    def __post_init__(self) -> None:
        if self.backend not in ENGINES:
            raise ConfigError(f"--backend must be one of {', '.join(ENGINES)}, got {self.backend!r}")
        if self.exact and self.backend == "vllm":
            raise ConfigError("--exact runs opdcache's exact engine; vLLM's batch-invariant mode is not wired in: drop --backend vllm")
        if self.exact or self.backend == "exact":
            object.__setattr__(self, "backend", "exact")
            object.__setattr__(self, "exact", True)
        if self.inject is not None and not self.exact:
            raise ConfigError("--inject-mismatch perturbs the exact engine against its exact reference: add --exact")
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"--tensor-parallel-size must be at least 1, got {self.tensor_parallel_size}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_batch_tokens is not None and self.max_batch_tokens < 1:
            raise ConfigError(f"--max-batch-tokens must be at least 1, got {self.max_batch_tokens}")
        if self.generate_batch_size < 1:
            raise ConfigError(f"--batch-size must be at least 1, got {self.generate_batch_size}")
        for name, value in engine_module(self.backend).check(self).items():  # the engine's own rules and spellings
            object.__setattr__(self, name, value)

    @property
    def runs_transformers_models(self) -> bool:
        """The engine loads the model with transformers (opdcache's own engines), so its quantization schemes apply."""
        return self.backend in ("transformers", "exact")

    def fingerprint_view(self) -> dict:
        """Settings that change numbers (not memory or batching, except in deterministic mode)."""
        # the exact engine has always recorded backend "transformers" plus its arithmetic: caches keep their fingerprints
        view = {"backend": "transformers" if self.exact else self.backend, "dtype": self.dtype, "quantize": self.quantize,
                "tensor_parallel_size": self.tensor_parallel_size}
        if self.exact:  # absent when off: caches built before --exact keep their fingerprints
            from opdcache.exact import arithmetic_for_device

            view["exact"] = arithmetic_for_device(self.device)
        if self.inject:
            view["inject"] = self.inject
        return view


def make_backend(model: str | Path, engine: EngineConfig, **extra):
    """Load ``model`` in the configured engine. ``extra``: engine-specific start-up settings (vLLM's max_logprobs)."""
    return engine_module(engine.backend).build(model, engine, **extra)


def engine_for_table(record: dict, path: Path, what: str, *, device: str = "cpu", dtype: str | None = None,
                     aligned: str | None = None):
    """The engine that re-computes a table in the arithmetic its manifest ``record`` states: the exact engine for an
    exact table (refused when this opdcache implements another exact arithmetic), else the transformers reference in
    ``dtype`` (default float32) with the recorded emulated low-bit scheme when the table's engine was ours, or
    ``aligned`` (a scheme spec) when given. ``what`` names the table in messages."""
    from opdcache.quant import recorded_spec

    quant = recorded_spec(record.get("quantization"))
    if record.get("exact"):
        from opdcache.exact import GPU_ARITHMETIC, invariant, require

        name = record["exact"].get("arithmetic")
        require(name, "cuda", what, "re-compute it with the opdcache version that wrote it")
        exact_device = "cuda" if name == GPU_ARITHMETIC and not invariant.interpreted() else "cpu"  # the interpreter: tests
        engine = EngineConfig(backend="exact", dtype=record.get("dtype") or "float32", device=exact_device, quantize=quant,
                              inject=record["exact"].get("inject"))
        return make_backend(path, engine, arithmetic=name)
    emulated = quant if quant and record.get("engine") == "transformers" and not quant.startswith("int8") else None
    return make_backend(path, EngineConfig(dtype=dtype or "float32", device=device, quantize=aligned or emulated))

