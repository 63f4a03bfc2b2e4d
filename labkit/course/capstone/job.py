"""Run the capstone job with a set of faults, and read the evidence the notebooks teach.

    from labkit.course import capstone
    job = capstone.given_job(code)                         # the learner's slow job (a job code)
    print(job.evidence_text())
    fixed = capstone.rerun(job, {"prepare_data": "once"})  # one change of its settings
    fixed.tokens_per_s / job.tokens_per_s                  # the speedup, measured

Every number here is measured in the run (:class:`labkit.course.capstone.evidence.Evidence`): tokens/s
from the median step (the first left out), per-rank phase times step by step, all-reduce calls
and bytes per micro-batch counted by a DDP communication hook, losses, gradient norms, memory,
a profiler trace per rank, the processes' threads, environment and runtime flags, the loader's,
optimizer's and model's facts, and the sample indices each rank trained on.

What the learner holds of a given job (:func:`given_job`) is its measurements and its job code,
never its faults or settings: the run object's ``faults`` and ``settings`` are empty, this module
keeps no copy of them, and the launcher's job spec holds the worker's settings sealed
(:mod:`labkit.course.capstone.keys`). A re-run (:func:`rerun`) opens the code's seal to plant the same
faults again under the learner's changes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from labkit.course.capstone import attempts, keys
from labkit.course.capstone import settings as st
from labkit.course.capstone.evidence import Evidence, median
from labkit.course.capstone.faults import BY_ID, DEFAULT_LEVEL, new_seed, plan
from labkit.workers.capstone_config import CapstoneConfig

MODULE = CapstoneConfig.WORKER
SIZES: dict[str, dict[str, Any]] = {
    "smoke": {"steps": 8, "epoch_steps": 4, "loader_passes": 200},
    "lab": {"steps": 16, "epoch_steps": 4, "loader_passes": 200},
}


@dataclass
class CapstoneRun:
    """One run of the job: its faults and every rank's report."""

    faults: tuple[str, ...]
    ranks: list[dict[str, Any]]
    wall_s: float
    settings: st.Settings | None = field(default_factory=st.Settings)
    """What the job ran with; None in the learner's view (:meth:`public`), as are ``faults``:
    either would name the faults."""
    tier: str = "cpu"
    size: str = "smoke"
    seed: int | None = None
    """The seed whose job this is (:func:`given_job`), or None for a job built from faults.
    It says nothing about the faults without the instructor's key."""
    code: str | None = None
    """The job code it was given by (faults sealed; :mod:`labkit.course.capstone.keys`), or None."""

    def __repr__(self) -> str:
        whose = f"seed {self.seed}" if self.seed is not None else f"{len(self.faults)} faults"
        return (f"CapstoneRun({whose}, {self.tier} tier, size {self.size!r}: "
                f"{self.tokens_per_s:,.0f} tokens/s measured)")

    def public(self) -> CapstoneRun:
        """This run as the learner sees it: its measurements (and job code), not its faults or
        settings."""
        return dataclasses.replace(self, faults=(), settings=None)

    @property
    def tokens_per_s(self) -> float:
        """Tokens per second of the whole job (:attr:`Evidence.tokens_per_s`)."""
        return self.evidence().tokens_per_s

    @property
    def losses(self) -> list[float]:
        return self.evidence().losses

    def phase(self, name: str) -> list[float]:
        """Each rank's median seconds per step in ``name`` (data, forward, backward, optimizer,
        step, other), the warm-up step left out."""
        return [median(ms) / 1e3 for ms in self.evidence().phase_ms(name)]

    def evidence(self) -> Evidence:
        """Everything the job measured and says about itself (:class:`Evidence`): no field
        named after a fault, no threshold."""
        return Evidence(self.tier, self.ranks)

    def evidence_text(self) -> str:
        return self.evidence().report()


def tier_for(device: str, nproc: int) -> str:
    """The tier a job of ``nproc`` ranks on ``device`` runs in (its faults depend on it)."""
    return "cpu" if device == "cpu" else ("multi-gpu" if nproc > 1 else "single-gpu")


def placement(nproc: int = 2, gpus: int | None = None) -> tuple[str, str]:
    """(device, tier) of notebook 07's job: a GPU for every one of its ``nproc`` ranks, or CPU
    ranks over gloo (one GPU cannot hold two NCCL ranks). ``gpus``: the visible GPU count,
    asked of torch when None (without creating a CUDA context)."""
    if gpus is None:
        from labkit.jobs import launch

        gpus = launch.visible_gpu_count()
    device = "cuda" if gpus >= nproc else "cpu"
    return device, tier_for(device, nproc)


