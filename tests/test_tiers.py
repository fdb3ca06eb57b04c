"""gsm.tiers: the tier counts every engine ranks by, row widths, the v1/v2 fraction forms."""

from __future__ import annotations

import math

import pytest

from gsm import tiers
from gsm.config import ConfigError, KVQuantConfig


def _reference_counts(fractions, n):
    """The decisions' rule written out plainly (independent of the library's cumulative form)."""
    f = list(fractions) + [0.0] * (4 - len(fractions))
    n16 = math.floor(f[0] * n + 1e-9)
    n12 = math.floor((f[0] + f[1]) * n + 1e-9) - n16
    if f[3] == 0:
        return n16, n12, n - n16 - n12, 0
    n8 = math.floor((f[0] + f[1] + f[2]) * n + 1e-9) - n16 - n12
    return n16, n12, n8, n - n16 - n12 - n8


@pytest.mark.parametrize("fractions", [(0.25, 0.25, 0.5), (0.1, 0.2, 0.7), (0.0, 0.0, 0.25, 0.75),
                                       (0.125, 0.125, 0.25, 0.5), (1.0, 0.0, 0.0, 0.0), (0.0, 0.0, 0.0, 1.0)])
@pytest.mark.parametrize("n", [0, 1, 7, 100, 4093])
def test_tier_counts(fractions, n):
    got = tiers.tier_counts(fractions, n)
    assert got == _reference_counts(fractions, n)
    assert sum(got) == n and min(got) >= 0


def test_v1_fractions_never_make_int4_rows():
    # these sum to 0.9999999999999999 in float: a floor of the cumulative INT8 bound would leave INT4 rows
    f = (0.7, 0.2, 0.1)
    assert sum(f) < 1.0
    for n in range(1, 3000):
        assert tiers.tier_counts(f, n)[3] == 0
        assert tiers.tier_counts((*f, 0.0), n)[3] == 0


def test_row_bytes_and_avg_bytes():
    assert tiers.row_bytes(5, 3) == (16, 15, 8, 5)  # W4 = ceil(5/2) + ceil(3/2)
    assert tiers.row_bytes(1, 1) == (6, 6, 2, 2)  # padded INT12 row longer than 2r: W16 holds it
    for rk in range(1, 9):
        for rv in range(1, 9):
            w = tiers.row_bytes(rk, rv)
            assert w[0] >= w[1] and w[0] >= w[2] >= w[3]  # a wider region holds any narrower row
    assert tiers.avg_bytes((0.25, 0.25, 0.5)) == pytest.approx(1.375)
    assert tiers.avg_bytes((0.0, 0.0, 0.25, 0.75)) == pytest.approx(0.625)


def test_quant_config_forms():
    v1 = KVQuantConfig()
    assert not v1.uses_int4 and v1.fractions4 == (0.25, 0.25, 0.5, 0.0) and v1.is_gsm
    v2 = v1.with_fractions((0.0, 0.0, 0.5, 0.5))
    assert v2.uses_int4 and tuple(v2.bit_widths) == (16, 12, 8, 4) and v2.is_gsm
    assert KVQuantConfig.from_json(v2.to_json()) == v2
    assert v1.to_json()["kv_quantization"]["tier_fractions"] == [0.25, 0.25, 0.5]  # v1 stays three numbers
    with pytest.raises(ConfigError, match="bit_widths"):
        KVQuantConfig(tier_fractions=(0.0, 0.0, 0.5, 0.5))  # INT4 rows without the 4 in bit_widths
    with pytest.raises(ConfigError, match="three .* or four"):
        KVQuantConfig(tier_fractions=(0.5, 0.5))
