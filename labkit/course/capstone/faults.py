"""The capstone's fault catalogue, and which faults a seed plants.

The capstone job (:mod:`labkit.course.capstone.job`) is a real data-parallel training run that is
slower than it should be, or wrong. Each :class:`Fault` below is one real cause, planted by a
switch of the worker (:mod:`labkit.workers.capstone_train`) and removed by its fix; each is
visible with the tools of notebooks 00–06 (``where`` says which, never what value is wrong:
that judgement is the learner's). A seed, a difficulty level and the instructor's key
(:func:`plan`, :mod:`labkit.course.capstone.keys`) pick which faults a learner's job carries, so an
instructor can hand every learner their own job and keep the answer key
(``python -m labkit capstone reveal --seed N``, which needs the key file); the seed alone says
nothing.

Tiers: six faults need a GPU to show (a CPU has no launch queue for a host sync to drain, no
bf16 tensor cores, no host-to-device copy, no fused optimizer path) and one needs NCCL between
GPUs; three need two ranks or more (a straggler, threads shared out among ranks, a sampler
that splits the data), which the single-gpu tier's one-rank job does not have. A seed on a
tier draws only from the faults that tier can show, and ``why_not`` says why a tier leaves a
fault out.

Sources for the symptoms and fixes: PyTorch's performance tuning guide
(https://docs.pytorch.org/tutorials/recipes/recipes/tuning_guide.html: data loading workers,
pinned memory and non_blocking copies, avoiding CPU-GPU syncs, mixed precision, sizes in
multiples of 8 for tensor cores, no_sync under accumulation); the ``DistributedSampler`` docs
(``set_epoch`` "to make shuffling work properly across multiple epochs",
https://docs.pytorch.org/docs/stable/data.html#torch.utils.data.distributed.DistributedSampler);
torchrun's default of ``OMP_NUM_THREADS=1`` per worker ("to avoid your system being
overloaded", torch/distributed/run.py); ``DistributedDataParallel``'s ``bucket_cap_mb``
(default 25) in torch/nn/parallel/distributed.py; ``torch.autograd.detect_anomaly``'s warning
that it "should be enabled only for debugging" because it slows execution (torch/autograd/
anomaly_mode.py); activation checkpointing's extra forward in backward
(torch/utils/checkpoint.py; Chen et al. 2016, arXiv:1604.06174); the optimizer docs on the
foreach and fused implementations (https://docs.pytorch.org/docs/stable/optim.html); nanoGPT's
vocabulary "padded up to nearest multiple of 64 for efficiency" (karpathy/nanoGPT, model.py);
NCCL's ``NCCL_P2P_DISABLE`` ("disables the peer to peer (P2P) transport",
https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from labkit.course.capstone.keys import Key
from labkit.errors import LabkitError

TIERS = ("cpu", "single-gpu", "multi-gpu")
GPU_TIERS = ("single-gpu", "multi-gpu")
ALL_TIERS = TIERS
RANKS_TIERS = ("cpu", "multi-gpu")  # the tiers whose job has two ranks or more
ONE_RANK = "the single-gpu tier's job has one rank, and one rank has {}"

LEVELS: dict[str, tuple[int, int]] = {"intro": (3, 1), "standard": (4, 2), "expert": (5, 3)}
"""Difficulty: level → (faults planted, the subtlest fault drawn). ``intro`` plants three
faults that one look at the right measurement shows; ``standard`` four, some of which need a
comparison across ranks, micro-batches or steps; ``expert`` five, some of which only a trace
or a series read with care shows."""
DEFAULT_LEVEL = "standard"


@dataclass(frozen=True)
class Fault:
    """One planted cause of a slow (or wrong) job."""

    id: str
    title: str
    symptom: str
    """What a learner sees first."""
    where: str
    """Where to look (the tool, and the notebook that taught it), with no threshold: deciding
    what a healthy value is, is the learner's part."""
    fix: str
    kind: str
    """"speed" (the job is slower than it must be) or "correctness" (its result is wrong)."""
    subtlety: int
    """1: one look at the right measurement shows it; 2: it takes a comparison (across ranks,
    micro-batches, steps, or against a formula); 3: only a trace or a series read with care."""
    tiers: tuple[str, ...] = ALL_TIERS
    """The tiers whose job can show it; a seed on any other tier never plants it."""
    group: str = ""
    """Faults of one group are alternatives: a seed plants at most one of them."""
    why_not: str = ""
    """Why the tiers it leaves out cannot show it (said when a tier leaves it out)."""
    small_here: str = ""
    """Why its cost is small in the capstone's small job, where it is (its evidence still
    shows it, and the check still needs it fixed; on a real model it costs more)."""


