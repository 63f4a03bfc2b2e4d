"""The capstone job's settings: what a seed sets wrong, and what a learner changes to fix it.

A fault (:mod:`labkit.course.capstone.faults`) is a setting with a wrong value. :class:`Settings`
holds every knob of the job with its right value by default; :func:`given` applies a seed's
planted faults to it. The learner never sees the given settings (they would name the faults):
they measure, and answer with *changes*, ``{"prepare_data": "once", ...}``, which
:func:`apply` checks and applies to the hidden settings. :func:`faults_in` reads back which
faults a set of settings still carries, so a re-run can name what is left.

One knob is not a speed knob: ``global_batch`` is part of the training recipe (with the
learning rate, it sets what the model learns), so changing it makes a different training run,
faster or not; the capstone's check catches that by the losses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from labkit.course.capstone.faults import BY_ID

PREPARE = ("once", "per_item")
SAMPLERS = ("distributed", "random")
DTYPES = ("bfloat16", "float16", "float32")
OPTIMIZERS = ("default", "for_loop", "foreach", "fused")
STRAGGLER_DELAY_S = 0.015
"""Seconds the planted slow node loses per step: about twice the forward of the CPU tier's
job and under the single-step spikes of a busy machine, so a look at one step or at the step
time does not find it; its forward long in nearly every step, and the other rank's wait, do."""
TOKENS = 257
"""The tokeniser's vocabulary: the 256 byte values and an end-of-document token. The model's
vocabulary is this, padded up to a multiple of ``Settings.vocab_multiple``."""
TINY_BUCKET_MB = 0.01  # the planted bucket cap: 10 kB, smaller than most parameters
EVAL_RARE_STEPS = 100  # validating less often than this is not a fault


FIXES: dict[str, tuple[str, ...]] = {
    "oversubscribed_threads": ("threads_per_rank",),
    "anomaly_mode": ("anomaly_detection",),
    "slow_loader": ("prepare_data", "loader_workers"),
    "straggler": ("straggler_delay_s",),
    "tiny_micro_batch": ("micro_batch",),
    "sync_every_micro_batch": ("no_sync",),
    "small_buckets": ("bucket_cap_mb",),
    "eval_every_step": ("eval_every_steps",),
    "needless_recompute": ("activation_checkpointing",),
    "fp32_on_gpu": ("dtype",),
    "host_sync": ("loss_item_every_micro_batch",),
    "unfused_optimizer": ("optimizer",),
    "unpinned_copies": ("pin_memory",),
    "misaligned_vocab": ("vocab_multiple",),
    "nccl_p2p_disabled": ("nccl_p2p",),
    "no_sampler": ("sampler", "set_epoch"),
    "no_set_epoch": ("set_epoch",),
    "no_zero_grad": ("zero_grad",),
}
"""The settings that fix each fault, in the order notebook 07 tries them: first what makes
every other measurement erratic (threads fighting over the cores, a debugging mode), then the
costs, then correctness, which no speed measurement shows."""


