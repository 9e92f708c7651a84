"""Low-bit arithmetic of a rollout engine, and the learner's forward in the same arithmetic (papers/004, QaRL).

A scheme says how every linear layer but the kept ones (by default the unembedding, ``lm_head``) computes:

* ``w4a16[:g<N>][:sym|:asym]``: int4 weights in groups of N input columns (default 128), symmetric or asymmetric;
  activations stay in the model's precision.
* ``w8a8``: int8 weights per output channel and int8 activations per token (the same rule over each token's input
  row, computed at run time).
* The integer grid's convention, ``:compressed-tensors`` (the default) or ``:absmax``. compressed-tensors is the
  format vLLM loads (llm-compressor writes it; GPTQ and torchao use the same grid): the range [min(x, 0), max(x, 0)]
  spans the whole signed grid, so a symmetric scale is max|x| / 7.5 (int4) or / 127.5 (int8) with q in [-8, 7] or
  [-128, 127], and an asymmetric one (max - min) / 15 with a zero point round(-8 - min / scale); arithmetic in the
  tensor's own dtype, in that library's order, so the values are bit-identical to its ``fake_quantize`` (tested
  against it). ``absmax`` is opdcache's earlier grid: scale max|x| / 7 or / 127 (q in [-8, 7], [-127, 127]),
  asymmetric (max - min) / 15 with an unsigned zero point round(-min / scale), as AWQ stores it; computed in float32.
  A cache's recorded spec names its convention; one recorded before the option existed (none named) is ``absmax``.
* ``fp8[:per-tensor|:per-channel]``: float8 e4m3 (largest finite 448) weights with one scale per tensor or per output
  channel (scale = max|w| / 448) and e4m3 activations with one scale per token. Per token, not per tensor as
  vLLM's dynamic fp8 does: a per-tensor activation scale depends on which other rows share the batch, so no learner
  could reproduce a row's numbers; per token, a row's numbers are its own.
* ``:keep=a,b``: module names (or name suffixes) left in full precision, besides ``lm_head``, which is always kept so a
  stored log-prob keeps its meaning (``:head`` quantizes it too). A name that matches no layer is refused.
* ``int8``: torch's dynamic int8 (fbgemm kernels, CPU only), the scheme before these; not emulated here, so a learner
  cannot be aligned to it (use ``w8a8``, its emulated equivalent).

Every scheme but int8 is emulated: quantize, dequantize, compute in float32 (rounding half to even, as
``torch.round`` and the float8 cast do). The numbers are the scheme's; the speed is not a low-bit kernel's.
:meth:`QuantScheme.spec` is the canonical string recorded in the manifest (``quantization``); parsing it gives the
same scheme back, so a cache says exactly how its rollouts were computed.

:func:`apply_scheme` makes a model compute in a scheme. ``mode="inference"`` (the rollout engine, a frozen pi_ref)
replaces each weight by its dequantized value once; ``mode="train"`` (``train --rollout-aligned``) quantizes the
full-precision master weights on the fly at every forward with straight-through gradients,
w + sg(q(w) - w), so the gradient reaching a master weight is the full-precision gradient at the dequantized
weights, and the optimizer keeps updating the masters. Parameter names and shapes are untouched: checkpoints
save the masters. Memory: in train mode each quantized layer keeps its dequantized weight for the backward (one more
copy of those weights, in the compute dtype: bf16 under autocast), plus a float32 one for the layer being computed;
in inference mode nothing beyond the model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from opdcache.errors import ConfigError

METHODS = ("int8", "w4a16", "w8a8", "fp8")
FP8_MAX = 448.0  # largest finite float8 e4m3fn value
CONVENTIONS = ("compressed-tensors", "absmax")
"""The integer grid's convention (w4a16, w8a8); the first is the default of a spec that names none."""
SPEC_HELP = ("w4a16[:g<N>][:sym|:asym], w8a8 (each [:compressed-tensors|:absmax]), fp8[:per-tensor|:per-channel] "
             "(emulated: quantize, dequantize, compute), each with [:keep=NAME,...] (layers kept exact besides lm_head) and "
             "[:head] (quantize lm_head too); or int8 (torch dynamic, CPU)")


