"""Multi-GPU training for the data scientist's models (notebook 08): Dask workers, XGBoost
across them, and the GPU stack (RAPIDS) where there are GPUs.

Its modules:

    cluster   a Dask cluster of worker processes in a ``with`` block: no process outlives it,
              a dead worker or a taken port reported with the fix
    data      a seeded synthetic data set with a known structure, generated on the workers
    training  XGBoost across workers, timed per round, with the bytes each round puts on the
              wire, predicted (bins read from the matrix) and counted on ``lo``
    scaling   one worker against two: whole calls and rounds, the two-worker round predicted,
              a verdict for each; a cluster of one worker says why it cannot compare
    memory    DMatrix against QuantileDMatrix: bytes predicted, resident memory measured in a
              fresh process
    gpu       the GPU tier's code paths: LocalCUDACluster, the RMM pool, UCX, cuML, MIG's limits

Importing this package imports none of Dask or XGBoost: each module loads on first use
(``from labkit.tabular import cluster``, or ``tabular.cluster`` after ``from labkit import
tabular``).
"""

import importlib

SUBMODULES = ("cluster", "data", "gpu", "memory", "scaling", "training")


def __getattr__(name: str):
    if name in SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
