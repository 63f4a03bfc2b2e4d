"""DMatrix against QuantileDMatrix on the CPU: the bytes each holds, predicted, and measured in a
fresh process. (On a GPU the quantised copy is one ELLPACK page in device memory:
:func:`labkit.formulas.boosting.ellpack_bytes` predicts it, and nothing here measures it.)

    reading = matrix_memory(rows=400_000, features=16, max_bin=64)
    print(reading.describe())

**Why resident memory (RSS), not tracemalloc.** XGBoost allocates its matrices in C++ (``malloc``
and ``new`` inside ``libxgboost.so``); ``tracemalloc`` traces only the allocations that go through
Python's own allocator (https://docs.python.org/3/library/tracemalloc.html: "trace memory blocks
allocated by Python"), so it would see almost none of them. The operating system's count of the
process's resident pages sees every byte the process touched, whoever allocated it.

**Why a fresh process.** RSS counts pages, not objects: memory freed earlier in the same process
can be handed out again without RSS growing, and a kernel that already imported and trained has
plenty. Each matrix is therefore built in its own new Python process
(``python -m labkit.tabular.memory``), which generates the rows, reads its RSS, builds the matrix,
reads it again, trains one round (when a DMatrix builds its quantised copy) and reads it a third
time. The difference between the two matrices after that round cancels what both hold alike
(gradients, predictions, the row partition): it is the DMatrix's stored values, predicted by
:func:`labkit.formulas.boosting.dmatrix_bytes`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

from labkit.formulas import boosting
from labkit.validate import one_of, whole

KINDS = ("DMatrix", "QuantileDMatrix")
TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Probe:
    """One fresh process's resident memory (bytes) around building one matrix."""

    kind: str
    baseline: int
    built: int
    trained: int

    @property
    def after_build(self) -> int:
        return self.built - self.baseline

    @property
    def after_round(self) -> int:
        return self.trained - self.baseline


def probe(kind: str, rows: int, features: int, max_bin: int, *, seed: int = 0) -> Probe:
    """Build one ``kind`` of matrix in a new Python process and read its RSS (psutil)."""
    one_of("kind", kind, KINDS)
    args = [sys.executable, "-m", "labkit.tabular.memory", kind, str(rows), str(features),
            str(max_bin), str(seed)]  # fmt: skip
    done = subprocess.run(args, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the memory probe for {kind} failed (exit {done.returncode}): "
                           f"{done.stderr.strip()[-600:]}")  # fmt: skip
    return Probe(kind=kind, **json.loads(done.stdout.strip().splitlines()[-1]))


@dataclass(frozen=True)
class MemoryReading:
    """Both matrices: predicted bytes beside measured RSS growth."""

    rows: int
    features: int
    max_bin: int
    probes: dict[str, Probe]

    @property
    def predicted(self) -> dict[str, int]:
        """Bytes once ``hist`` trained: a DMatrix holds its values and the quantised copy."""
        quantised = boosting.quantised_bytes(self.rows, self.features, self.max_bin)
        return {"DMatrix": boosting.dmatrix_bytes(self.rows, self.features) + quantised,
                "QuantileDMatrix": quantised}

    @property
    def predicted_saving(self) -> int:
        return boosting.dmatrix_bytes(self.rows, self.features)

    @property
    def measured_saving(self) -> int:
        return self.probes["DMatrix"].after_round - self.probes["QuantileDMatrix"].after_round

    def sentence(self) -> str:
        ratio = self.measured_saving / self.predicted_saving
        if abs(ratio - 1) <= 0.15:
            return (f"the saving measured is {ratio:.0%} of the predicted one: a QuantileDMatrix "
                    "saves the stored values, as predicted (within 15%: RSS counts whole pages "
                    "and what the allocator keeps)")
        return (f"the saving measured is {ratio:.0%} of the predicted one, more than 15% off: "
                "the allocator kept or returned memory the prediction does not model; the "
                "per-matrix rows say where")

    def describe(self) -> str:
        mib = 2**20
        lines = [f"{self.rows:,} rows × {self.features} features, max_bin={self.max_bin} "
                 f"(the raw float32 values: {self.rows * self.features * 4 / mib:.1f} MiB)",
                 f"{'':<16} {'predicted':>10} {'RSS built':>10} {'RSS 1 round':>12}  (MiB)"]
        for kind in KINDS:
            p = self.probes[kind]
            lines.append(f"{kind:<16} {self.predicted[kind] / mib:>10.1f} "
                         f"{p.after_build / mib:>10.1f} {p.after_round / mib:>12.1f}")
        lines.append(f"DMatrix - QuantileDMatrix after a round: predicted "
                     f"{self.predicted_saving / mib:.1f} MiB, measured {self.measured_saving / mib:.1f} MiB")
        lines.append(self.sentence())
        lines.append(f"on a GPU (device='cuda') the quantised copy is one ELLPACK page of "
                     f"{boosting.ellpack_bytes(self.rows, self.features, self.max_bin) / mib:.1f} "
                     "MiB of device memory (predicted; this probe reads host RSS and does not "
                     "measure it)")
        return "\n".join(lines)


def matrix_memory(rows: int, features: int, max_bin: int, *, seed: int = 0) -> MemoryReading:
    """Measure both matrices, one fresh process each."""
    whole("rows", rows, low=1)
    whole("features", features, low=1)
    return MemoryReading(rows=rows, features=features, max_bin=max_bin,
                         probes={k: probe(k, rows, features, max_bin, seed=seed) for k in KINDS})


def main(argv: list[str]) -> None:
    """The probe itself: ``python -m labkit.tabular.memory KIND ROWS FEATURES MAX_BIN SEED``."""
    import gc

    import numpy as np
    import psutil
    import xgboost

    kind, rows, features, max_bin, seed = argv[0], *map(int, argv[1:5])
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, features), dtype=np.float32)
    y = x[:, 0].copy()
    me = psutil.Process()
    gc.collect()
    baseline = me.memory_info().rss
    matrix: Any = (xgboost.QuantileDMatrix(x, y, max_bin=max_bin) if kind == "QuantileDMatrix"
                   else xgboost.DMatrix(x, y))  # fmt: skip
    built = me.memory_info().rss
    xgboost.train({"tree_method": "hist", "max_bin": max_bin, "nthread": 1, "max_depth": 2},
                  matrix, num_boost_round=1)  # fmt: skip
    trained = me.memory_info().rss
    print(json.dumps({"baseline": baseline, "built": built, "trained": trained}))


if __name__ == "__main__":
    main(sys.argv[1:])
