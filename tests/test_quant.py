"""The emulated low-bit kernels (opdcache/backends/quant.py) against references written by hand, element by element in plain
Python, and the straight-through gradient against the full-precision gradient at the dequantized weights."""

import math

import numpy as np
import pytest
import torch

from opdcache.backends.quant import apply_scheme, fp8_rows, fp8_tensor, int4_groups, int8_rows, QuantScheme
from opdcache.errors import ConfigError


def f32(x: float) -> float:
    return float(np.float32(x))


def div32(a: float, b: float) -> float:
    """a / b rounded to float32, as the kernel divides."""
    return float(np.float32(a) / np.float32(b))


def ref_int4_row(row: list[float], group: int, symmetric: bool) -> list[float]:
    out = []
    for g in range(0, len(row), group):
        vals = row[g: g + group]
        if symmetric:
            scale = div32(max(abs(v) for v in vals), 7.0) or 1.0
            out += [f32(min(7, max(-8, round(div32(v, scale)))) * scale) for v in vals]
        else:
            lo, hi = min(vals), max(vals)
            scale = div32(f32(hi - lo), 15.0) or 1.0
            zero = min(15, max(0, round(div32(-lo, scale))))
            out += [f32((min(15, max(0, round(div32(v, scale)) + zero)) - zero) * scale) for v in vals]
    return out


def ref_int8_row(row: list[float]) -> list[float]:
    scale = div32(max(abs(v) for v in row), 127.0) or 1.0
    return [f32(min(127, max(-127, round(div32(v, scale)))) * scale) for v in row]