FAULTS: tuple[Fault, ...] = (
    Fault(
        "slow_loader", "data loading on the critical path",
        "low device utilisation; every step starts with a wait",
        "each step's data phase against its compute (notebook 06's phase split), and what one "
        "item of the dataset costs (the loader facts)",
        "take the work out of __getitem__: tokenise once, ahead of training (or, with cores "
        "to spare, DataLoader workers)", "speed", 1,
    ),
    Fault(
        "tiny_micro_batch", "a micro-batch far below what fits",
        "low FLOP/s; on a GPU, memory far below what it holds",
        "the micro-batch and its accumulation steps against memory and speed (notebook 05's "
        "sweep: where tokens/s stops rising)",
        "raise the micro-batch and lower the accumulation by the same factor (the same global "
        "batch, so the same training)", "speed", 1,
    ),
    Fault(
        "sync_every_micro_batch", "an all-reduce for every micro-batch",
        "communication time grows with the accumulation steps",
        "the all-reduce calls each micro-batch's backward issued (notebook 02's counted calls "
        "and no_sync)",
        "enter DDP's no_sync() for every micro-batch but the last", "speed", 2,
    ),
    Fault(
        "straggler", "a straggler rank",
        "every rank is as slow as one of them",
        "the per-rank phase times, step by step (notebook 06's per-rank traces): where one "
        "rank spends time the others spend waiting",
        "find the slow rank's cause and remove it (here: the planted delay on that rank)",
        "speed", 2, tiers=RANKS_TIERS, why_not=ONE_RANK.format("no other rank to wait for it"),
    ),
    Fault(
        "oversubscribed_threads", "more compute threads than cores",
        "per-step time erratic and long; the machine looks fully busy",
        "each rank's PyTorch threads, the ranks, and the cores (the environment facts; "
        "notebook 00's machine check)",
        "no more threads in all than cores: each rank its share (OMP_NUM_THREADS, "
        "torch.set_num_threads; torchrun's own default is 1 per worker)", "speed", 1,
        tiers=RANKS_TIERS, why_not=ONE_RANK.format("every core is its own share"),
    ),
    Fault(
        "small_buckets", "DDP's gradient buckets far too small",
        "backward slower than its compute; many small messages",
        "the all-reduce calls per backward and the bytes each one carries, against the "
        "gradient's size (notebook 02's buckets and the α-β cost of a message)",
        "DDP's bucket_cap_mb back to its default (25 MB): a few large all-reduces, overlapped "
        "with backward", "speed", 3,
    ),
    Fault(
        "anomaly_mode", "autograd's anomaly detection left on",
        "forward and backward both slower than the model's FLOPs explain",
        "the operators backward runs in the profiler trace, and each phase against a clean "
        "step of the same model (notebook 06)",
        "torch.autograd.set_detect_anomaly(False): a debugging mode that checks every backward "
        "output for NaN (a host sync per check on a GPU) and keeps each forward op's "
        "traceback", "speed", 2,
    ),
    Fault(
        "eval_every_step", "a validation pass every step",
        "the step takes longer than its phases add up to",
        "time in each step outside its labelled phases, and the ops the profiler trace shows "
        "there (notebook 06)",
        "validate every few hundred steps (here: at the end of training), not every step",
        "speed", 2,
    ),
    Fault(
        "needless_recompute", "activation checkpointing with memory to spare",
        "backward long against forward",
        "the ops in each phase of the profiler trace (what backward runs that a backward "
        "does not need), and backward's time against forward's (notebook 05's recompute)",
        "turn activation checkpointing off while the activations fit: it buys memory with "
        "about one more forward", "speed", 3,
    ),
    Fault(
        "no_sampler", "no DistributedSampler: every rank trains on the same data",
        "nothing looks slow: the job is wrong, not slow",
        "the sample indices each rank saw, and the sampler the loader holds (notebook 02's "
        "sampler section)", "a DistributedSampler, with set_epoch(epoch) every epoch",
        "correctness", 1, group="sampler", tiers=RANKS_TIERS,
        why_not=ONE_RANK.format("no other rank to share its samples with"),
    ),
    Fault(
        "no_set_epoch", "DistributedSampler without set_epoch",
        "nothing looks slow: every epoch repeats the first one's order",
        "the sample indices of each epoch on each rank",
        "call sampler.set_epoch(epoch) at the start of every epoch", "correctness", 2,
        group="sampler",
    ),
    Fault(
        "no_zero_grad", "gradients never zeroed",
        "the losses look plausible (AdamW scales each update by its own running statistics), "
        "so nothing in the loss curve gives it away",
        "the gradient norm step by step, and the losses (notebook 01's training curve)",
        "optimizer.zero_grad(set_to_none=True) after every optimizer step", "correctness", 2,
    ),
    Fault(
        "fp32_on_gpu", "full fp32 where bf16 is safe",
        "MFU far below what the GPU's bf16 tensor cores allow",
        "the dtype of each matmul in the profiler trace; notebook 04's speed per precision",
        "bf16 autocast (fp32 weights, bf16 matmuls)", "speed", 1, tiers=GPU_TIERS,
        why_not="a CPU without bf16 matrix units runs bf16 slower than fp32 (notebook 04 "
                "measured it), so fp32 is the right choice there",
    ),
    Fault(
        "host_sync", "a host sync every micro-batch",
        "GPU idle gaps between kernels; the CPU cannot run ahead",
        "the host syncs counted per step, and the gaps in the GPU timeline (notebook 06's "
        "sync bottleneck)",
        "read the loss once per logging interval, not every micro-batch", "speed", 2,
        tiers=GPU_TIERS,
        why_not="a CPU runs each operator as Python calls it, so there is no queue for "
                ".item() to drain (notebook 06 measured no effect)",
    ),
    Fault(
        "unfused_optimizer", "an optimizer that loops over its tensors",
        "the optimizer phase long for a small model",
        "the optimizer phase's time, and the operators it runs in the profiler trace (one "
        "set per tensor, or one foreach or fused set over all of them)",
        "AdamW(fused=True) (or foreach=True): one or a few kernels for all tensors", "speed", 2,
        tiers=GPU_TIERS,
        why_not="torch's default AdamW on a CPU is the per-tensor loop (foreach is the default "
                "for CUDA tensors only; a fused CPU AdamW exists since torch 2.4 but is not the "
                "default), so the CPU job's healthy optimizer is that loop",
    ),
    Fault(
        "unpinned_copies", "pageable host memory, blocking copies",
        "the data phase holds a copy the GPU could overlap",
        "the loader facts (pin_memory) and the host-to-device copies in the trace "
        "(Memcpy HtoD, pageable or pinned)",
        "DataLoader(pin_memory=True) and .to(device, non_blocking=True)", "speed", 3,
        tiers=GPU_TIERS, why_not="a CPU job copies nothing to a device",
        small_here="a batch here is 16 × 64 token ids (8 kB), and the loader has no worker "
                   "to pin ahead of time: pinned or not, the copy costs microseconds (PyTorch's "
                   "pin_memory tutorial: pinning on the spot can cost more than it saves)",
    ),
    Fault(
        "misaligned_vocab", "a vocabulary that is not a multiple of 64",
        "the output layer slower than its FLOPs say",
        "the model's dimensions, and the head's matmul time per FLOP against the other "
        "layers' (notebook 04's tensor-core alignment)",
        "pad the vocabulary to a multiple of 64 (the extra logits are never targets)", "speed",
        1, tiers=GPU_TIERS,
        small_here="the head here is a 512 × 64 × 257 matmul, which a GPU finishes in "
                   "microseconds whatever its alignment: launch time, not tensor cores, sets it",
        why_not="a CPU's matrix units do not need dimensions in multiples of 8 or 64, so the "
                "padding buys a CPU nothing",
    ),
    Fault(
        "nccl_p2p_disabled", "NCCL told not to use peer-to-peer",
        "all-reduce slower than the GPUs' link allows",
        "the NCCL environment of each rank, and the all-reduce's bus bandwidth against the "
        "link's (notebook 02's collective benchmark)",
        "unset NCCL_P2P_DISABLE (a workaround for broken P2P, not a setting to keep)", "speed",
        1, tiers=("multi-gpu",),
        small_here="the gradient here is 0.5 MB, so each all-reduce is latency-bound and the "
                   "link's bandwidth barely shows",
        why_not="only ranks on two or more GPUs talk over NCCL",
    ),
)
BY_ID = {f.id: f for f in FAULTS}


