"""A synthetic regression data set with a known structure, generated on the workers.

    data = synthetic(rows=200_000, features=16, seed=0)
    X, y = place(workers.client, data, workers.addresses)   # partition i on worker i mod n

The target is ``y = 2·x0 + sin(3·x1) + x2·x3 + noise`` (each x standard normal, noise
``noise_sd`` × standard normal): a linear term, a non-linear one and an interaction, which trees
of depth 2 or more can represent; the other features are noise. A model that learnt the
structure ranks features 0 to 3 first (:func:`informative`), and its error on fresh rows
approaches ``noise_sd``.

Each partition is generated from the seed and its own index, on the worker that will hold it:
the same rows whatever the number of workers (so one worker and two train on the same data), and
nothing travels from the notebook to the workers but a few numbers (building the arrays here and
sending them is the anti-pattern Dask's "Load data with Dask" best practice warns against:
https://docs.dask.org/en/stable/best-practices.html#load-data-with-dask).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from labkit.errors import LabkitError
from labkit.hardware.host import host_memory_available
from labkit.validate import number, whole

INFORMATIVE = (0, 1, 2, 3)
"""The features the target depends on."""
SIZES = {"smoke": 40_000, "lab": 400_000, "gpu": 4_000_000}
"""Rows per preset: a few seconds of training at smoke size, about a minute of the notebook at lab
size on two cores; the gpu size is for a GPU machine, where the data must be large to matter."""
HEADROOM = 4.0
"""A worker holds its partitions, the quantised copy, gradients and Dask's buffers: refuse a
data set unless the machine has this many times its raw bytes available."""


class DataTooLarge(LabkitError, MemoryError):
    """The data set would not fit in this machine's memory; the message says what would."""


@dataclass(frozen=True)
class Synthetic:
    """The data set's shape and seed; the rows are made by :meth:`partition`, on demand."""

    rows: int
    features: int = 16
    seed: int = 0
    partitions: int = 4
    noise_sd: float = 0.1

    def __post_init__(self) -> None:
        whole("rows", self.rows, low=self.partitions)
        whole("features", self.features, low=len(INFORMATIVE))
        whole("partitions", self.partitions, low=1)
        number("noise_sd", self.noise_sd, low=0)

    @property
    def nbytes(self) -> int:
        """float32 features and target: the raw bytes the workers hold together."""
        return self.rows * (self.features + 1) * 4

    def partition_rows(self, i: int) -> int:
        base, extra = divmod(self.rows, self.partitions)
        return base + (1 if i < extra else 0)

    def partition(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Partition ``i``: (X float32 rows × features, y float32), from (seed, i) alone."""
        rng = np.random.default_rng([self.seed, i])
        x = rng.standard_normal((self.partition_rows(i), self.features), dtype=np.float32)
        y = target(x) + self.noise_sd * rng.standard_normal(len(x), dtype=np.float32)
        return x, y.astype(np.float32)

    def describe(self) -> str:
        return (f"synthetic regression: {self.rows:,} rows × {self.features} features "
                f"(float32, {self.nbytes / 2**20:.1f} MiB), {self.partitions} partitions, seed "
                f"{self.seed}; y = 2·x0 + sin(3·x1) + x2·x3 + {self.noise_sd:g}·noise")


def target(x: np.ndarray) -> np.ndarray:
    """The noise-free target of rows ``x``: the known structure."""
    return (2 * x[:, 0] + np.sin(3 * x[:, 1]) + x[:, 2] * x[:, 3]).astype(np.float32)


def synthetic(rows: int, features: int = 16, *, seed: int = 0, partitions: int = 4,
              available_bytes: int | None = None) -> Synthetic:
    """The data set, after checking it fits: :class:`DataTooLarge` if its raw bytes times
    :data:`HEADROOM` exceed the memory available (``available_bytes``, else this machine's)."""
    data = Synthetic(rows=rows, features=features, seed=seed, partitions=partitions)
    available = host_memory_available()[0] if available_bytes is None else available_bytes
    if data.nbytes * HEADROOM > available:
        fits = int(available / HEADROOM / ((features + 1) * 4))
        raise DataTooLarge(
            f"rows={rows:,} × features={features} is {data.nbytes / 2**30:.2f} GiB of float32, and "
            f"training needs about {HEADROOM:g}× that, more than the {available / 2**30:.2f} GiB "
            f"available here: use rows={fits:,} or fewer, or a machine (or cluster) with more "
            "memory")
    return data


def place(client: Any, data: Synthetic, addresses: list[str]) -> tuple[Any, Any]:
    """Dask arrays (X, y) whose partition ``i`` is generated on, and held by,
    ``addresses[i % len(addresses)]``."""
    import dask.array as da
    from distributed import wait

    if not addresses:
        raise ValueError("addresses=[] is not allowed: give at least one worker's address")
    parts = [client.submit(data.partition, i, workers=[addresses[i % len(addresses)]],
                           pure=False)
             for i in range(data.partitions)]  # fmt: skip
    xs = [client.submit(_first, p, workers=[addresses[i % len(addresses)]], pure=False)
          for i, p in enumerate(parts)]  # fmt: skip
    ys = [client.submit(_second, p, workers=[addresses[i % len(addresses)]], pure=False)
          for i, p in enumerate(parts)]  # fmt: skip
    wait(xs + ys)
    del parts  # the (X, y) tuples: each half is held on its own now
    x = da.concatenate([da.from_delayed(f, shape=(data.partition_rows(i), data.features),
                                        dtype=np.float32) for i, f in enumerate(xs)])  # fmt: skip
    y = da.concatenate([da.from_delayed(f, shape=(data.partition_rows(i),), dtype=np.float32)
                        for i, f in enumerate(ys)])  # fmt: skip
    return x, y


def _first(pair: tuple[Any, Any]) -> Any:
    return pair[0]


def _second(pair: tuple[Any, Any]) -> Any:
    return pair[1]


def informative(importance: dict[str, float], k: int = len(INFORMATIVE)) -> bool:
    """True when the ``k`` most important features (XGBoost's ``get_score`` names, "f0"…)
    are exactly the informative ones."""
    top = sorted(importance, key=importance.__getitem__, reverse=True)[:k]
    return {int(name.lstrip("f")) for name in top} == set(INFORMATIVE[:k])
