"""Tensor-core shape arithmetic (formulas.gemm_quantization): tile and wave quantization."""

from __future__ import annotations

import itertools
import math

import pytest

from labkit import formulas


def test_a_full_wave_wastes_nothing():
    q = formulas.gemm_quantization(256 * 9, 128 * 12)
    assert (q.tiles, q.waves) == (108, 1)
    assert q.tile_efficiency == q.wave_efficiency == q.efficiency == 1.0


def test_one_row_more_adds_a_row_of_tiles_and_a_second_wave():
    q = formulas.gemm_quantization(256 * 9 + 1, 128 * 12)
    assert (q.tiles, q.waves) == (120, 2)  # 10 × 12 tiles, 108 a wave
    assert q.tile_efficiency == pytest.approx((2305 * 1536) / (2560 * 1536))
    assert q.wave_efficiency == pytest.approx(120 / 216)
    assert q.efficiency == pytest.approx(q.tile_efficiency * q.wave_efficiency)


def test_throughput_is_a_saw_tooth_in_m():
    # modelled time ∝ waves: the useful share drops just past each full wave, then recovers
    eff = [formulas.gemm_quantization(m, 1536).efficiency for m in range(2048, 4864, 64)]
    drops = sum(1 for a, b in itertools.pairwise(eff) if b < a - 0.2)
    assert drops >= 1 and max(eff) == 1.0 and min(eff) < 0.7


def test_small_gemms_fill_a_fraction_of_one_wave():
    q = formulas.gemm_quantization(512, 256)  # 2 × 2 tiles on 108 SMs
    assert q.waves == 1 and q.wave_efficiency == pytest.approx(4 / 108)
    assert math.isclose(formulas.gemm_quantization(1, 1, tile_m=1, tile_n=1,
                                                   concurrent=1).efficiency, 1.0)  # fmt: skip


def test_gemm_quantization_refuses_nonsense():
    with pytest.raises(ValueError):
        formulas.gemm_quantization(0, 128)
    with pytest.raises(ValueError):
        formulas.gemm_quantization(128, 128, concurrent=0)
