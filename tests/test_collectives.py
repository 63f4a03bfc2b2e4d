"""labkit.workers.collectives: one smoke launch, every collective at every size, NCCL-tests maths."""

from __future__ import annotations

import itertools

import pytest

from labkit import formulas
from labkit.jobs import launch
from labkit.workers import collectives

SIZES = [8, 1024, 65536, 2**20]


def test_default_sizes_are_powers_of_four_from_8_bytes_to_32_mib():
    assert collectives.DEFAULT_SIZES[0] == 8 and collectives.DEFAULT_SIZES[-1] == 32 * 2**20
    sizes = collectives.DEFAULT_SIZES
    assert all(b == 4 * a for a, b in itertools.pairwise(sizes))
    # whole float32 elements, a multiple of the world size, never fewer than one per rank
    assert collectives.element_count(8, 2) == 2
    assert collectives.element_count(8, 4) == 4
    assert collectives.element_count(1000, 3) == 249


@pytest.mark.slow
def test_smoke_launch_reports_every_collective_and_size():
    res = launch.run(
        collectives.CollectivesConfig(sizes=SIZES, repeats=3, warmup=1),
        nproc=2,
        device="cpu",
        stream=False,
        timeout_s=120,
    )
    out = res.rank(0)
    rows = out["rows"]
    assert out["backend"] == "gloo" and "loopback" in out["link"]
    assert [(r["collective"], r["size_bytes"]) for r in rows] == [
        (c, s) for c in collectives.COLLECTIVES for s in SIZES
    ]
    for r in rows:
        assert r["median_s"] > 0
        ratio = r["busbw_GBps"] / r["algbw_GBps"]
        assert ratio == pytest.approx(formulas.bus_bandwidth_factor(r["collective"], 2))
        assert r["algbw_GBps"] == pytest.approx(r["size_bytes"] / r["median_s"] / 1e9)
        assert r["emulated"] == (r["collective"] == "reduce_scatter")  # gloo: all-reduce inside
        assert "loopback" in r["link"]
    for c in collectives.COLLECTIVES:
        sizes = [r["size_bytes"] for r in rows if r["collective"] == c]
        assert sizes == sorted(sizes)
    assert res.rank(1)["rows"] == []  # rank 0 reports for the job
