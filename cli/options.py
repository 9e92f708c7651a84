"""Option and argument types shared by several commands, defined once; and the options of a settings dataclass, whose
help is the field's own docstring (:class:`Fields`)."""

from __future__ import annotations

import ast
import functools
import importlib.util
from pathlib import Path
from typing import Annotated, Optional

import typer

CachePath = Annotated[str, typer.Argument(metavar="CACHE", help="Cache: the folder holding opdcache.json, or a URL (s3://bucket/prefix, gs://..., hf://datasets/org/name).", show_default=False)]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="Print only problems and the final line.")]
JsonOut = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON instead of a table.")]
Token = Annotated[Optional[str], typer.Option("--token", help="Hub token; defaults to HF_TOKEN or your `hf auth login`. Never printed.", show_default=False)]
Revision = Annotated[Optional[str], typer.Option("--revision", help="Hub branch or commit. Default: none (main).")]
NumWorkers = Annotated[Optional[int], typer.Option("--num-workers", help="Workers sharing the job (default: SLURM array size, torchrun WORLD_SIZE, or 1).", show_default=False)]
WorkerIndex = Annotated[Optional[int], typer.Option("--worker-index", help="This worker's index in [0, num-workers) (default: SLURM array index, torchrun RANK, or 0).", show_default=False)]

Executor = Annotated[str, typer.Option("--executor", help="local (this process; --num-workers/--worker-index for Slurm or torchrun) or ray (--workers tasks on a Ray cluster).")]
RayAddress = Annotated[Optional[str], typer.Option("--ray-address", help="Ray cluster address (default: RAY_ADDRESS, else a local cluster).", show_default=False)]
RayWorkers = Annotated[int, typer.Option("--workers", help="--executor ray: tasks, each with its own engine and whole shards.")]
GpusPerWorker = Annotated[float, typer.Option("--gpus-per-worker", help="--executor ray: GPUs each task reserves.")]
CpusPerWorker = Annotated[float, typer.Option("--cpus-per-worker", help="--executor ray: CPUs each task reserves; it runs that many torch threads.")]

# ---- models and engines
ModelPath = Annotated[str, typer.Option("--model", help="Model: a local Hugging Face directory or a Hub id org/name[@revision] (offline from the Hub cache with HF_HUB_OFFLINE=1).", show_default=False)]
TeacherModel = Annotated[str, typer.Option("--teacher", help="Teacher: a local Hugging Face directory or a Hub id org/name[@revision].", show_default=False)]
ModelRevision = Annotated[Optional[str], typer.Option("--revision", help="Hub branch, tag or commit of the model (or org/name@revision). Default: none (the main branch, resolved to its commit).", show_default=False)]
Backend = Annotated[str, typer.Option("--backend", help="transformers (exact reference, any device) or vllm (fast engine).")]
Dtype = Annotated[str, typer.Option("--dtype", help="auto (bfloat16 on GPU, float32 on CPU), float32, bfloat16, float16.")]
Device = Annotated[str, typer.Option("--device", help="transformers backend: auto, cpu, cuda, cuda:N.")]
Quantize = Annotated[Optional[str], typer.Option("--quantize", help="Low-bit rollouts. transformers: w4a16[:g<N>][:sym|:asym] (int4 weight groups, default g128 sym), w8a8 (int8 weights per channel, activations per token), fp8[:per-tensor|:per-channel] (e4m3 weights, activations per token) -- emulated on any device: quantize, dequantize, compute in the model's dtype; add :keep=NAME,... for layers kept exact (default lm_head); int8: torch dynamic int8, CPU. vllm: its method (fp8, awq, ...).", show_default=False)]
Exact = Annotated[bool, typer.Option("--exact", help="One exact arithmetic (papers/003): stored log-probs equal the trainer's exact recompute bit for bit, whatever the batch, padding, KV cache or threads (Llama/Mistral/Qwen2/Qwen3; float32 or bfloat16). On the CPU (--device cpu, the default): the same bits on any machine; memory plus a float64 copy of the weights (8 bytes per parameter). With --device cuda: batch-invariant Triton kernels, the GPU's own bits, in bfloat16 (the default there; float32 is refused until its path is batch-invariant on a GPU; needs triton, compute capability 8.0+); memory: the model, the KV cache, and [batch, heads, 256, length] float32 attention scores per block of 256 queries (no fused attention kernel). Recorded in the manifest; a resume must keep it.")]
InjectMismatch = Annotated[Optional[str], typer.Option("--inject-mismatch", help="With --exact: controlled mismatch for calibrating TIS and rejection against the exact reference (papers/003 section 6): logit-noise:SIGMA (Gaussian noise of scale SIGMA nats on every logit) or bf16-activations (each layer's output rounded to bfloat16). Recorded in the manifest. Default: none.", show_default=False)]
Deterministic = Annotated[bool, typer.Option("--deterministic", help="Bit-identical scores whatever the batch (scores one sequence at a time).")]
TensorParallel = Annotated[int, typer.Option("--tensor-parallel-size", help="vllm: GPUs per model.")]
GenerateBatch = Annotated[int, typer.Option("--batch-size", help="transformers: sequences decoded together (KV-cache memory; larger is faster for small models).")]
ScoreBatchTokens = Annotated[Optional[int], typer.Option("--max-batch-tokens", help="transformers scoring: padded tokens per decoder batch, the activation memory (default: 1,024 on a CPU, 16,384 on a GPU).", show_default=False)]
GpuMemory = Annotated[float, typer.Option("--gpu-memory-utilization", help="vllm: fraction of device memory the engine may reserve.")]
NumShards = Annotated[int, typer.Option("--num-shards", help="Shards of the table: the unit of resume and of parallel work.")]
Progress = Annotated[Optional[bool], typer.Option("--progress/--no-progress", help="Progress bars (default: only on a terminal).", show_default=False)]