def run_job(faults: Sequence[str] = (), *, settings: st.Settings | None = None,
            size: str = "smoke", nproc: int = 2, device: str = "cpu", timeout_s: float = 180.0,
            stream: bool = False, observers: Sequence[Any] = (),
            **overrides: Any) -> CapstoneRun:  # fmt: skip
    """Run the capstone job with ``faults`` planted (ids of :data:`labkit.course.capstone.FAULTS`), or
    with ``settings`` (:class:`labkit.course.capstone.Settings`) when given."""
    from labkit.jobs import launch

    unknown = sorted(set(faults) - set(BY_ID))
    if unknown:
        raise ValueError(f"faults={unknown}: unknown; the catalogue holds {sorted(BY_ID)}")
    if size not in SIZES:
        raise ValueError(f"size={size!r} is not allowed: one of {sorted(SIZES)}")
    cores, tier = launch.usable_cpus(), tier_for(device, nproc)
    if settings is None:
        settings = st.given(faults, cores=cores)
    # The worker's settings travel sealed: the job spec the launcher writes where the learner
    # can read it (labkit_home()/runs) names no fault and no setting in plain form.
    config = CapstoneConfig.sealing(st.worker_config(settings, tier=tier, cores=cores, nproc=nproc),
                                    **SIZES[size], **overrides)  # fmt: skip
    res = launch.run(config, nproc=nproc, device=device, timeout_s=timeout_s,
                     stream=stream, observers=list(observers), oversubscribe=False,
                     env=st.worker_env(settings, tier=tier) or None)  # fmt: skip
    present = st.faults_in(settings, tier=tier, cores=cores, nproc=nproc)
    return CapstoneRun(present, res.ranks, res.wall_s, settings=settings, tier=tier, size=size)


EXAMPLE_FAULTS = ("slow_loader", "straggler", "no_set_epoch")
"""The test suite's job (seed 10's of old): a loader, a straggler and a sampler fault."""
_LAST: list[CapstoneRun] = []


def new_job(tier: str, level: str = DEFAULT_LEVEL) -> str:
    """A fresh job code for ``tier`` at difficulty ``level``, for a learner without an
    instructor: a new seed, its faults drawn under a one-off key that is never stored, so only
    the code's seal holds them (``python -m labkit capstone reveal --give-up`` opens it, and
    says so in the record)."""
    seed = new_seed()
    return keys.code_for(plan(seed, tier, keys.one_off(), level), tier, seed)


def example_code(tier: str | None = None) -> str:
    """The job code of :data:`EXAMPLE_FAULTS` (seed 10) on ``tier`` (default: this machine's):
    the job the tests and ``labkit timings`` run, the same every time."""
    return keys.code_for(EXAMPLE_FAULTS, tier or placement()[1], 10)


def given_job(code: str, *, size: str = "smoke", device: str = "cpu", nproc: int = 2,
              **kwargs: Any) -> CapstoneRun:  # fmt: skip
    """Run the job of job code ``code`` (:mod:`labkit.course.capstone.keys`: the instructor's, from
    ``python -m labkit capstone new``, or :func:`new_job`'s) on the tier it runs on, and return
    the learner's view of it (:meth:`CapstoneRun.public`): measurements and the code, never
    its faults or settings. A code for another tier, another course version, or mistyped is
    refused with what to do."""
    tier = tier_for(device, nproc)
    job_code = keys.read_code(code, tier)
    run = run_job(job_code.open(), size=size, device=device, nproc=nproc, **kwargs).public()
    run.seed, run.code = job_code.seed, job_code.text
    attempts.started(job_code.text)
    _LAST[:] = [run]
    return run


def last_given() -> CapstoneRun | None:
    """The learner's view of the job :func:`given_job` ran last in this process (no faults,
    no settings), or None."""
    return _LAST[0] if _LAST else None


def settings_after(run: CapstoneRun, changes: Mapping[str, Any]) -> st.Settings:
    """The settings ``run``'s job runs with after ``changes``: its own when it shows them,
    else the ones its job code plants (the check's, never shown to the learner)."""
    if run.settings is not None:
        return st.apply(run.settings, changes)
    if run.code is None:
        raise ValueError("this run's settings are hidden and it has no job code: re-run a job "
                         "that capstone.given_job(code) returned")  # fmt: skip
    from labkit.jobs import launch

    planted = keys.read_code(run.code, run.tier).open()
    return st.apply(st.given(planted, cores=launch.usable_cpus()), changes)


def rerun(run: CapstoneRun, changes: Mapping[str, Any], **kwargs: Any) -> CapstoneRun:
    """``run``'s job again, with ``changes`` (setting → value) applied to its settings. A
    learner's view in (settings hidden), a learner's view out, and the changes then apply to
    the settings the job code gave, so pass every change you keep, not only the newest."""
    hidden = run.settings is None
    device = "cpu" if run.tier == "cpu" else "cuda"
    nproc = run.ranks[0]["world_size"]
    new = run_job(settings=settings_after(run, changes), size=run.size, device=device,
                  nproc=nproc, **kwargs)  # fmt: skip
    new.seed, new.code = run.seed, run.code
    return new.public() if hidden else new
