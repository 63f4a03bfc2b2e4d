"""Notebook 07's capstone: a real data-parallel job that is slower than it should be (or
wrong), with faults planted from a seed, and the measurements that find each one.

    faults     the catalogue (FAULTS), which faults a seed plants at a level (LEVELS) under the
               instructor's key (plan), the answer key (reveal)
    keys       the instructor's key file, the learner's job code (faults sealed), the seal
    attempts   the learner's attempt record: checks counted, the key opened or not
    settings   the job's knobs (Settings): what a code sets wrong, what a learner changes
    job        run_job(faults), given_job(code), new_job(tier), rerun(run, changes): the job
               launched for real
    evidence   Evidence: what the job measured and says about itself, raw, with the tables
               and trace readers to study it
    trials     one_at_a_time(job, found, changes, diagnose): each fix tried on top of those
               kept, re-run for real, kept or dropped by a verdict on the measurement;
               plot_fixes(fixes, prediction): each trial's tokens/s against the prediction
    prediction  predict(nproc, device): one rank's step timed here, the tokens/s it predicts;
                the job against it, Reconcile (fixed job, healthy job, prediction), the summary
    handout    describe_handout(code, ...): the job as notebook 07 hands it out, in words

Importing this package launches nothing.
"""

from __future__ import annotations

from labkit.course.capstone.evidence import Evidence
from labkit.course.capstone.faults import (
    BY_ID,
    DEFAULT_LEVEL,
    FAULTS,
    LEVELS,
    SeedError,
    available,
    describe,
    describe_catalogue,
    describe_left_out,
    new_seed,
    parse_seed,
    plan,
    reveal,
)
from labkit.course.capstone.handout import describe_handout
from labkit.course.capstone.job import (
    EXAMPLE_FAULTS,
    CapstoneRun,
    example_code,
    given_job,
    last_given,
    new_job,
    placement,
    rerun,
    run_job,
    tier_for,
)
from labkit.course.capstone.prediction import (
    Prediction,
    Reconcile,
    describe_summary,
    predict,
)
from labkit.course.capstone.settings import FIXES, Settings, faults_in
from labkit.course.capstone.trials import FixSequence, Trial, one_at_a_time, plot_fixes

__all__ = [
    "BY_ID",
    "DEFAULT_LEVEL",
    "EXAMPLE_FAULTS",
    "FAULTS",
    "FIXES",
    "LEVELS",
    "CapstoneRun",
    "Evidence",
    "FixSequence",
    "Prediction",
    "Reconcile",
    "SeedError",
    "Settings",
    "Trial",
    "available",
    "describe",
    "describe_catalogue",
    "describe_handout",
    "describe_left_out",
    "describe_summary",
    "example_code",
    "faults_in",
    "given_job",
    "last_given",
    "new_job",
    "new_seed",
    "one_at_a_time",
    "parse_seed",
    "placement",
    "plan",
    "plot_fixes",
    "predict",
    "rerun",
    "reveal",
    "run_job",
    "tier_for",
]
