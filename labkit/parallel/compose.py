"""Two parallelisms at once on a 2-D device mesh: FSDP2 × tensor parallelism, and HSDP.

Both follow torchtitan's order (torchtitan/models/llama3/infra/parallelize.py up to commit
238fa9953; since Feb 2026 models/llama3/parallelize.py and distributed/fsdp.py): tensor
parallelism first, on the inner mesh dimension, then FSDP2's ``fully_shard`` on the outer one,
so FSDP shards the tensors TP already split (a parameter ends up a DTensor placed on both
dimensions: ``(_StridedShard(0), Shard(0))`` for a column-parallel weight).

    mesh = labkit.parallel.mesh.build({"dp": 2, "tp": 2}, "cpu")
    model = apply_fsdp_tp(GPT(cfg), mesh)       # TP on mesh["tp"], FSDP2 on mesh["dp"]

    mesh = labkit.parallel.mesh.build({"replicate": 2, "shard": 2}, "cpu")
    model = apply_hsdp(GPT(cfg), mesh)          # fully_shard on the 2-D mesh

HSDP (hybrid sharding): ``fully_shard`` given a 2-D mesh shards every parameter along the
inner dimension and replicates those shards along the outer one. Per unit and step it
all-gathers and reduce-scatters within a shard group (fast, inside a node) and all-reduces
the gradient *shard* across replica groups (slow, across nodes), so the cross-node traffic
is 1/shard of plain data parallelism's
(https://docs.pytorch.org/docs/stable/distributed.fsdp.fully_shard.html, ``mesh``).

Both functions work in place on a loaded model and return it. Every rank must build the same
weights first (same seed), or call ``comm.sync_module_states`` before: FSDP2 keeps each rank's
own slice, and TP's ``parallelize_module`` each rank's own shard, of whatever it was given.
On CPU/gloo the mesh must be an explicit CPU mesh (pytorch #132471), and gloo emulates
reduce-scatter with an all-reduce (pytorch #118911): counted bytes follow what was called.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from labkit.parallel.fsdp import apply_fsdp2
from labkit.parallel.tensor import apply_dtensor_parallel


def _need_dims(mesh: Any, names: tuple[str, ...], what: str) -> None:
    have = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if have != names:
        raise ValueError(
            f"{what} needs a 2-D mesh with dimensions {names} (outer first), got {have or 'an unnamed mesh'}: "
            f"build it with labkit.parallel.mesh.build({{{names[0]!r}: ..., {names[1]!r}: ...}}, device)"
        )


def apply_fsdp_tp(
    model: nn.Module,
    mesh: Any,
    *,
    dp_dim: str = "dp",
    tp_dim: str = "tp",
    reshard_after_forward: bool = True,
) -> nn.Module:
    """Tensor parallelism (DTensor) on ``mesh[tp_dim]``, then FSDP2 on ``mesh[dp_dim]``.

    Within a TP group the ranks see the same batch and each holds 1/tp of every block's
    matrices; across the dp dimension each of those shards is split again by FSDP2, and
    gradients are averaged over the dp groups' different batches.
    """
    _need_dims(mesh, (dp_dim, tp_dim), "apply_fsdp_tp")
    apply_dtensor_parallel(model, mesh[tp_dim])
    return apply_fsdp2(model, mesh[dp_dim], reshard_after_forward=reshard_after_forward)


def apply_hsdp(
    model: nn.Module,
    mesh: Any,
    *,
    replicate_dim: str = "replicate",
    shard_dim: str = "shard",
    reshard_after_forward: bool = True,
) -> nn.Module:
    """FSDP2 over a 2-D (replicate, shard) mesh: shard within a group, replicate across."""
    _need_dims(mesh, (replicate_dim, shard_dim), "apply_hsdp")
    return apply_fsdp2(
        model, mesh[(replicate_dim, shard_dim)], reshard_after_forward=reshard_after_forward
    )


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float) -> float:
    """Clip gradients by their global norm; returns the norm (as torch's clip_grad_norm_ would
    on the single-process model).

    torch's own ``clip_grad_norm_`` stacks the per-parameter norms, which fails when the
    parameters live on different meshes (here FSDP2's 1-D "dp" mesh for the embeddings that TP
    replicates, the 2-D ("dp", "tp") mesh for the split weights: "All operands in
    aten.stack.default must have the same mesh", seen with torch 2.13). So the norm is taken
    per mesh (``torch.nn.utils.get_total_norm``, one reduction over that mesh) and the squares
    added. torchtitan (torchtitan/distributed/utils.py) sums per-mesh norms only with expert
    parallelism (``_clip_grad_norm_with_ep``); for FSDP × TP it avoids mixed meshes by placing
    embeddings and norms on the TP mesh too, and it all-reduces the norm over the pipeline group.
    """
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    by_mesh: dict[Any, list[torch.Tensor]] = {}
    for g in grads:
        by_mesh.setdefault(getattr(g, "device_mesh", None), []).append(g)
    total_sq = 0.0
    for group in by_mesh.values():
        n = torch.nn.utils.get_total_norm(group, 2.0, foreach=False)
        n = n.full_tensor() if hasattr(n, "full_tensor") else n
        total_sq += float(n) ** 2
    total = math.sqrt(total_sq)
    coef = min(1.0, max_norm / (total + 1e-6))  # torch's clip_grad_norm_ formula
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return total
