"""Notebook 07's capstone: a real data-parallel job that is slower than it should be (or
wrong), with faults planted from a seed, and the measurements that find each one.

    faults     the catalogue (FAULTS), which faults a seed plants (plan), the answer key (reveal)
    settings   the job's knobs (Settings): what a seed sets wrong, what a learner changes
    job        run_job(faults), given_job(seed), rerun(run, changes): the job launched for
               real, and its evidence

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
from labkit.capstone.job import (
    CapstoneRun,
    given_job,
    last_given,
    placement,
    rerun,
    run_job,
    tier_for,
)
from labkit.capstone.settings import FIXES, Settings, faults_in

__all__ = [
    "BY_ID",
    "FAULTS",
    "FIXES",
    "PLANTED",
    "CapstoneRun",
    "Fault",
    "SeedError",
    "Settings",
    "available",
    "faults_in",
    "given_job",
    "last_given",
    "new_seed",
    "parse_seed",
    "placement",
    "plan",
    "rerun",
    "reveal",
    "run_job",
    "tier_for",
]
