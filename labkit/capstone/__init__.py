"""Notebook 07's capstone: a real data-parallel job that is slower than it should be (or
wrong), with faults planted from a seed, and the measurements that find each one.

    faults     the catalogue (FAULTS), which faults a seed plants (plan), the answer key (reveal)
    job        run_job(faults): the job launched for real, and its evidence

Importing this package launches nothing.
"""

from __future__ import annotations

from labkit.capstone.faults import (
    BY_ID,
    FAULTS,
    PLANTED,
    Fault,
    SeedError,
    available,
    new_seed,
    parse_seed,
    plan,
    reveal,
)
from labkit.capstone.job import CapstoneRun, run_job

__all__ = [
    "BY_ID",
    "FAULTS",
    "PLANTED",
    "CapstoneRun",
    "Fault",
    "SeedError",
    "available",
    "new_seed",
    "parse_seed",
    "plan",
    "reveal",
    "run_job",
]