@dataclass(frozen=True)
class Settings:
    """The job's knobs, right by default. Units in the names; each says which fault sets it."""

    global_batch: int = 32
    """Sequences per optimizer step over all ranks: the training recipe, not a speed knob."""
    micro_batch: int = 8
    """Sequences per forward/backward on each rank (``tiny_micro_batch`` sets 1); a rank's
    share of the global batch is split into micro-batches of this size (accumulation)."""
    prepare_data: str = "once"
    """"once": tokenise the dataset before training; "per_item": in ``__getitem__``, every
    epoch (``slow_loader``)."""
    loader_workers: int = 0
    """DataLoader worker processes per rank (``num_workers``); 0: the training process loads
    each batch itself. Workers take per-item work off the step's critical path when there are
    cores to run them (notebook 06's loader section); on cores the ranks already fill, they
    compete with the ranks for them."""
    no_sync: bool = True
    """DDP's ``no_sync()`` for every micro-batch but the last (``sync_every_micro_batch``
    sets False: an all-reduce per micro-batch)."""
    bucket_cap_mb: float = 25.0
    """DDP's gradient bucket cap in MB (DDP's own default, 25; ``small_buckets`` sets
    0.01: an all-reduce for nearly every parameter)."""
    straggler_delay_s: float = 0.0
    """Seconds the last rank loses per step: a slow node (``straggler``). Its fix is to remove
    the cause, which here means 0."""
    threads_per_rank: int | None = None
    """PyTorch threads in each rank; None: the cores shared out among the ranks (torchrun's
    own default is 1 thread per worker when it starts several; ``oversubscribed_threads`` sets
    every core, in every rank)."""
    anomaly_detection: bool = False
    """``torch.autograd.set_detect_anomaly`` for the whole run (``anomaly_mode`` sets True: a
    debugging mode left on)."""
    eval_every_steps: int = 0
    """Validate every this many optimizer steps; 0: once, after the last step
    (``eval_every_step`` sets 1)."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in backward instead of keeping them
    (``needless_recompute`` sets True while they fit with room to spare)."""
    sampler: str = "distributed"
    """"distributed": each rank its share of a shuffled epoch; "random": the same shuffled
    order on every rank (``no_sampler``)."""
    set_epoch: bool = True
    """Call ``sampler.set_epoch(epoch)`` every epoch (``no_set_epoch`` sets False)."""
    zero_grad: bool = True
    """``optimizer.zero_grad(set_to_none=True)`` after every optimizer step (``no_zero_grad``
    sets False: gradients add up across steps)."""
    dtype: str = "bfloat16"
    """The autocast dtype on a GPU (``fp32_on_gpu`` sets float32); a CPU trains in float32."""
    loss_item_every_micro_batch: bool = False
    """Read ``loss.item()`` after every micro-batch (``host_sync``)."""
    optimizer: str = "default"
    """AdamW's implementation: "default" (torch's choice: foreach on a GPU, the per-tensor
    loop on a CPU), "foreach", "fused", or "for_loop" (``unfused_optimizer`` sets it on a
    GPU)."""
    pin_memory: bool = True
    """On a GPU: the loader pins its batches and the copy to the GPU is ``non_blocking``
    (``unpinned_copies`` sets False)."""
    vocab_multiple: int = 64
    """The model's vocabulary is the tokeniser's 257 tokens padded up to a multiple of this
    (``misaligned_vocab`` sets 1: 257 rows in the output layer)."""
    nccl_p2p: bool = True
    """NCCL may use peer-to-peer between the GPUs (``nccl_p2p_disabled`` sets False:
    ``NCCL_P2P_DISABLE=1`` in every rank's environment)."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            kind = {"int": int, "bool": bool, "str": str, "float": (int, float)}.get(str(f.type))
            if f.name == "threads_per_rank":
                ok = value is None or (isinstance(value, int) and not isinstance(value, bool))
            else:
                ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
            if not ok:
                raise ValueError(f"{f.name}={value!r} is not allowed: give a {f.type}")
        for name, allowed in (("prepare_data", PREPARE), ("sampler", SAMPLERS),
                              ("dtype", DTYPES), ("optimizer", OPTIMIZERS)):  # fmt: skip
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r} is not allowed: one of {allowed}")
        if self.global_batch < 1 or self.micro_batch < 1:
            raise ValueError("global_batch and micro_batch are sequences: 1 or more")
        if self.threads_per_rank is not None and self.threads_per_rank < 1:
            raise ValueError(f"threads_per_rank={self.threads_per_rank}: 1 or more, or None")
        if self.loader_workers < 0:
            raise ValueError(f"loader_workers={self.loader_workers}: processes, 0 or more")
        if self.straggler_delay_s < 0:
            raise ValueError(f"straggler_delay_s={self.straggler_delay_s}: seconds, 0 or more")
        if self.bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb={self.bucket_cap_mb}: megabytes, more than 0")
        if self.eval_every_steps < 0:
            raise ValueError(f"eval_every_steps={self.eval_every_steps}: steps, 0 (once, after "
                             "training) or more")  # fmt: skip
        if not 1 <= self.vocab_multiple <= 1024:
            raise ValueError(f"vocab_multiple={self.vocab_multiple}: a whole number from 1 to 1024")

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary: the tokeniser's, padded up to ``vocab_multiple``."""
        return -(-TOKENS // self.vocab_multiple) * self.vocab_multiple


WRONG: dict[str, dict[str, Any]] = {
    "slow_loader": {"prepare_data": "per_item"},
    "tiny_micro_batch": {"micro_batch": 1},
    "sync_every_micro_batch": {"no_sync": False},
    "straggler": {"straggler_delay_s": STRAGGLER_DELAY_S},
    "small_buckets": {"bucket_cap_mb": TINY_BUCKET_MB},
    "anomaly_mode": {"anomaly_detection": True},
    "eval_every_step": {"eval_every_steps": 1},
    "needless_recompute": {"activation_checkpointing": True},
    "no_sampler": {"sampler": "random"},
    "no_set_epoch": {"set_epoch": False},
    "no_zero_grad": {"zero_grad": False},
    "fp32_on_gpu": {"dtype": "float32"},
    "host_sync": {"loss_item_every_micro_batch": True},
    "unfused_optimizer": {"optimizer": "for_loop"},
    "unpinned_copies": {"pin_memory": False},
    "misaligned_vocab": {"vocab_multiple": 1},
    "nccl_p2p_disabled": {"nccl_p2p": False},
}
"""Each fault's wrong settings (``oversubscribed_threads`` depends on the cores: :func:`given`)."""


def given(faults: Iterable[str], *, cores: int) -> Settings:
    """The settings of a job that carries ``faults`` (ids of the catalogue) on ``cores`` cores."""
    wrong = {**WRONG, "oversubscribed_threads": {"threads_per_rank": cores}}
    assert set(wrong) == set(BY_ID) == set(FIXES), "every fault is a wrong setting"
    changes: dict[str, Any] = {}
    for fid in faults:
        if fid not in BY_ID:
            raise ValueError(f"faults=[{fid!r}]: unknown; the catalogue holds {sorted(BY_ID)}")
        changes.update(wrong[fid])
    return dataclasses.replace(Settings(), **changes)


def apply(settings: Settings, changes: Mapping[str, Any]) -> Settings:
    """``settings`` with ``changes`` (field name → new value), checked: an unknown name or a
    value of the wrong kind is named with what is allowed."""
    if not isinstance(changes, Mapping):
        raise ValueError(f"changes={changes!r} is not allowed: a dict of setting → value, "
                         "e.g. {'prepare_data': 'once'}")  # fmt: skip
    known = [f.name for f in dataclasses.fields(Settings)]
    unknown = sorted(set(changes) - set(known))
    if unknown:
        raise ValueError(f"changes name {unknown}, not settings of the job; it has {known}")
    return dataclasses.replace(settings, **changes)


def faults_in(s: Settings, *, tier: str, cores: int, nproc: int) -> tuple[str, ...]:
    """The catalogue's faults that settings ``s`` carry, in catalogue order."""
    share = s.global_batch // nproc
    on_gpu = tier != "cpu"
    threads = s.threads_per_rank if s.threads_per_rank is not None else max(1, cores // nproc)
    present = {
        "slow_loader": s.prepare_data == "per_item" and s.loader_workers == 0,
        "tiny_micro_batch": s.micro_batch * 8 <= share,
        "sync_every_micro_batch": not s.no_sync and s.micro_batch < share,
        "straggler": s.straggler_delay_s > 0,
        "oversubscribed_threads": threads * nproc > cores,
        "small_buckets": s.bucket_cap_mb < 1.0,
        "anomaly_mode": s.anomaly_detection,
        "eval_every_step": 0 < s.eval_every_steps < EVAL_RARE_STEPS,
        "needless_recompute": s.activation_checkpointing,
        "no_sampler": s.sampler == "random",
        "no_set_epoch": s.sampler == "distributed" and not s.set_epoch,
        "no_zero_grad": not s.zero_grad,
        "fp32_on_gpu": on_gpu and s.dtype == "float32",
        "host_sync": on_gpu and s.loss_item_every_micro_batch,
        "unfused_optimizer": on_gpu and s.optimizer == "for_loop",
        "unpinned_copies": on_gpu and not s.pin_memory,
        "misaligned_vocab": on_gpu and s.vocab_size % 64 != 0,
        "nccl_p2p_disabled": tier == "multi-gpu" and not s.nccl_p2p,
    }
    return tuple(fid for fid in BY_ID if present[fid])


def worker_config(s: Settings, *, tier: str, cores: int, nproc: int) -> dict[str, Any]:
    """The worker's config for settings ``s`` (:mod:`labkit.workers.capstone_train`)."""
    if s.global_batch % nproc:
        raise ValueError(f"global_batch={s.global_batch} does not split over {nproc} ranks")
    share = s.global_batch // nproc
    if share % s.micro_batch:
        raise ValueError(f"micro_batch={s.micro_batch} does not divide a rank's share of the "
                         f"global batch ({share} sequences): use one of "
                         f"{[d for d in range(1, share + 1) if share % d == 0]}")  # fmt: skip
    return {
        "global_batch": s.global_batch, "micro_batch": s.micro_batch,
        "prepare_data": s.prepare_data, "loader_workers": s.loader_workers,
        "no_sync": s.no_sync, "bucket_cap_mb": s.bucket_cap_mb,
        "straggler_s": s.straggler_delay_s, "threads": s.threads_per_rank,
        "anomaly_detection": s.anomaly_detection, "eval_every_steps": s.eval_every_steps,
        "activation_checkpointing": s.activation_checkpointing, "sampler": s.sampler,
        "set_epoch": s.set_epoch, "zero_grad": s.zero_grad, "dtype": s.dtype,
        "loss_item_every_micro_batch": s.loss_item_every_micro_batch,
        "optimizer": s.optimizer, "pin_memory": s.pin_memory, "vocab_size": s.vocab_size,
    }  # fmt: skip


def worker_env(s: Settings, *, tier: str) -> dict[str, str]:
    """Environment variables every rank starts with under settings ``s`` (NCCL reads its own
    at start-up, before the worker's code runs)."""
    return {"NCCL_P2P_DISABLE": "1"} if tier == "multi-gpu" and not s.nccl_p2p else {}
