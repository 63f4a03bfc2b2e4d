"""The capstone's fault catalogue, and which faults a seed plants.

The capstone job (:mod:`labkit.capstone.job`) is a real data-parallel training run that is
slower than it should be, or wrong. Each :class:`Fault` below is one real cause, planted by a
switch of the worker (:mod:`labkit.workers.capstone_train`) and removed by its fix; each is
visible with the tools of notebooks 00–06 (``evidence``). A seed and the instructor's key
(:func:`plan`, :mod:`labkit.capstone.keys`) pick which faults a learner's job carries, so an
instructor can hand every learner their own job and keep the answer key
(``python -m labkit capstone reveal --seed N``, which needs the key file); the seed alone says
nothing.

Tiers: two faults have no signature on a CPU (a CPU has no launch queue for a host sync to
drain, and no bf16 tensor cores for fp32 to leave idle): on the CPU tier a seed draws only
from the faults a CPU can show, and the notebook says which ones it left out and why.

Sources for the symptoms and fixes: PyTorch's performance tuning guide
(https://docs.pytorch.org/tutorials/recipes/recipes/tuning_guide.html: data loading workers,
avoiding CPU-GPU syncs, mixed precision, no_sync under accumulation); the
``DistributedSampler`` docs (``set_epoch`` "to make shuffling work properly across multiple
epochs", https://docs.pytorch.org/docs/stable/data.html#torch.utils.data.distributed.DistributedSampler);
torchrun's default of ``OMP_NUM_THREADS=1`` per worker ("to avoid your system being
overloaded", torch/distributed/run.py).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from labkit.capstone.keys import Key

TIERS = ("cpu", "single-gpu", "multi-gpu")


@dataclass(frozen=True)
class Fault:
    """One planted cause of a slow (or wrong) job."""

    id: str
    title: str
    symptom: str
    """What a learner sees first."""
    evidence: str
    """The measurement that proves it (and the notebook that taught it)."""
    fix: str
    kind: str
    """"speed" (the job is slower than it must be) or "correctness" (its result is wrong)."""
    needs_gpu: bool = False
    """True: no signature on a CPU, so a CPU-tier seed never plants it."""
    group: str = ""
    """Faults of one group are alternatives: a seed plants at most one of them."""
    why_not_on_cpu: str = ""


FAULTS: tuple[Fault, ...] = (
    Fault(
        "slow_loader", "data loading on the critical path",
        "low device utilisation; every step starts with a wait",
        "the share of each iteration spent waiting for the next batch (notebook 06's data "
        "phase): well above the few per cent a prepared dataset costs",
        "take the work out of __getitem__: tokenise once, ahead of training (or, with cores "
        "to spare, DataLoader workers)", "speed",
    ),
    Fault(
        "tiny_micro_batch", "a micro-batch far below what fits",
        "low FLOP/s; memory nearly empty",
        "the micro-batch and its accumulation steps; notebook 05's sweep: tokens/s still "
        "rising at that batch, memory far below the limit",
        "raise the micro-batch and lower the accumulation by the same factor (the same global "
        "batch, so the same training)", "speed",
    ),
    Fault(
        "sync_every_micro_batch", "an all-reduce for every micro-batch",
        "communication time grows with the accumulation steps",
        "all-reduces issued before a step's last micro-batch: none with no_sync, DDP's "
        "buckets for each earlier micro-batch without it (notebook 02's counted calls)",
        "enter DDP's no_sync() for every micro-batch but the last", "speed",
    ),
    Fault(
        "straggler", "a straggler rank",
        "every rank is as slow as one of them",
        "per-rank phase times: one rank's compute is long, the others wait in the all-reduce "
        "of backward (notebook 06's per-rank traces)",
        "find the slow rank's cause and remove it (here: the planted delay on that rank)",
        "speed",
    ),
    Fault(
        "oversubscribed_threads", "more compute threads than cores",
        "per-step time erratic and long; the machine looks fully busy",
        "threads per rank × ranks > cores (torch.get_num_threads() in each rank, "
        "hardware.cpu_info())",
        "no more threads in all than cores: each rank its share (OMP_NUM_THREADS, "
        "torch.set_num_threads; torchrun's own default is 1 per worker)", "speed",
    ),
    Fault(
        "no_sampler", "no DistributedSampler: every rank trains on the same data",
        "nothing looks slow: the job is wrong, not slow",
        "the sample indices each rank saw: the ranks overlap 100% (notebook 02's sampler "
        "section)", "a DistributedSampler, with set_epoch(epoch) every epoch",
        "correctness", group="sampler",
    ),
    Fault(
        "no_set_epoch", "DistributedSampler without set_epoch",
        "nothing looks slow: every epoch repeats the first one's order",
        "the sample indices of epoch 2 equal those of epoch 1 on every rank",
        "call sampler.set_epoch(epoch) at the start of every epoch", "correctness",
        group="sampler",
    ),
    Fault(
        "fp32_on_gpu", "full fp32 where bf16 is safe",
        "MFU far below what the GPU's bf16 tensor cores allow",
        "the step's dtype; notebook 04's speed per precision",
        "bf16 autocast (fp32 weights, bf16 matmuls)", "speed", needs_gpu=True,
        why_not_on_cpu="a CPU without bf16 matrix units runs bf16 slower than fp32 "
                       "(notebook 04 measured it), so fp32 is the right choice there",
    ),
    Fault(
        "host_sync", "a host sync every micro-batch",
        "GPU idle gaps between kernels; the CPU cannot run ahead",
        "gaps in the GPU timeline after each .item(); notebook 06's sync bottleneck",
        "read the loss once per logging interval, not every micro-batch", "speed",
        needs_gpu=True,
        why_not_on_cpu="a CPU runs each operator as Python calls it, so there is no queue "
                       "for .item() to drain (notebook 06 measured no effect)",
    ),
)
BY_ID = {f.id: f for f in FAULTS}
PLANTED = 3  # faults per job


class SeedError(ValueError):
    """A seed the capstone cannot use; the message says what a seed looks like."""


def parse_seed(seed: int | str) -> int:
    """A seed as an int: a whole number 0..2**31-1, given as an int or its decimal digits."""
    if isinstance(seed, bool):
        raise SeedError(f"seed={seed!r} is not allowed: a whole number from 0 to {2**31 - 1}")
    if isinstance(seed, str) and seed.strip().isdecimal():
        seed = int(seed.strip())
    if not isinstance(seed, int) or not 0 <= seed < 2**31:
        raise SeedError(f"seed={seed!r} is not allowed: a whole number from 0 to {2**31 - 1} "
                        "(your instructor's, or python -m labkit capstone new for a fresh one)")
    return seed


def available(tier: str) -> tuple[Fault, ...]:
    """The faults a job on ``tier`` can show."""
    if tier not in TIERS:
        raise ValueError(f"tier={tier!r} is not allowed: one of {TIERS}")
    return tuple(f for f in FAULTS if tier != "cpu" or not f.needs_gpu)


def plan(seed: int | str, tier: str, key: Key | None = None) -> tuple[str, ...]:
    """The ids of the faults seed ``seed`` plants on ``tier`` under ``key`` (the instructor's,
    :func:`labkit.capstone.keys.load`): :data:`PLANTED` distinct ones, at most one per group, at
    least one that costs speed; the same seed, tier and key always give the same faults (in
    catalogue order), and without the key the seed says nothing about them."""
    if not isinstance(key, Key):
        raise TypeError(f"key={key!r}: a seed's faults need the instructor's key "
                        "(labkit.capstone.keys.load(), made by `python -m labkit capstone new`)")
    pool = list(available(tier))
    rng = random.Random(key.digest(tier, parse_seed(seed)))
    while True:
        chosen = rng.sample(pool, PLANTED)
        groups = [f.group for f in chosen if f.group]
        if len(groups) == len(set(groups)) and any(f.kind == "speed" for f in chosen):
            return tuple(f.id for f in FAULTS if f in chosen)


def new_seed() -> int:
    return random.SystemRandom().randrange(2**31)


def describe(faults: Sequence[str], tier: str, head: str) -> str:
    """An answer key as text: ``head``, then each fault with its evidence and fix, and what
    the tier left out (for the instructor, or a learner who gave up; never the notebook)."""
    lines = [head]
    for fid in faults:
        f = BY_ID[fid]
        lines += [f"  {f.id}: {f.title} ({f.kind})", f"     evidence: {f.evidence}",
                  f"     fix: {f.fix}"]  # fmt: skip
    left_out = [f for f in FAULTS if f not in available(tier)]
    if left_out:
        lines.append("not drawn on this tier: " + "; ".join(
            f"{f.id} ({f.why_not_on_cpu})" for f in left_out))
    return "\n".join(lines) + "\n"


def reveal(seed: int | str, tier: str, key: Key) -> str:
    """The answer key of ``seed`` on ``tier`` under the instructor's ``key``, as text."""
    return describe(plan(seed, tier, key), tier,
                    f"seed {parse_seed(seed)} on the {tier} tier plants:")