# ---- prompts
Prompts = Annotated[Path, typer.Option("--prompts", help="Prompts: .jsonl, .parquet, a datasets directory, or a Hub dataset id org/name[@revision] (offline from the Hub cache).", show_default=False)]
PromptField = Annotated[str, typer.Option("--prompt-field", help="Field with the user message.")]
MessagesField = Annotated[Optional[str], typer.Option("--messages-field", help="Field with a list of chat messages (overrides --prompt-field). Default: none (plain prompts).", show_default=False)]
AnswerField = Annotated[str, typer.Option("--answer-field", help="Field with the reference answer (optional in the data).")]
ChatTemplate = Annotated[bool, typer.Option("--chat-template/--no-chat-template", help="Apply the tokenizer's chat template.")]
Strict = Annotated[bool, typer.Option("--strict", help="Stop at the first malformed prompt row instead of skipping it.")]
SystemPrompt = Annotated[Optional[str], typer.Option("--system-prompt", help="A system turn before every prompt that has none. Default: none.", show_default=False)]
ChatTemplateKwargs = Annotated[Optional[str], typer.Option("--chat-template-kwargs", help='JSON object of chat-template variables, e.g. \'{"enable_thinking": true}\'. Default: none.', show_default=False)]
PromptSplit = Annotated[str, typer.Option("--prompt-split", help="Split to read when --prompts is a Hub dataset id.")]
Limit = Annotated[Optional[int], typer.Option("--limit", help="Read at most this many prompt rows. Default: none (all).", show_default=False)]
Reward = Annotated[Optional[str], typer.Option("--reward", help="Verifier for the reward column: exact (normalised text equals the answer), math (the last \\boxed{} is equivalent to the answer; opdcache[math]), math-fallback (math, else the last number), a registered plugin (the demo's addition), or module:function. Default: none (no reward column).", show_default=False)]
CreditTruncated = Annotated[bool, typer.Option("--credit-truncated", help="Let the verifier judge responses cut at --max-new-tokens (default: they score 0).")]