@dataclass(frozen=True)
class QuantScheme:
    method: str
    """int8, w4a16, w8a8 or fp8."""
    group_size: int | None = None
    """w4a16: input columns per weight group."""
    symmetric: bool = True
    """w4a16: symmetric (no zero point) or asymmetric groups."""
    granularity: str | None = None
    """fp8: weight scales per-tensor or per-channel (w8a8: always per-channel)."""
    keep: tuple[str, ...] = ("lm_head",)
    """Module names (or suffixes) kept in full precision."""
    convention: str | None = None
    """w4a16, w8a8: the integer grid, one of CONVENTIONS."""

    @classmethod
    def recorded(cls, spec: str) -> "QuantScheme":
        """The scheme a cache's manifest records. A w4a16/w8a8 spec written before the convention was recorded names
        none, and meant ``absmax``."""
        scheme = cls.parse(spec)
        named = any(p.strip() in CONVENTIONS for p in str(spec).split(":"))
        if scheme.convention is not None and not named:
            return cls(**{**scheme.__dict__, "convention": "absmax"})
        return scheme

    @classmethod
    def parse(cls, spec: str) -> "QuantScheme":
        parts = [p.strip() for p in str(spec).strip().split(":")]
        method, opts = parts[0].lower(), parts[1:]
        if method not in METHODS:
            raise ConfigError(f"--quantize {spec!r}: unknown scheme {method!r}; one of {SPEC_HELP}")
        fields: dict = {"method": method}
        for opt in opts:
            if opt.startswith("keep="):
                fields["keep"] = tuple(dict.fromkeys(fields.get("keep", ("lm_head",)) + tuple(k for k in opt[5:].split(",") if k)))
            elif opt == "head" and method != "int8":
                fields["quantize_head"] = True
            elif method == "w4a16" and re.fullmatch(r"g\d+", opt):
                fields["group_size"] = int(opt[1:])
            elif method == "w4a16" and opt in ("sym", "asym"):
                fields["symmetric"] = opt == "sym"
            elif method == "fp8" and opt in ("per-tensor", "per-channel"):
                fields["granularity"] = opt
            elif method in ("w4a16", "w8a8") and opt in CONVENTIONS:
                fields["convention"] = opt
            else:
                raise ConfigError(f"--quantize {spec!r}: {opt!r} is not an option of {method}; schemes: {SPEC_HELP}")
        if method == "w4a16":
            fields.setdefault("group_size", 128)
            if fields["group_size"] < 1:
                raise ConfigError(f"--quantize {spec!r}: the group size must be at least 1")
        if method == "fp8":
            fields.setdefault("granularity", "per-tensor")
        if method in ("w4a16", "w8a8"):
            fields.setdefault("convention", CONVENTIONS[0])
        if method == "int8" and "keep" in fields and fields["keep"] != ("lm_head",):
            raise ConfigError(f"--quantize {spec!r}: int8 (torch dynamic) always keeps exactly lm_head in full precision")
        if fields.pop("quantize_head", False):
            fields["keep"] = tuple(k for k in fields.get("keep", ("lm_head",)) if k != "lm_head")
        return cls(**fields)

    def spec(self) -> str:
        """The canonical spec: every setting written out (what the manifest records)."""
        if self.method == "int8":
            return "int8"
        parts = [self.method]
        if self.method == "w4a16":
            parts += [f"g{self.group_size}", "sym" if self.symmetric else "asym"]
        if self.convention is not None:
            parts.append(self.convention)
        if self.method == "fp8":
            parts.append(self.granularity)
        if "lm_head" not in self.keep:
            return ":".join(parts + ([f"keep={','.join(self.keep)}"] if self.keep else []) + ["head"])
        return ":".join(parts + [f"keep={','.join(self.keep)}"])

    @property
    def emulated(self) -> bool:
        return self.method != "int8"

    @property
    def quantizes_activations(self) -> bool:
        return self.method in ("w8a8", "fp8")

    def keeps(self, name: str) -> bool:
        return any(name == k or name.endswith("." + k) for k in self.keep)

    def weight(self, w: torch.Tensor) -> torch.Tensor:
        """The dequantized weight [out, in], returned in w's dtype (computed in float32, or in w's dtype under the
        compressed-tensors convention, as that library computes)."""
        x = w.detach() if self.convention == "compressed-tensors" else w.detach().float()
        if self.method == "w4a16":
            q = int4_groups(x, self.group_size, self.symmetric, self.convention)
        elif self.method == "w8a8":
            q = int8_rows(x, self.convention)
        elif self.method == "fp8":
            q = fp8_rows(x) if self.granularity == "per-channel" else fp8_tensor(x)
        else:
            raise ConfigError(f"{self.method} is not emulated")
        return q.to(w.dtype)

    def activation(self, x: torch.Tensor) -> torch.Tensor:
        """The dequantized activations [..., in] (per token), in x's dtype; unchanged when the scheme keeps them."""
        if self.method == "w8a8":
            ct = self.convention == "compressed-tensors"
            return int8_rows(x.detach() if ct else x.detach().float(), self.convention).to(x.dtype)
        if self.method == "fp8":
            return fp8_rows(x.detach().float()).to(x.dtype)
        return x


