"""torch's DistributedDataParallel: the production version of ``dp_bucketed``.

DDP (Li et al., VLDB 2020) broadcasts rank 0's weights once, then per step does what
``dp_bucketed`` does in C++: buckets, all-reduces overlapped with backward, and ``no_sync()``
for gradient accumulation (pytorch #118421 discusses its cost).

    strategy = TorchDDP(world_size)        # bucket_cap_mb=None: DDP's own default buckets
    model = strategy.wrap(model)           # a DistributedDataParallel with a counting hook

**Buckets, as torch 2.13 makes them** (torch/nn/parallel/distributed.py,
``_BucketCapacityConfig``; the ``bucket_cap_mb`` and ``gradient_as_bucket_view`` arguments in
https://docs.pytorch.org/docs/stable/generated/torch.nn.parallel.DistributedDataParallel.html):

* the first iteration puts every gradient in one bucket (parameters' order in the model need
  not be the order backward produces them), then the reducer rebuilds the buckets in the
  order gradients actually arrived;
* ``bucket_cap_mb=None`` (DDP's default, and ours): buckets of 25 MiB, except the first one
  (the last layers' gradients, ready first) capped at ``dist._DEFAULT_FIRST_BUCKET_BYTES``,
  1 MiB, so the first all-reduce can start early in backward;
* ``bucket_cap_mb=<a number>``: *every* bucket, the first included, gets that cap: passing
  25 is not the same as passing nothing. Measured (tests/test_dp_ddp.py): ten 256x256
  linear layers (2.6 MB of gradients) make buckets of 1.05 + 1.58 MB with None, one of
  2.6 MB with 25.

**Gradient memory: 4Ψ bytes, not 8Ψ** (Ψ parameters, fp32). The reducer owns the buckets:
flat fp32 buffers holding every gradient, 4Ψ bytes. With ``gradient_as_bucket_view=False``
(DDP's default) autograd writes each ``.grad`` into a tensor of its own and the reducer
copies it into its bucket: the gradients exist twice, 8Ψ. With
``gradient_as_bucket_view=True`` (ours, and torchtitan's) each ``.grad`` *is* a view into its
bucket, so autograd accumulates straight into the bucket and nothing is copied: 4Ψ. The
catch (DDP's docstring): ``.grad`` must not be replaced by another tensor (``detach_()`` on
it fails), and the views exist only after the first backward. ``memory()`` reports the bucket
storage that ``.grad`` does not share as ``gradient_buckets``, so the two settings show their
true difference (tests/test_dp_ddp.py measures 4Ψ and 8Ψ). The views do not survive
``zero_grad(set_to_none=True)``: under ``no_sync`` the next micro-batches' ``.grad`` are fresh
tensors beside the buckets (8Ψ while accumulating; measured there too) until the synchronised
backward makes them views again.

A *communication hook* replaces how a bucket is reduced:

    fp16 / bf16    cast the bucket to 16 bits, all-reduce, cast back: half the bytes, and
                   gradients rounded to 16 bits (``default_hooks.fp16_compress_hook``)
    PowerSGD       send two low-rank factors P and Q of each gradient matrix instead of the
                   matrix (Vogels et al., NeurIPS 2019); error feedback carries what the
                   approximation lost into the next step (``powerSGD_hook``)

Every hook here is wrapped by a counter (labkit.parallel.comm) that records the bucket's
wire bytes (and which storage each bucket lives in) and then calls torch's own hook.

bf16 on gloo: DDP refuses a hook *named* ``bf16_compress_hook`` unless torch was built with
CUDA and NCCL >= 2.10 (a registration-time check in ``DistributedDataParallel``), yet gloo
all-reduces bf16 CPU tensors correctly (torch 2.13, seen). Our counting wrapper carries
another name, so "ddp_bf16" runs on gloo; the parity test shows what it costs in accuracy.
This is for gloo only, to teach on CPU ranks, and not for production: it steps around a
guard torch put there on purpose, and on NCCL torch's own ``bf16_compress_hook`` is the one to
register.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
from torch.nn.parallel import DistributedDataParallel

from labkit.parallel import comm
from labkit.parallel.dp_config import Strategy

COMPRESSIONS = (None, "fp16", "bf16", "powersgd")


class TorchDDP(Strategy):
    """``DistributedDataParallel`` with a counting communication hook.

    Args:
        compression: None (plain all-reduce), "fp16", "bf16" or "powersgd".
        bucket_cap_mb: DDP's bucket size in MiB; None (default) is DDP's own default, 25 MiB
            with a 1 MiB first bucket; a number caps every bucket, the first included.
        gradient_as_bucket_view: make ``.grad`` views into DDP's buckets (True, default:
            4Ψ bytes of gradients) or separate tensors copied into them (False: 8Ψ).
        powersgd_rank: PowerSGD's matrix approximation rank r.
        powersgd_start_iter: steps of plain all-reduce before PowerSGD starts (>= 2 with
            error feedback, PowerSGD's own rule).
    """

    def __init__(
        self,
        world_size: int,
        backend: str = "gloo",
        *,
        compression: str | None = None,
        bucket_cap_mb: float | None = None,
        powersgd_rank: int = 2,
        powersgd_start_iter: int = 2,
        gradient_as_bucket_view: bool = True,
        group: Any = None,
    ) -> None:
        if compression not in COMPRESSIONS:
            raise ValueError(f"compression={compression!r}: use one of {COMPRESSIONS}")
        self.name = "ddp" if compression is None else f"ddp_{compression}"
        self.counting = (
            "counted from PowerSGDState's element counters inside a wrapper hook"
            if compression == "powersgd"
            else "counted by a DDP communication hook wrapper (bucket bytes, wire dtype)"
        )
        super().__init__(world_size, backend, group=group)
        self.backend = backend
        self.compression = compression
        self.bucket_cap_mb = bucket_cap_mb
        self.gradient_as_bucket_view = gradient_as_bucket_view
        # bucket index -> (storage data_ptr, bytes) of the reducer's bucket buffers, as the
        # counting hook last saw them (rebuilt buckets replace the first iteration's).
        self.bucket_storages: dict[int, tuple[int, int]] = {}
        self.powersgd_rank, self.powersgd_start_iter = powersgd_rank, powersgd_start_iter
        self.ddp: DistributedDataParallel | None = None

    def wrap(self, model: nn.Module) -> nn.Module:
        # gradient_as_bucket_view: .grad tensors are views into DDP's buckets. Without it the
        # reducer keeps its own bucket copy of every gradient: twice the gradient memory.
        self.ddp = DistributedDataParallel(
            model,
            bucket_cap_mb=self.bucket_cap_mb,  # None: DDP's default, with its 1 MiB first bucket
            gradient_as_bucket_view=self.gradient_as_bucket_view,
            process_group=self.group,  # None: every rank
        )
        counter = self.bytes_counter
        seen = self.bucket_storages
        if self.compression == "powersgd":
            state = psgd.PowerSGDState(
                process_group=self.group,
                matrix_approximation_rank=self.powersgd_rank,
                start_powerSGD_iter=self.powersgd_start_iter,
            )
            serialize = self.backend == "gloo"
            hook = comm.counting_powersgd_hook(counter, serialize=serialize, buckets=seen)
            self.ddp.register_comm_hook(state, hook)
        elif self.compression == "fp16":
            fp16 = default_hooks.fp16_compress_hook
            hook = comm.counting_hook(counter, fp16, torch.float16, buckets=seen)
            self.ddp.register_comm_hook(self.group, hook)
        elif self.compression == "bf16":
            bf16 = default_hooks.bf16_compress_hook
            hook = comm.counting_hook(counter, bf16, torch.bfloat16, buckets=seen)
            self.ddp.register_comm_hook(self.group, hook)
        else:
            hook = comm.counting_hook(counter, default_hooks.allreduce_hook, buckets=seen)
            self.ddp.register_comm_hook(self.group, hook)
        return self.ddp

    def memory(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """As ``Strategy.memory`` (``gradients``: the storages ``.grad`` lives in), plus
        ``gradient_buckets``: bytes of DDP's bucket buffers that no ``.grad`` is a view of, a
        second copy of the gradients (0 under ``gradient_as_bucket_view`` once backward has
        made the views). Buckets are seen by the counting hook, so only after the first
        synchronised backward, and DDP rebuilds them once, in the second synchronised step's
        forward: the figure is steady from the third step on. A later ``no_sync`` backward after ``zero_grad(set_to_none=True)``
        gives fresh ``.grad`` tensors beside the buckets (measured in tests/test_dp_ddp.py)."""
        mem = super().memory(model, optimizer)
        params = [p for p in model.parameters() if p.grad is not None]
        grads = {p.grad.untyped_storage().data_ptr() for p in params}
        extra = sum(n for ptr, n in self.bucket_storages.values() if ptr not in grads)
        return {**mem, "gradient_buckets": extra}

    @property
    def no_sync(self):  # type: ignore[override]
        """DDP's own ``no_sync``: the reducer skips the all-reduce, gradients accumulate."""
        return self.ddp.no_sync if self.ddp is not None else None
