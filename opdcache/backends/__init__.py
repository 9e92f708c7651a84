"""The engines: one file each (``hf.py``, ``vllm.py``, ``exact.py``) behind the contract of ``base.py``, chosen by
name from one :class:`EngineConfig`.

An engine's file defines ``build(model, engine, **extra)`` (load the model, return the backend) and ``check(engine)``
(its own rules on the settings, checked before any model loads; it returns canonical spellings to store). Adding an
engine is its file plus one line in :data:`ENGINES`. :func:`engine_for_table` is the one place that works out which
engine, in which arithmetic, reproduces a table the manifest records (audit and mismatch-report use it).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, replace
from pathlib import Path

from opdcache.errors import ConfigError

ENGINES = {  # name -> its module, imported only when that engine is configured
    "transformers": "opdcache.backends.hf",
    "vllm": "opdcache.backends.vllm",
    "exact": "opdcache.backends.exact",
    "server": "opdcache.backends.served",
}


def engine_module(name: str):
    if name not in ENGINES:
        raise ConfigError(f"--backend must be one of {', '.join(ENGINES)}, got {name!r}")
    return importlib.import_module(ENGINES[name])


def capabilities(name: str):
    """What the engine ``name`` computes (its module's ``CAPABILITIES``, opdcache/backends/base.py Capabilities)."""
    return engine_module(name).CAPABILITIES


def reference_engine() -> str:
    """The engine that declares itself the reference (the one that reproduces what others cannot)."""
    return next(name for name in ENGINES if capabilities(name).reference)


def describe_statistic(name: str) -> str:
    """A statistic in words, for a message: "the teacher's full-distribution entropy -E_p[log p] (statistic entropy)"."""
    from opdcache.backends.base import STATISTICS

    return f"{STATISTICS[name].doc} (statistic {name})"


def engines_computing(names) -> list[str]:
    """The engines that compute every statistic of ``names``."""
    return [engine for engine in ENGINES if not capabilities(engine).missing(names)]


@dataclass(frozen=True)
class EngineConfig:
    """Which engine runs the model, and how."""

    backend: str = "transformers"
    """The engine that runs the model, a name of opdcache.backends.ENGINES (what each computes: docs/engines.md);
    transformers is the reference, exact is --exact's engine."""
    dtype: str = "auto"
    """auto (bfloat16 on GPU, float32 on CPU), float32, bfloat16 or float16."""
    device: str = "auto"
    """transformers backend: auto, cpu, cuda, cuda:N."""
    quantize: str | None = None
    """Low-bit rollouts. transformers: w4a16[:g<N>][:sym|:asym] (int4 weight groups, default g128 sym), w8a8 (int8
    weights per channel, activations per token), fp8[:per-tensor|:per-channel] (e4m3 weights, activations per token)
    -- emulated on any device: quantize, dequantize, compute in the model's dtype; add :keep=NAME,... for layers
    kept exact (default lm_head); int8: torch dynamic int8, CPU. vllm: its method (fp8, awq, ...). Default: none
    (the model's own precision)."""
    deterministic: bool = False
    """transformers scoring: bit-identical values whatever the batch (one sequence at a time)."""
    tensor_parallel_size: int = 1
    """vllm: GPUs per model."""
    gpu_memory_utilization: float = 0.85
    """vllm: fraction of accelerator (or, on CPU, host) memory the engine may reserve."""
    max_batch_tokens: int | None = None
    """transformers scoring: padded tokens per decoder batch, the activation memory (head blocks are pooled
    separately). Default: none (1,024 on a CPU, 16,384 on a GPU)."""
    generate_batch_size: int = 64
    """transformers generation: sequences decoded together (the KV cache's memory; larger is faster for small
    models)."""
    exact: bool = False
    """One exact arithmetic (papers/003): stored log-probs equal the trainer's exact recompute bit for bit, whatever
    the batch, padding, KV cache or threads (Llama/Mistral/Qwen2/Qwen3; float32 or bfloat16). On the CPU (--device
    cpu, the default): the same bits on any machine; memory plus a float64 copy of the weights (8 bytes per
    parameter). With --device cuda: batch-invariant Triton kernels, the GPU's own bits, in bfloat16 (the default
    there; float32 is refused until its path is batch-invariant on a GPU; needs triton, compute capability 8.0+);
    memory: the model, the KV cache, and [batch, heads, 256, length] float32 attention scores per block of 256
    queries (no fused attention kernel). Recorded in the manifest; a resume must keep it."""

    server_url: str | None = None
    """--backend server: the running servers' base URLs, comma-separated (replicas of one model: vLLM's OpenAI-compatible
    server or SGLang's), e.g. http://127.0.0.1:8000,http://127.0.0.1:8001. Not recorded (the manifest records what they
    served, not where)."""
    server_kind: str = "auto"
    """--backend server: vllm, sglang, or auto (read from each server's endpoints)."""
    server_concurrency: int | None = None
    """--backend server: requests in flight a replica. Default: none (64)."""
    server_timeout: float = 600.0
    """--backend server: seconds one request may take before it is retried."""
    api_key: str | None = None
    """--backend server: the servers' API key (default: OPDCACHE_API_KEY, else OPENAI_API_KEY). Never recorded or printed."""

    inject: str | None = None
    """With --exact: controlled mismatch for calibrating TIS and rejection against the exact reference (papers/003
    section 6): logit-noise:SIGMA (Gaussian noise of scale SIGMA nats on every logit) or bf16-activations (each layer's
    output rounded to bfloat16); opdcache/backends/exact.py, Injection. Recorded in the manifest."""

    def __post_init__(self) -> None:
        if self.backend not in ENGINES:
            raise ConfigError(f"--backend must be one of {', '.join(ENGINES)}, got {self.backend!r}")
        if self.exact and self.backend != "exact" and not capabilities(self.backend).reference:
            raise ConfigError(f"--exact runs opdcache's exact engine; --backend {self.backend} has no exact arithmetic wired in: "
                              f"drop --backend {self.backend}")
        if self.server_url is not None and self.backend != "server":
            raise ConfigError(f"--server-url names running servers, which --backend {self.backend} does not use: add --backend server")
        if self.exact or self.backend == "exact":  # --exact is the user's spelling of the exact engine: either sets both
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
    def capabilities(self):
        """What this engine computes (opdcache/backends/base.py Capabilities)."""
        return capabilities(self.backend)

    @property
    def runs_transformers_models(self) -> bool:
        """The engine loads the model with transformers (opdcache's own engines), so its quantization schemes apply."""
        return self.capabilities.quantization == "emulated"

    def check_sampling(self, temperature: float) -> None:
        """The engine's own limits on sampling, before it starts (one line naming the flag)."""
        hottest = self.capabilities.max_temperature
        if hottest is not None and temperature > hottest:
            raise ConfigError(f"--temperature must be at most {hottest} with --backend {self.backend} (the engine's own limit), "
                              f"got {temperature}; use --backend {reference_engine()} for hotter sampling")

    def with_statistics(self, names, why: str) -> tuple["EngineConfig", str | None]:
        """(this engine, None) when it computes the statistics ``names``; else the reference engine with the same
        settings and the note to print (``why`` says what runs there: "the hidden store is scored")."""
        missing = self.capabilities.missing(names)
        if not missing:
            return self, None
        ref = reference_engine()
        return replace(self, backend=ref), f"note: --backend {self.backend} does not compute {describe_statistic(missing[0])}; {why} on the {ref} engine"

    def __repr__(self) -> str:  # the API key never reaches a log or a traceback
        import re

        shown = {k: ("***" if k == "api_key" and v else v) for k, v in self.__dict__.items()}
        if self.server_url:
            shown["server_url"] = re.sub(r"//[^/@,]+@", "//***@", self.server_url)
        return "EngineConfig(" + ", ".join(f"{k}={v!r}" for k, v in shown.items()) + ")"

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


def backend_from_model(model, engine: EngineConfig | None = None):
    """An engine around a model already in memory (an online learner's current weights, generating as it learns):
    ``engine``'s (its --exact and --inject-mismatch settings), by default the reference."""
    return engine_module(engine.backend if engine else reference_engine()).from_model(model, engine)


def is_reference_record(record: dict) -> bool:
    """Whether a manifest's model record is the reference engine's, in float32 and its own precision: the table other
    tables of the same weights are compared with (mismatch-report)."""
    return record.get("engine") == reference_engine() and record.get("dtype") == "float32" and not record.get("quantization")


def engine_for_table(record: dict, path: Path, what: str, *, device: str = "cpu", dtype: str | None = None,
                     aligned: str | None = None):
    """The engine that re-computes a table in the arithmetic its manifest ``record`` states: the exact engine for an
    exact table (refused when this opdcache implements another exact arithmetic), else the transformers reference in
    ``dtype`` (default float32) with the recorded emulated low-bit scheme when the table's engine was ours, or
    ``aligned`` (a scheme spec) when given. ``what`` names the table in messages."""
    from opdcache.backends.quant import recorded_spec

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