def e4m3_grid() -> list[float]:
    """Every finite non-negative float8 e4m3fn value, from its bit layout: 4 exponent bits (bias 7), 3 mantissa bits,
    exponent 0 subnormal, exponent 15 with mantissa 7 the NaN (no infinities)."""
    vals = []
    for e in range(16):
        for m in range(8):
            if e == 15 and m == 7:
                continue
            vals.append((m / 8) * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return vals


GRID = e4m3_grid()


def ref_e4m3(y: float) -> float:
    """Round y to the nearest e4m3 value, ties to the even mantissa (the grid's even index), saturating at 448."""
    a = min(abs(y), 448.0)
    i = min(range(len(GRID)), key=lambda k: (abs(GRID[k] - a), k % 2))
    return math.copysign(GRID[i], y)


def ref_fp8_row(row: list[float], amax: float) -> list[float]:
    scale = div32(amax, 448.0) or 1.0
    return [f32(ref_e4m3(div32(v, scale)) * scale) for v in row]


def tensors(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g)
    w[0, :8] = 0.0  # an all-zero group
    w[1, 3] = 1e4  # an extreme value in one group
    w[2, :] = -w[2, :].abs()  # a row of one sign (asymmetric zero point at the edge)
    return w


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group", [4, 8, 16])
def test_int4_groups_match_the_hand_reference(group, symmetric):
    w = tensors(5, 16)
    got = int4_groups(w, group, symmetric, "absmax")
    want = torch.tensor([ref_int4_row(r, group, symmetric) for r in w.tolist()])
    assert torch.equal(got, want)
    assert torch.equal(got[0, :8], torch.zeros(8))  # the all-zero group dequantizes to zeros
    # group boundaries: each group's values depend on that group alone
    w2 = w.clone()
    w2[:, group:] *= 3
    assert torch.equal(int4_groups(w2, group, symmetric, "absmax")[:, :group], got[:, :group])
    ct = int4_groups(w, group, symmetric)
    assert torch.equal(ct, torch.tensor([ref_ct_row(r, 4, group, symmetric) for r in w.tolist()]))
    assert torch.equal(int4_groups(w2, group, symmetric)[:, :group], ct[:, :group])


def ref_ct_row(row: list[float], bits: int, group: int, symmetric: bool) -> list[float]:
    """compressed-tensors' grid by hand: the range [min(x, 0), max(x, 0)] over [-2^(b-1), 2^(b-1) - 1]."""
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    out = []
    for g in range(0, len(row), group):
        vals = row[g: g + group]
        lo, hi = min(min(vals), 0.0), max(max(vals), 0.0)
        if symmetric:
            scale, zero = div32(max(-lo, hi), (qmax - qmin) / 2), 0
        else:
            scale = div32(f32(hi - lo), qmax - qmin)
            zero = round(min(qmax, max(qmin, f32(qmin - div32(lo, scale))))) if scale else 0
        scale = scale or float(np.finfo(np.float32).eps)
        out += [f32((round(min(qmax, max(qmin, f32(div32(v, scale) + zero)))) - zero) * scale) for v in vals]
    return out


def test_int4_levels_and_extremes():
    w = torch.tensor([[7.0, -8.0, 3.5, 2.5, -3.5, 0.4, 0.5, -7.0]])  # scale 8/7: ties and the clamp at -8
    got = int4_groups(w, 8, True, "absmax")
    q = torch.round(got / (8 / 7))
    assert q.min() >= -8 and q.max() <= 7
    assert torch.equal(got, torch.tensor([ref_int4_row(w[0].tolist(), 8, True)]))
    asym = int4_groups(w, 8, False, "absmax")
    assert len(set(asym[0].tolist())) <= 16
    # compressed-tensors at scale 7.5 / 7.5 = 1: 7.5 clamps to 7, -7.5 rounds half to even onto the grid's -8
    ct = int4_groups(torch.tensor([[7.5, -7.5, 2.5, 3.5, -0.5, 0.4, 1.5, -6.6]]), 8, True)
    assert torch.equal(ct, torch.tensor([[7.0, -8.0, 2.0, 4.0, -0.0, 0.0, 2.0, -7.0]]))


def test_int8_rows_match_the_hand_reference():
    x = tensors(6, 24, seed=1)
    assert torch.equal(int8_rows(x, "absmax"), torch.tensor([ref_int8_row(r) for r in x.tolist()]))
    assert torch.equal(int8_rows(x), torch.tensor([ref_ct_row(r, 8, 24, True) for r in x.tolist()]))
    for convention in ("absmax", "compressed-tensors"):
        assert torch.equal(int8_rows(torch.zeros(2, 5), convention), torch.zeros(2, 5))
        x3 = torch.randn(2, 3, 24, generator=torch.Generator().manual_seed(2))  # activations [batch, tokens, features]: per token
        assert torch.equal(int8_rows(x3, convention)[1, 2], int8_rows(x3[1, 2:3], convention)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compressed_tensors_convention_is_bit_identical_to_that_library(dtype):
    """The default grid against compressed-tensors' own calculate_qparams + fake_quantize (the library llm-compressor
    writes checkpoints with and vLLM loads): int4 groups symmetric and asymmetric, int8 channels, fp8 both
    granularities, in float32 and bfloat16 (the library computes in the tensor's dtype)."""
    ct = pytest.importorskip("compressed_tensors.quantization")
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    w = tensors(8, 256, seed=4).to(dtype)
    w[3, 128:] = 0.0  # an all-zero group

    def lib(x, args, reduce):
        lo, hi = reduce(x, "amin"), reduce(x, "amax")
        scale, zero = calculate_qparams(lo, hi, args)
        return fake_quantize(x, scale, zero, args)

    groups = lambda x, f: getattr(x.reshape(x.shape[0], -1, 64), f)(-1)  # noqa: E731
    rows = lambda x, f: getattr(x, f)(-1, keepdim=True)  # noqa: E731
    whole = lambda x, f: getattr(x, f)().reshape(1)  # noqa: E731
    for symmetric in (True, False):
        args = ct.QuantizationArgs(num_bits=4, symmetric=symmetric, strategy="group", group_size=64)
        scheme = QuantScheme.parse(f"w4a16:g64:{'sym' if symmetric else 'asym'}")
        assert torch.equal(scheme.weight(w), lib(w, args, groups)), symmetric
    w8 = QuantScheme.parse("w8a8")
    assert torch.equal(w8.weight(w), lib(w, ct.QuantizationArgs(num_bits=8, symmetric=True, strategy="channel"), rows))
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(5)).to(dtype)  # activations: per token, as the library's dynamic token strategy
    assert torch.equal(w8.activation(x), lib(x, ct.QuantizationArgs(num_bits=8, symmetric=True, strategy="token", dynamic=True), rows))
    wf = w.float()  # fp8 is computed in float32
    fp8 = dict(num_bits=8, type="float", symmetric=True)
    assert torch.equal(fp8_rows(wf), lib(wf, ct.QuantizationArgs(**fp8, strategy="channel"), rows))
    assert torch.equal(fp8_tensor(wf), lib(wf, ct.QuantizationArgs(**fp8, strategy="tensor"), whole))


def test_recorded_specs_keep_their_convention():
    assert QuantScheme.parse("w4a16").spec() == "w4a16:g128:sym:compressed-tensors:keep=lm_head"
    assert QuantScheme.parse("w8a8:absmax").convention == "absmax"
    # a cache written before the convention was recorded: its spec names none, and meant absmax
    assert QuantScheme.recorded("w4a16:g128:sym:keep=lm_head").convention == "absmax"
    assert QuantScheme.recorded("w8a8:keep=lm_head").spec() == "w8a8:absmax:keep=lm_head"
    assert QuantScheme.recorded("w8a8:compressed-tensors:keep=lm_head").convention == "compressed-tensors"
    assert QuantScheme.recorded("fp8:per-tensor:keep=lm_head").convention is None
    with pytest.raises(ConfigError, match="'absmax' is not an option of fp8"):
        QuantScheme.parse("fp8:absmax")


def test_fp8_matches_the_hand_reference_including_ties_and_subnormals():
    x = tensors(4, 32, seed=3)
    got = fp8_rows(x)
    want = torch.tensor([ref_fp8_row(r, max(abs(v) for v in r)) for r in x.tolist()])
    assert torch.equal(got, want)
    whole = fp8_tensor(x)
    amax = float(x.abs().max())
    assert torch.equal(whole, torch.tensor([ref_fp8_row(r, amax) for r in x.tolist()]))
    # ties between two grid values and subnormals, at scale 1 (amax 448)
    probe = torch.tensor([[448.0, 1.0625, 1.1875, 2 ** -9, 3 * 2 ** -10, 2 ** -12, 17.0, -0.0]])
    assert torch.equal(fp8_rows(probe), torch.tensor([[ref_e4m3(v) for v in probe[0].tolist()]]))


def test_spec_round_trips_and_errors_name_the_fix():
    for spec in ("w4a16", "w4a16:g32:asym", "w4a16:absmax", "w8a8", "fp8:per-channel", "fp8:keep=lm_head,o_proj", "int8"):
        s = QuantScheme.parse(spec)
        assert QuantScheme.parse(s.spec()) == s == QuantScheme.recorded(s.spec())
    with pytest.raises(ConfigError, match="unknown scheme 'w3a16'"):
        QuantScheme.parse("w3a16")
    with pytest.raises(ConfigError, match="'g32' is not an option of fp8"):
        QuantScheme.parse("fp8:g32")
    with pytest.raises(ConfigError, match=r"group size 128 does not divide the layer's 64 input columns.*w4a16:g64"):
        int4_groups(torch.ones(2, 64), 128, True)


def tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=32, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


@pytest.mark.parametrize("spec", ["w4a16:g16", "w8a8", "fp8:per-channel"])
def test_inference_and_train_modes_compute_the_same_numbers(spec):
    scheme = QuantScheme.parse(spec)
    base = tiny_model()
    inf, tr = tiny_model(), tiny_model()
    names = apply_scheme(inf.eval(), scheme, "inference")
    apply_scheme(tr.eval(), scheme, "train")
    assert "lm_head" not in names and any(n.endswith("q_proj") for n in names)
    ids = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(0))
    a, b, c = inf(ids).logits, tr(ids).logits, base(ids).logits
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert (a - c).abs().max() > 1e-4  # the scheme changes the numbers
    assert set(tr.state_dict()) == set(base.state_dict())  # checkpoints keep the masters under their own names
    torch.testing.assert_close(tr.state_dict()["model.layers.0.mlp.up_proj.weight"], base.state_dict()["model.layers.0.mlp.up_proj.weight"])


