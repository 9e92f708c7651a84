"""Compact top-k encodings (opdcache/compact.py): each round-trips within its declared bound on adversarial rows."""

import numpy as np
import pytest

from opdcache.compact import Q8_FLOOR, TopkCodec, distortion
from opdcache.errors import ConfigError


def adversarial_rows(k: int = 8):
    """[T, k] ids and log-probs: an ordinary position, exact ties, one token with all the mass (the rest -inf),
    k larger than a 5-token vocabulary (the extra entries -inf), and very small probabilities."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=50) * 2
    lp = logits - np.log(np.exp(logits).sum())
    top = np.argsort(-lp)[:k]
    rows_ids, rows_lp = [top], [lp[top]]
    rows_ids.append(np.arange(k) + 3)
    rows_lp.append(np.full(k, np.log(1 / 16)))  # 8 ties of 1/16: half the mass, the rest outside the top-k
    rows_ids.append(np.arange(k))
    rows_lp.append(np.array([0.0] + [-np.inf] * (k - 1)))
    rows_ids.append(np.arange(k))
    rows_lp.append(np.array([np.log(0.2)] * 5 + [-np.inf] * (k - 5)))
    rows_ids.append(np.arange(k) * 1000)
    rows_lp.append(np.array([-1e-6, -14.0, -15.0, -16.0, -20.0, -30.0, -50.0, -80.0])[:k])
    return np.stack(rows_ids).astype(np.int32), np.stack(rows_lp).astype(np.float32)


def kept_pairs(codec, ids, lps):
    enc = codec.encode(ids, lps)
    return enc, codec.decode(enc)


@pytest.mark.parametrize("precision", ["float32", "float16", "q8"])
def test_round_trip_within_the_declared_bound(precision):
    ids, lps = adversarial_rows()
    codec = TopkCodec(precision)
    enc, decoded = kept_pairs(codec, ids, lps)
    assert enc["counts"].tolist() == [8] * len(ids)  # no mass threshold: every entry kept
    for t, (pid, plp) in enumerate(decoded):
        assert np.all(np.diff(pid) > 0) or len(pid) < 2  # ascending ids
        exact = dict(zip(ids[t].tolist(), lps[t].tolist()))
        assert sorted(pid.tolist()) == sorted(ids[t].tolist())
        for i, v in zip(pid.tolist(), plp.tolist()):
            e = exact[i]
            if precision == "float32":
                assert v == e or (np.isinf(v) and np.isinf(e))
            elif precision == "float16":
                assert (np.isinf(v) and np.isinf(e)) or abs(v - e) <= abs(e) * 2 ** -11 + 2 ** -25  # + float16's subnormal step
            elif e >= -Q8_FLOOR * codec.step:
                assert abs(v - e) <= codec.step / 2 + 1e-6
            else:  # below the range (or -inf): the floor code, whose probability is below e^-15.9
                assert v == -Q8_FLOOR * codec.step
    assert enc["tail"][2] == 0.0 and enc["tail"][1] == pytest.approx(0.5, abs=1e-6)


def test_the_mass_threshold_keeps_the_shortest_prefix():
    ids, lps = adversarial_rows()
    for mass in (0.0, 1e-6, 1e-3, 0.3):
        enc = TopkCodec(mass=mass).encode(ids, lps)
        p = np.exp(lps.astype(np.float64))
        for t, n in enumerate(enc["counts"].tolist()):
            ranked = np.sort(p[t])[::-1]
            residual = 1 - ranked[:n].sum()
            assert 1 <= n <= ids.shape[1]
            assert enc["tail"][t] == pytest.approx(max(residual, 0), abs=1e-6)
            if residual > mass:  # never reached: all k kept
                assert n == ids.shape[1]
            elif n > 1:  # the shortest prefix: one entry fewer would leave more than mass outside
                assert 1 - ranked[: n - 1].sum() > mass
    one = TopkCodec(mass=1e-6).encode(ids, lps)
    assert one["counts"][2] == 1  # all the mass on one token: one entry
    assert TopkCodec(mass=0.5).encode(ids, lps)["counts"][1] == 8  # ties at half the mass: all kept


def test_distortion_is_zero_exactly_when_lossless_and_bounded_otherwise():
    ids, lps = adversarial_rows()
    exact = distortion(TopkCodec(), ids, lps)
    assert exact["max_abs_logprob_error"] == 0 and exact["max_kl"] < 1e-6  # only the float32 tail's rounding
    q8 = distortion(TopkCodec("q8"), ids, lps)
    assert 0 < q8["max_abs_logprob_error"] <= TopkCodec().step / 2 + 1e-6 and q8["max_kl"] < 1e-2
    assert q8["below_range"] == 5  # -16, -20, -30, -50 and -80 lie below -255 / 16 = -15.9375


def test_bad_settings_name_the_fix():
    with pytest.raises(ConfigError, match="--topk-precision must be one of float32, float16, q8"):
        TopkCodec("int4")
    with pytest.raises(ConfigError, match=r"--topk-mass must be in \[0, 1\)"):
        TopkCodec(mass=1.5)
    with pytest.raises(ValueError, match=r"must both be \[T, k\]"):
        TopkCodec().encode(np.zeros((2, 3)), np.zeros((2, 4)))
