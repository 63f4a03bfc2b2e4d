"""FSDP2 (``fully_shard``): parameters, gradients and optimizer state all sharded (ZeRO-3).

Each rank stores 1/n of every parameter (a ``DTensor`` sharded on dim 0 over a device mesh).
Per step, for each wrapped module (a *unit*: one transformer block, say, and the root with
whatever no unit took, such as the embeddings, final LayerNorm and tied head):

    forward   all-gather the unit's parameters, compute, free them again
    backward  all-gather them again, compute gradients, reduce-scatter the gradients, so each
              rank keeps the averaged gradient of its own shard; free the full parameters

The optimizer then steps on local shards only. Communication is about 1.5x plain data
parallelism (two all-gathers and a reduce-scatter instead of one all-reduce: ZeRO paper,
section 7.2.2); memory per rank is about 1/n of it (formulas.zero_memory_per_rank, stage 3).
The root unit is not resharded after forward (backward needs it at once: torch's default,
``reshard_after_forward=None``), so it is gathered once per step, not twice.

Works on any ``nn.Module``: name the units to shard with ``modules`` (a list, or a policy
``module -> bool``); a GPT with ``.blocks`` shards one unit per block by default.

    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world_size,))            # "cuda" on GPUs
    strategy = FSDP2(world_size, mesh=mesh, modules=lambda m: isinstance(m, Block),
                     mixed_precision="bf16", reshard_after_forward=True)
    model = strategy.wrap(model)                              # rank 0's weights, sharded

Options, both from FSDP2's own API (torch/distributed/fsdp/_fully_shard/_fully_shard.py;
https://docs.pytorch.org/docs/stable/distributed.fsdp.fully_shard.html):

* ``mixed_precision="bf16"``: ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``.
  The all-gathered (unsharded) parameters and the forward/backward compute are bf16, so the
  all-gathers carry half the bytes; gradients are reduce-scattered in fp32, and the sharded
  parameters the optimizer steps stay fp32 (no separate master copy: the shard is it). The
  recipe torchtitan trains with (``mixed_precision_param``/``mixed_precision_reduce``).
* ``reshard_after_forward=False``: every unit keeps its unsharded parameters from forward to
  backward, so backward all-gathers nothing (one all-gather per unit per micro-batch instead
  of two) at the price of holding the whole model's parameters at the forward/backward
  boundary: ZeRO-2-like in memory between forward and backward, sharded again after backward.

``wrap`` broadcasts rank 0's parameters and buffers before sharding, as torch's DDP does
when it wraps a model: ``fully_shard`` keeps each rank's own slice of its own initial weights,
so ranks seeded differently would otherwise train a patchwork of their initialisations.

On CPU/gloo FSDP2 needs an explicit device mesh (``init_device_mesh("cpu", (n,))``,
pytorch #132471): ``apply_fsdp2`` takes one and refuses to guess.

A mesh with more dimensions works too: ``FSDP2(n, mesh=mesh, mesh_dim="dp")`` shards over the
named dimension only (the other may hold tensor or pipeline parallelism), and a 2-D
("replicate", "shard") mesh, given whole, is HSDP: sharded within each shard group and
replicated across them (``labkit.parallel.compose``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from labkit.parallel import comm
from labkit.parallel.dp_config import Strategy

MIXED_PRECISION = (None, "bf16")
# Which modules to shard as units: a list of them, or a policy ``module -> bool``.
Units = Sequence[nn.Module] | Callable[[nn.Module], bool] | None


def mixed_precision_policy(name: str | None) -> Any:
    """FSDP2's ``MixedPrecisionPolicy`` for ``name``: None (everything in the parameters'
    dtype) or "bf16" (bf16 parameters and compute, fp32 gradient reduction)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if name is None:
        return MixedPrecisionPolicy()
    if name == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    raise ValueError(f"mixed_precision={name!r}: use one of {MIXED_PRECISION}")