class SeedError(ValueError, LabkitError):
    """A seed the capstone cannot use; the message says what a seed looks like."""


SEED_DIGITS = len(str(2**31 - 1))
"""Digits in the largest seed: a longer string of digits is refused before ``int()`` reads it
(Python refuses more than 4300 digits with its own error, and a message must not echo them)."""


def parse_seed(seed: int | str) -> int:
    """A seed as an int: a whole number 0..2**31-1, given as an int or its decimal digits."""
    if isinstance(seed, bool):
        raise SeedError(f"seed={seed!r} is not allowed: a whole number from 0 to {2**31 - 1}")
    if isinstance(seed, str) and seed.strip().isdecimal() and len(seed.strip()) <= SEED_DIGITS:
        seed = int(seed.strip())
    if not isinstance(seed, int) or not 0 <= seed < 2**31:
        raise SeedError(f"seed={shown_seed(seed)} is not allowed: a whole number from 0 to "
                        f"{2**31 - 1} (your instructor's, or python -m labkit capstone new for a "
                        "fresh one)")  # fmt: skip
    return seed


def shown_seed(value: object) -> str:
    """A seed as a message names it: its repr, or its start and length when that is long (a
    5000-digit int has no repr: Python's 4300-digit limit)."""
    if isinstance(value, int) and value.bit_length() > 64:
        digits = math.floor(value.bit_length() * math.log10(2)) + 1  # within one of the count
        return f"an int of about {digits} digits"
    text = value.strip() if isinstance(value, str) else value
    if isinstance(text, str) and len(text) > 2 * SEED_DIGITS:
        unit = "digits" if text.isdecimal() else "characters"
        return f"{text[:SEED_DIGITS]!r}… ({len(text)} {unit})"
    return repr(value)