def test_straight_through_gradient_is_the_full_precision_gradient_at_the_dequantized_weights():
    scheme = QuantScheme.parse("w4a16:g16:asym")
    aligned, plain = tiny_model(), tiny_model()
    apply_scheme(aligned, scheme, "train")
    with torch.no_grad():  # the plain model holds the dequantized weights as ordinary parameters
        for name, module in plain.named_modules():
            if type(module) is torch.nn.Linear and name != "lm_head":
                module.weight.copy_(scheme.weight(module.weight))
    ids = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(1))
    for m in (aligned, plain):
        m(ids, labels=ids).loss.backward()
    ga, gp = dict(aligned.named_parameters()), dict(plain.named_parameters())
    for name in ga:
        torch.testing.assert_close(ga[name].grad, gp[name].grad, rtol=1e-5, atol=1e-7)


def test_int8_is_not_alignable():
    with pytest.raises(ConfigError, match="sample with --quantize w8a8"):
        apply_scheme(tiny_model(), QuantScheme.parse("int8"), "train")


def test_keep_adds_to_lm_head_head_quantizes_it_and_unknown_names_are_refused(weights):
    from opdcache.inputs.models import load_causal_lm
    from opdcache.backends.quant import QuantScheme, apply_scheme

    s = QuantScheme.parse("w4a16:g32:keep=down_proj")
    assert s.keep == ("lm_head", "down_proj") and s.spec() == "w4a16:g32:sym:compressed-tensors:keep=lm_head,down_proj"
    assert QuantScheme.parse(s.spec()) == s
    h = QuantScheme.parse("w4a16:g32:head")
    assert "lm_head" not in h.keep and h.spec() == "w4a16:g32:sym:compressed-tensors:head" and QuantScheme.parse(h.spec()) == h
    model = load_causal_lm(weights / "student", torch.float32)
    done = apply_scheme(model, QuantScheme.parse("w8a8:keep=down_proj"), "inference")
    assert not any(n.endswith("down_proj") for n in done) and not any("lm_head" in n for n in done)
    model = load_causal_lm(weights / "student", torch.float32)
    assert "lm_head" in apply_scheme(model, QuantScheme.parse("w8a8:head"), "inference")  # untied: the head is quantized
    model = load_causal_lm(weights / "student", torch.float32)
    model.get_output_embeddings().weight = model.get_input_embeddings().weight  # as a tied model (SmolLM2, Qwen small) has it
    with pytest.raises(ConfigError, match="ties lm_head to its input embeddings, so quantizing the head would quantize the embeddings too"):
        apply_scheme(model, QuantScheme.parse("w8a8:head"), "inference")
    with pytest.raises(ConfigError, match=r"keep=donw_proj matches no linear layer of the model \(its layer names end in .*down_proj"):
        apply_scheme(load_causal_lm(weights / "student", torch.float32), QuantScheme.parse("w8a8:keep=donw_proj"), "inference")


def test_vllm_records_what_it_computes_in_from_the_checkpoint_config():
    """vLLM's record (opdcache/backends/vllm.py, no vLLM needed): a pre-quantized checkpoint by its
    quantization_config as AWQ, GPTQ and llm-compressor write it; an on-the-fly method by what vLLM does with it."""
    from opdcache.backends.vllm import recorded_quantization

    awq = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
    gptq = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
    ct = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
          "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None,
                                        "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": True}}}}
    fp8 = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    assert recorded_quantization({"quantization_config": awq}, None) == "awq:w4:g128:asym"
    assert recorded_quantization({"quantization_config": gptq}, None) == "gptq:w4:g128:sym"
    assert recorded_quantization({"quantization_config": ct}, None) == "compressed-tensors:group_0=w4inta16/group/g128/sym:ignore=lm_head"
    assert recorded_quantization({"quantization_config": fp8}, "fp8") == "fp8:activations=dynamic"
    assert recorded_quantization({}, "fp8") == "vllm-fp8:weights=per-tensor:activations=dynamic-per-tensor"
    assert recorded_quantization({}, None) is None
