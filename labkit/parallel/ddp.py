"""torch's DistributedDataParallel: the production version of ``dp_bucketed``.

DDP (Li et al., VLDB 2020) broadcasts rank 0's weights once, then per step does what
``dp_bucketed`` does in C++: buckets (``bucket_cap_mb``, 25 MiB by default; the first bucket
is kept small so communication starts early), all-reduces overlapped with backward, and
``no_sync()`` for gradient accumulation (pytorch #118421 discusses its cost).

A *communication hook* replaces how a bucket is reduced:

    fp16 / bf16    cast the bucket to 16 bits, all-reduce, cast back: half the bytes, and
                   gradients rounded to 16 bits (``default_hooks.fp16_compress_hook``)
    PowerSGD       send two low-rank factors P and Q of each gradient matrix instead of the
                   matrix (Vogels et al., NeurIPS 2019); error feedback carries what the
                   approximation lost into the next step (``powerSGD_hook``)

Every hook here is wrapped by a counter (labkit.parallel.comm) that records the bucket's
wire bytes and then calls torch's own hook.

bf16 on gloo: DDP refuses a hook *named* ``bf16_compress_hook`` unless torch was built with
CUDA and NCCL >= 2.10 (a registration-time check in ``DistributedDataParallel``), yet gloo
all-reduces bf16 CPU tensors correctly (torch 2.13, seen). Our counting wrapper carries
another name, so "ddp_bf16" runs on gloo; the parity test shows what it costs in accuracy.
"""

from __future__ import annotations

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
        bucket_cap_mb: DDP's bucket size.
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
        bucket_cap_mb: float = 25.0,
        powersgd_rank: int = 2,
        powersgd_start_iter: int = 2,
    ) -> None:
        if compression not in COMPRESSIONS:
            raise ValueError(f"compression={compression!r}: use one of {COMPRESSIONS}")
        self.name = "ddp" if compression is None else f"ddp_{compression}"
        self.counting = (
            "counted from PowerSGDState's element counters inside a wrapper hook"
            if compression == "powersgd"
            else "counted by a DDP communication hook wrapper (bucket bytes, wire dtype)"
        )
        super().__init__(world_size, backend)
        self.backend = backend
        self.compression = compression
        self.bucket_cap_mb = bucket_cap_mb
        self.powersgd_rank, self.powersgd_start_iter = powersgd_rank, powersgd_start_iter
        self.ddp: DistributedDataParallel | None = None

    def wrap(self, model: nn.Module) -> nn.Module:
        # gradient_as_bucket_view: .grad tensors are views into DDP's buckets. Without it the
        # reducer keeps its own bucket copy of every gradient: twice the gradient memory.
        self.ddp = DistributedDataParallel(
            model, bucket_cap_mb=self.bucket_cap_mb, gradient_as_bucket_view=True
        )
        counter = self.bytes_counter
        if self.compression == "powersgd":
            state = psgd.PowerSGDState(
                process_group=None,
                matrix_approximation_rank=self.powersgd_rank,
                start_powerSGD_iter=self.powersgd_start_iter,
            )
            hook = comm.counting_powersgd_hook(counter, serialize=self.backend == "gloo")
            self.ddp.register_comm_hook(state, hook)
        elif self.compression == "fp16":
            hook = comm.counting_hook(counter, default_hooks.fp16_compress_hook, torch.float16)
            self.ddp.register_comm_hook(None, hook)
        elif self.compression == "bf16":
            hook = comm.counting_hook(counter, default_hooks.bf16_compress_hook, torch.bfloat16)
            self.ddp.register_comm_hook(None, hook)
        else:
            hook = comm.counting_hook(counter, default_hooks.allreduce_hook)
            self.ddp.register_comm_hook(None, hook)
        return self.ddp

    @property
    def no_sync(self):  # type: ignore[override]
        """DDP's own ``no_sync``: the reducer skips the all-reduce, gradients accumulate."""
        return self.ddp.no_sync if self.ddp is not None else None