def available(tier: str) -> tuple[Fault, ...]:
    """The faults a job on ``tier`` can show."""
    if tier not in TIERS:
        raise ValueError(f"tier={tier!r} is not allowed: one of {TIERS}")
    return tuple(f for f in FAULTS if tier in f.tiers)


def describe_catalogue(tier: str) -> str:
    """The suspects a job on ``tier`` can carry, as notebook 07 lists them: each fault's id, kind,
    subtlety and title, its symptom, where to look, and why its cost is small in this job where
    it is. The public catalogue: it says nothing of which faults a job carries."""
    lines = []
    for f in available(tier):
        lines += [f"{f.id}  ({f.kind}, subtlety {f.subtlety}): {f.title}",
                  f"    symptom: {f.symptom}", f"    look at: {f.where}"]  # fmt: skip
        if f.small_here:
            lines.append(f"    in this job: {f.small_here}")
    return "\n".join(lines)


def describe_left_out(tier: str) -> str:
    """The faults ``tier`` never plants, each with why it has no signature there ("" when the
    tier can show them all)."""
    left_out = [f for f in FAULTS if f not in available(tier)]
    if not left_out:
        return ""
    return "\n".join([f"Not planted on the {tier} tier (no signature here):",
                      *(f"  {f.title}: {f.why_not}" for f in left_out)])  # fmt: skip


def parse_level(level: str) -> str:
    if level not in LEVELS:
        raise ValueError(f"level={level!r} is not allowed: one of {list(LEVELS)} "
                         "(how many faults, and how subtle)")  # fmt: skip
    return level


def plan(seed: int | str, tier: str, key: Key | None = None,
         level: str = DEFAULT_LEVEL) -> tuple[str, ...]:  # fmt: skip
    """The ids of the faults seed ``seed`` plants on ``tier`` at ``level`` under ``key`` (the
    instructor's, :func:`labkit.course.capstone.keys.load`): as many distinct ones as the level says
    (:data:`LEVELS`), none subtler than it allows, at most one per group, at least one that
    costs speed; the same seed, tier, level and key always give the same faults (in catalogue
    order), and without the key the seed says nothing about them."""
    if not isinstance(key, Key):
        raise TypeError(f"key={key!r}: a seed's faults need the instructor's key "
                        "(labkit.course.capstone.keys.load(), made by `python -m labkit capstone new`)")
    count, subtlest = LEVELS[parse_level(level)]
    pool = [f for f in available(tier) if f.subtlety <= subtlest]
    rng = random.Random(key.digest(tier, parse_seed(seed), level))
    while True:
        chosen = rng.sample(pool, count)
        groups = [f.group for f in chosen if f.group]
        if len(groups) == len(set(groups)) and any(f.kind == "speed" for f in chosen):
            return tuple(f.id for f in FAULTS if f in chosen)


def new_seed() -> int:
    return random.SystemRandom().randrange(2**31)


def describe(faults: Sequence[str], tier: str, head: str) -> str:
    """An answer key as text: ``head``, then each fault with where it shows and its fix, and
    what the tier left out (for the instructor, or a learner who gave up; never the
    notebook)."""
    lines = [head]
    for fid in faults:
        f = BY_ID[fid]
        lines += [f"  {f.id}: {f.title} ({f.kind}, subtlety {f.subtlety})",
                  f"     where it shows: {f.where}", f"     fix: {f.fix}"]  # fmt: skip
        if f.small_here:
            lines.append(f"     in this job: {f.small_here}")
    left_out = [f for f in FAULTS if f not in available(tier)]
    if left_out:
        lines.append(f"not drawn on the {tier} tier: " + "; ".join(
            f"{f.id} ({f.why_not})" for f in left_out))
    return "\n".join(lines) + "\n"


def reveal(seed: int | str, tier: str, key: Key, level: str = DEFAULT_LEVEL) -> str:
    """The answer key of ``seed`` on ``tier`` at ``level`` under the instructor's ``key``."""
    return describe(plan(seed, tier, key, level), tier,
                    f"seed {parse_seed(seed)} on the {tier} tier, level {level}, plants:")