def parse_quantize(spec: str | None) -> QuantScheme | None:
    return None if spec is None else QuantScheme.parse(spec)


def recorded_spec(spec: str | None) -> str | None:
    """The canonical spec of a manifest's recorded ``quantization`` (a spec from before the convention was recorded
    keeps its meaning: :meth:`QuantScheme.recorded`)."""
    return QuantScheme.recorded(spec).spec() if spec else None


def aligned_scheme(record: dict, where: str) -> QuantScheme:
    """The emulated scheme a table's recorded engine computed in, for ``--rollout-aligned`` (train and mismatch-report
    alike); a refusal naming the fix when no learner can compute in it."""
    spec = record.get("quantization")
    if not spec:
        raise ConfigError(f"--rollout-aligned: {where} records no quantization (sampled in full precision): there is nothing "
                          "to align to; run without --rollout-aligned")
    if record.get("engine") == "vllm":
        raise ConfigError(f"--rollout-aligned: {where} ran vLLM's {spec!r} kernels, which opdcache does not emulate (vLLM's dynamic "
                          "fp8 scales activations per tensor over the whole batch, so no learner reproduces a row's numbers); "
                          "sample with --engine transformers --quantize (w4a16, w8a8 or fp8) to align")
    scheme = QuantScheme.recorded(spec)
    if not scheme.emulated:
        raise ConfigError(f"--rollout-aligned: {where} ran torch's int8 kernels, which opdcache does not emulate; sample with "
                          "--quantize w8a8, its emulated equivalent")
    return scheme


# ------------------------------------------------------------------------------------------------ kernels
def _safe(scale: torch.Tensor) -> torch.Tensor:
    """A zero scale (an all-zero group or row) divides as 1: its values quantize to 0 and dequantize to 0."""
    return torch.where(scale == 0, torch.ones_like(scale), scale)


