"""The collective-fault job's typed config and the collectives each rank plans: no torch.

Apart from :mod:`labkit.workers.collective_faults` (which imports torch) so that
:mod:`labkit.collective_debug`, on a lower layer than the workers, can build a trial's config
and predict where the ranks part without importing the worker.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from labkit import validate
from labkit.jobs.spec import WorkerConfig

FAULTS = ("none", "desync", "shape", "hang")
"""The bugs the worker plants (its module docstring says what each does)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class CollectiveFaultsConfig(WorkerConfig):
    """One planted collective bug in a 2-rank job."""

    WORKER: ClassVar[str] = "labkit.workers.collective_faults"
    fault: str = "none"
    """One of FAULTS; "none" runs the healthy job, for comparison."""
    steps: int = 3
    """Training-like steps, each an all-reduce of the gradients and an all-gather of the loss."""
    fault_step: int = 2
    """The step at which the bug strikes (1-based, at most ``steps``)."""
    fault_rank: int = 1
    """The rank that misbehaves; the others run the healthy program."""
    numel: int = 1024
    """float32 values in each step's gradient all-reduce."""

    def __post_init__(self) -> None:
        super().__post_init__()
        validate.one_of("fault", self.fault, FAULTS)
        validate.whole("steps", self.steps, low=1)
        validate.whole("fault_step", self.fault_step, low=1, high=self.steps,
                       why="the step the bug strikes at: at most steps, or it never happens")  # fmt: skip
        validate.whole("fault_rank", self.fault_rank, low=0)
        validate.whole("numel", self.numel, low=1)

    def check_ranks(self, world_size: int) -> None:
        """Refuse a job of ``world_size`` ranks this config cannot plant its bug in."""
        validate.whole("nproc", world_size, low=2, why="a collective bug needs two ranks")
        validate.whole("fault_rank", self.fault_rank, high=world_size - 1,
                       why=f"only ranks 0..{world_size - 1} exist: use fault_rank < nproc")  # fmt: skip


def planned(config: CollectiveFaultsConfig | Mapping[str, Any], rank: int) -> list[str]:
    """The collectives ``rank`` will issue, in order: "step 2: all_reduce [1024]". ``config`` may
    be the fields as a dict (a notebook's)."""
    cfg = config if isinstance(config, CollectiveFaultsConfig) else CollectiveFaultsConfig.from_dict(dict(config))
    plan = []
    for step in range(1, cfg.steps + 1):
        here = rank == cfg.fault_rank and step == cfg.fault_step
        if here and cfg.fault == "hang":
            plan.append(f"step {step}: (sleeps, outside any collective)")
            break
        if not (here and cfg.fault == "desync"):
            n = cfg.numel + (1 if here and cfg.fault == "shape" else 0)
            plan.append(f"step {step}: all_reduce [{n}]")
        plan.append(f"step {step}: all_gather [1]")
    return plan