# ---- sampling
Samples = Annotated[int, typer.Option("--samples", help="Samples per prompt.")]
Temperature = Annotated[float, typer.Option("--temperature", help="Sampling temperature (0 = greedy).")]
TopP = Annotated[float, typer.Option("--top-p", help="Nucleus sampling threshold.")]
MaxNewTokens = Annotated[int, typer.Option("--max-new-tokens", help="Maximum response length; longer ones end with finish_reason=length.")]
Seed = Annotated[int, typer.Option("--seed", help="Random seed.")]


def announce_threads() -> None:
    """Pick torch's CPU threads (opdcache/threads.py); say what was picked and why on a terminal (in logs and pipes the
    manifest's `compute` record says it, and an error stays the one line on stderr)."""
    import sys

    from opdcache.threads import configure

    line = configure()
    if sys.stderr.isatty():
        typer.echo(line, err=True)


_NO_DEFAULT = object()


@functools.cache
def _source(module: str) -> ast.Module:
    """A library module's syntax tree, read from its source: building the commands imports neither torch nor the library
    (finding a submodule's spec would import its parent packages)."""
    top, *rest = module.split(".")
    path = Path(importlib.util.find_spec(top).origin).parent.joinpath(*rest)
    return ast.parse((path / "__init__.py" if path.is_dir() else path.with_suffix(".py")).read_text())


def literal(module: str, name: str) -> object:
    """The value of a module-level constant assigned a literal (``NAME = {...}``), read from the module's source."""
    node = next(n for n in _source(module).body if isinstance(n, ast.Assign) and [t.id for t in n.targets if isinstance(t, ast.Name)] == [name])
    return ast.literal_eval(node.value)


@functools.cache
def _field_docs(module: str, cls: str) -> dict[str, tuple[str, object]]:
    """Each field of the dataclass ``cls`` of ``module``: (its docstring on one line, its literal default or
    _NO_DEFAULT), read from the module's source."""
    body = next(n for n in _source(module).body if isinstance(n, ast.ClassDef) and n.name == cls).body
    docs = {}
    for stmt, after in zip(body, body[1:] + [None]):
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        doc = after.value.value if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) else ""
        try:
            default = ast.literal_eval(stmt.value) if stmt.value is not None else _NO_DEFAULT
        except ValueError:  # a factory or an expression: the docstring says what it is
            default = _NO_DEFAULT
        docs[stmt.target.id] = (" ".join(str(doc).split()), default)
    return docs


def _said(value: object) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


class Fields:
    """The options of a settings dataclass's fields: ``--name`` (underscores as dashes) with the field's docstring as
    its help, so that a setting is described once, where it is declared, and a command cannot drift from it."""

    def __init__(self, module: str, cls: str) -> None:
        self.module, self.cls = module, cls

    def doc(self, name: str) -> str:
        """The field's docstring on one line (KeyError for a name the dataclass does not declare)."""
        return _field_docs(self.module, self.cls)[name][0]

    def default(self, name: str) -> object:
        return _field_docs(self.module, self.cls)[name][1]

    def option(self, name: str, *flags: str, note: str = "", state_default: bool = True, defaults: dict | None = None,
               **kwargs) -> typer.models.OptionInfo:
        """``typer.Option`` for field ``name``: its flags (default ``--name``, or ``--name/--no-name`` for a field that
        defaults to a bool), help = docstring + ``note``; with
        ``state_default`` (for a command whose flags default to None so that a file of settings can fill them) the
        field's default (or ``defaults[name]``, where a command's differ) is added to the help unless the docstring says
        it; without it, the command's own default is shown."""
        help = " ".join(part for part in (self.doc(name), note) if part)
        if state_default:
            default = (defaults or {}).get(name, self.default(name))
            if default is not _NO_DEFAULT and "default" not in help.lower():
                help += f" Default: {_said(default)}."
        if not flags:
            flag = "--" + name.replace("_", "-")
            flags = (f"{flag}/--no-{flag[2:]}",) if isinstance(self.default(name), bool) else (flag,)
        return typer.Option(*flags, help=help, show_default=not state_default, **kwargs)