def shard_units(model: nn.Module, modules: Units = None) -> list[nn.Module]:
    """The submodules to shard as units, children before their parents (``fully_shard`` is
    applied bottom-up: a unit takes the parameters no earlier unit took).

    ``modules``: a list of submodules of ``model``; a policy called on every submodule (not the
    root); or None, which means ``model.blocks`` (one unit per transformer block).
    """
    if modules is None:
        blocks = getattr(model, "blocks", None)
        if blocks is None:
            raise ValueError(
                f"{type(model).__name__} has no .blocks to shard one by one: pass "
                "modules=[...] (the submodules to shard as units) or modules=policy (a "
                "callable module -> bool), or modules=[] to shard the whole model as one unit"
            )
        return list(blocks)
    if callable(modules) and not isinstance(modules, nn.Module):
        # modules() is pre-order (parents first): reversed, every child precedes its parent.
        return [m for m in reversed(list(model.modules())) if m is not model and modules(m)]
    units = list(modules)
    inside = {id(m) for m in model.modules() if m is not model}
    strangers = [type(m).__name__ for m in units if id(m) not in inside]
    if strangers:
        raise ValueError(
            f"modules={strangers} are not submodules of the model (or are the model itself, "
            "which is always sharded last as the root): pass submodules of the model you wrap"
        )
    order = {id(m): i for i, m in enumerate(reversed(list(model.modules())))}
    return sorted(units, key=lambda m: order[id(m)])


def apply_fsdp2(
    model: nn.Module,
    mesh: Any,
    *,
    modules: Units = None,
    mixed_precision: str | None = None,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """Shard each unit of ``modules`` (default: every ``model.blocks`` block), then the root.

    Each unit is all-gathered on its own, so only one unit's full parameters exist at a time
    (plus the root's); sharding the root last groups what no unit took (embeddings and a tied
    head) in one unit, which a tied weight needs: it must belong to exactly one unit.
    ``reshard_after_forward`` applies to the units; the root keeps torch's default (not
    resharded after forward: backward needs it first).
    """
    from torch.distributed.fsdp import fully_shard

    if mesh is None:
        raise ValueError(
            "mesh=None: FSDP2 needs an explicit device mesh to shard over (on CPU/gloo it "
            "cannot infer one: pytorch #132471); pass "
            "mesh=torch.distributed.device_mesh.init_device_mesh('cpu', (world_size,))"
        )
    mp = mixed_precision_policy(mixed_precision)
    for unit in shard_units(model, modules):
        fully_shard(unit, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def sync_over_mesh(model: nn.Module, mesh: Any) -> None:
    """Give every rank of ``mesh`` the weights of its first rank: a broadcast within each
    dimension's groups, outer dimension first (after the outer step every rank holds its
    row's first weights, after the inner one the mesh's first). None: the whole world."""
    import torch.distributed as tdist

    if mesh is None or (mesh.ndim == 1 and mesh.size() == tdist.get_world_size()):
        comm.sync_module_states(model)
        return
    names = mesh.mesh_dim_names or tuple(range(mesh.ndim))
    for dim in names:
        group = mesh.get_group(dim)
        comm.sync_module_states(model, src=tdist.get_global_rank(group, 0), group=group)


class FSDP2(Strategy):
    """torch FSDP2 over a 1-D mesh; bytes counted by ``CollectiveSpy`` (see the worker).

    Args:
        mesh: the device mesh to shard over (required).
        mesh_dim: the dimension(s) of ``mesh`` to shard over, by name ("dp", or
            ("replicate", "shard") for HSDP); None: the whole mesh. Rank 0's weights are
            broadcast within those dimensions only.
        modules: the units to shard (a list or a policy; see ``shard_units``).
        mixed_precision: None or "bf16" (``mixed_precision_policy``).
        reshard_after_forward: False keeps every unit unsharded from forward to backward.
    """

    name = "fsdp2"
    counting = "intercepted c10d collectives (CollectiveSpy dispatch mode)"

    def __init__(
        self,
        world_size: int,
        backend: str = "gloo",
        mesh: Any = None,
        *,
        mesh_dim: str | tuple[str, ...] | None = None,
        modules: Units = None,
        mixed_precision: str | None = None,
        reshard_after_forward: bool = True,
    ) -> None:
        if mesh is not None and mesh_dim is not None:
            mesh = mesh[mesh_dim]
        super().__init__(world_size, backend)
        if mixed_precision not in MIXED_PRECISION:
            raise ValueError(f"mixed_precision={mixed_precision!r}: use one of {MIXED_PRECISION}")
        self.mesh = mesh
        self.modules = modules
        self.mixed_precision = mixed_precision
        self.reshard_after_forward = reshard_after_forward
        self.model: nn.Module | None = None

    def wrap(self, model: nn.Module) -> nn.Module:
        # Before sharding: fully_shard keeps each rank's slice of its *own* weights.
        sync_over_mesh(model, self.mesh)
        self.model = apply_fsdp2(
            model,
            self.mesh,
            modules=self.modules,
            mixed_precision=self.mixed_precision,
            reshard_after_forward=self.reshard_after_forward,
        )
        return self.model

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:  # type: ignore[override]
        """Skip the gradient reduce-scatter: unsharded gradients accumulate locally."""
        assert self.model is not None, "wrap() the model first"
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)