def int4_groups(w: torch.Tensor, group: int, symmetric: bool, convention: str = "compressed-tensors") -> torch.Tensor:
    """Dequantized int4 groups of ``group`` consecutive input columns of each row of w [out, in] (absmax: float32)."""
    out, cols = w.shape
    if cols % group:
        raise ConfigError(f"w4a16: the group size {group} does not divide the layer's {cols} input columns; "
                          f"pick one that does (e.g. w4a16:g{_divisor(cols, group)})")
    g = w.reshape(out, cols // group, group)
    if convention == "compressed-tensors":
        return _signed_grid(g, 4, symmetric).reshape(out, cols)
    if symmetric:
        scale = _safe(g.abs().amax(-1, keepdim=True) / 7)
        q = torch.round(g / scale).clamp_(-8, 7)
        return (q * scale).reshape(out, cols)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    scale = _safe((hi - lo) / 15)
    zero = torch.round(-lo / scale).clamp_(0, 15)  # a 4-bit zero point, as AWQ stores it
    q = (torch.round(g / scale) + zero).clamp_(0, 15)
    return ((q - zero) * scale).reshape(out, cols)


def _signed_grid(x: torch.Tensor, bits: int, symmetric: bool) -> torch.Tensor:
    """compressed-tensors' integer quantize-dequantize over the last dimension of x, in x's dtype and that library's
    order (calculate_qparams, then _quantize_dequantize): the range [min(x, 0), max(x, 0)] over the signed grid
    [-2^(b-1), 2^(b-1) - 1]; a zero scale becomes the dtype's eps."""
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    span = torch.tensor(qmax - qmin, dtype=x.dtype)
    lo = torch.minimum(x.amin(-1, keepdim=True), torch.zeros((), dtype=x.dtype))
    hi = torch.maximum(x.amax(-1, keepdim=True), torch.zeros((), dtype=x.dtype))
    if symmetric:
        scale = torch.maximum(lo.abs(), hi) / (span / 2)
        zero = None
    else:
        scale = (hi - lo) / span
        with torch.no_grad():  # an all-zero row: 0 / 0; its values quantize to 0 whatever the zero point
            zero = torch.nan_to_num(torch.clamp(qmin - lo / scale, qmin, qmax), nan=0.0).round_().to(torch.int8)
    scale = torch.where(scale == 0, torch.tensor(torch.finfo(x.dtype).eps, dtype=x.dtype), scale)
    scaled = x / scale
    if zero is not None:
        scaled += zero.to(x.dtype)
    q = torch.round(torch.clamp(scaled, qmin, qmax))
    if zero is not None:
        q = q - zero.to(x.dtype)
    return q * scale


def _divisor(cols: int, group: int) -> int:
    """The largest power of two below ``group`` that divides ``cols`` (a suggestion for the error message)."""
    d = 1
    while d * 2 < group and cols % (d * 2) == 0:
        d *= 2
    return d


def int8_rows(x: torch.Tensor, convention: str = "compressed-tensors") -> torch.Tensor:
    """Dequantized symmetric int8 with one scale per row of the last dimension (weights: per output channel;
    activations: per token); absmax: float32."""
    if convention == "compressed-tensors":
        return _signed_grid(x, 8, True)
    scale = _safe(x.abs().amax(-1, keepdim=True) / 127)
    return torch.round(x / scale).clamp_(-127, 127) * scale


def _e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    y = (x / scale).clamp_(-FP8_MAX, FP8_MAX)
    return y.to(torch.float8_e4m3fn).to(torch.float32) * scale


def fp8_rows(x: torch.Tensor) -> torch.Tensor:
    """Dequantized float8 e4m3 with one scale per row of the last dimension (max |x| / 448), float32."""
    return _e4m3(x, _safe(x.abs().amax(-1, keepdim=True) / FP8_MAX))


def fp8_tensor(x: torch.Tensor) -> torch.Tensor:
    """Dequantized float8 e4m3 with one scale for the whole tensor, float32."""
    return _e4m3(x, _safe(x.abs().amax() / FP8_MAX))


# ------------------------------------------------------------------------------------------------ models
class QuantLinear(torch.nn.Linear):
    """A linear layer computing in a scheme. Made by swapping the class of an existing ``nn.Linear`` (parameters,
    names and hooks untouched); ``_opd_train``: straight-through on the master weight at every forward, else
    the weight already holds its dequantized value."""

    _opd_scheme: QuantScheme
    _opd_train: bool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self._opd_scheme
        w = self.weight
        if self._opd_train:
            w = w + (s.weight(w) - w).detach()  # straight-through: forward q(w), gradient identity
        if s.quantizes_activations:
            x = x + (s.activation(x) - x).detach()
        return torch.nn.functional.linear(x, w, self.bias)


def check_config(scheme: QuantScheme | None, model_dir) -> None:
    """Refuse, from a local model's config.json alone (before any weight loads), a w4a16 group size that does not divide
    the input width of one of its linear layers (hidden, intermediate, attention output); a model elsewhere is checked
    when it loads."""
    import json
    from pathlib import Path

    if scheme is None or scheme.method != "w4a16":
        return
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError, TypeError):
        return
    hidden, inter = cfg.get("hidden_size"), cfg.get("intermediate_size")
    heads, head_dim = cfg.get("num_attention_heads"), cfg.get("head_dim")
    widths = {"hidden_size (q/k/v, gate/up)": (hidden, ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")),
              "intermediate_size (down_proj)": (inter, ("down_proj",)),
              "num_attention_heads x head_dim (o_proj)": (heads * head_dim if heads and head_dim else None, ("o_proj",))}
    for what, (cols, names) in widths.items():
        if all(scheme.keeps(n) for n in names):
            continue
        if isinstance(cols, int) and cols % scheme.group_size:
            raise ConfigError(f"w4a16: the group size {scheme.group_size} does not divide the model's {what} of {cols}; "
                              f"pick one that does (e.g. w4a16:g{_divisor(cols, scheme.group_size)})")


def apply_scheme(model: torch.nn.Module, scheme: QuantScheme, mode: str) -> list[str]:
    """Make every ``nn.Linear`` of ``model`` not kept by the scheme compute in it; return the names of those layers.
    ``mode``: "inference" (weights replaced by their dequantized values, once) or "train" (straight-through)."""
    if mode not in ("inference", "train"):
        raise ValueError(f"mode must be inference or train, got {mode!r}")
    if not scheme.emulated:
        raise ConfigError(f"--quantize {scheme.spec()} runs torch's int8 kernels, which opdcache does not emulate; a learner cannot be "
                          "aligned to it (sample with --quantize w8a8, its emulated equivalent)")
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    unknown = [k for k in scheme.keep if k != "lm_head" and not any(n == k or n.endswith("." + k) for n in names)]
    if unknown:
        raise ConfigError(f"--quantize {scheme.spec()}: keep={','.join(unknown)} matches no linear layer of the model (its layer "
                          f"names end in {', '.join(sorted({n.rsplit('.', 1)[-1] for n in names}))})")
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if "lm_head" not in scheme.keep and head is not None and emb is not None and head.weight is emb.weight:
        raise ConfigError(f"--quantize {scheme.spec()}: the model ties lm_head to its input embeddings, so quantizing the head would "
                          "quantize the embeddings too; drop :head")
    done = []
    for name, module in model.named_modules():
        if type(module) is not torch.nn.Linear or scheme.keeps(name) or module is head and "lm_head" in scheme.keep:
            continue
        if scheme.method == "w4a16" and module.in_features % scheme.group_size:
            raise ConfigError(f"w4a16: the group size {scheme.group_size} does not divide the {module.in_features} input columns of {name}; "
                              f"pick one that does (e.g. w4a16:g{_divisor(module.in_features, scheme.group_size)})")
        if mode == "inference":
            with torch.no_grad():
                module.weight.copy_(scheme.weight(module.weight))
        module.__class__ = QuantLinear
        module._opd_scheme, module._opd_train = scheme, mode == "train"
        done.append(name)
    if not done:
        raise ConfigError(f"--quantize {scheme.spec()}: the model has no linear layer to quantize (all kept, or none is torch.nn.Linear)")
    return done
