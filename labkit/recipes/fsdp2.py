"""The independent check: PyTorch's FSDP2 with a ``MixedPrecisionPolicy``, counted from what torch
holds (:func:`measure_fsdp2`), then held against a recipe part by part (:func:`compare_fsdp2`).

Independent of :mod:`labkit.recipes.measured` on purpose: nothing here is built from the recipe's
fields, so an agreement says the recipe describes what torch really does.
"""

from __future__ import annotations

import copy
import gc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from labkit.formulas import (
    dtype_name,
    predicted_breakdown,
)
from labkit.memory import storage_bytes
from labkit.recipes.recipe import Recipe, recipe_dtype
from labkit.train import DTYPES, Batch

if TYPE_CHECKING:  # a type only: nothing here is built from measure_recipe's counts
    from labkit.recipes.measured import RecipeMeasurement

FSDP2_PARTS = ("parameters", "gradients", "optimizer_state", "other")
"""What :func:`measure_fsdp2` counts after the step: the sharded parameters the optimizer steps,
their gradients, the optimizer's state, and every other tensor storage that appeared during the
run and is still alive (a master copy or a buffer FSDP2 kept would land there)."""


def _live_storages() -> dict[int, tuple[torch.UntypedStorage, torch.dtype]]:
    """Every tensor storage that Python's garbage collector can see, by address (bytes > 0),
    with the dtype of the first tensor seen on it.

    ``gc.get_objects`` lists every object the collector tracks, and tensors are tracked; a
    DTensor is skipped (its local tensor is an object of its own and is counted instead), and
    so is a tensor whose storage cannot be read (a FakeTensor that torch.compile left alive).
    """
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor
    from torch.distributed.tensor import DTensor

    unreal = (DTensor, FakeTensor, FunctionalTensor)  # no storage of their own to count
    found: dict[int, tuple[torch.UntypedStorage, torch.dtype]] = {}
    counted: dict[type, bool] = {}  # per type, not per object: the walk sees ~10^5 objects
    for o in gc.get_objects():
        kind = type(o)  # type(), not isinstance: some torch objects warn when asked __class__
        take = counted.get(kind)
        if take is None:
            take = counted[kind] = issubclass(kind, torch.Tensor) and not issubclass(kind, unreal)
        if not take or o.is_meta or o.is_sparse or o.is_nested:
            continue
        try:
            storage = o.untyped_storage()
            if storage.nbytes():
                found.setdefault(storage.data_ptr(), (storage, o.dtype))
        except (RuntimeError, NotImplementedError):
            # a tensor with no real storage behind it (a FakeTensor left by torch.compile in
            # this process, a wrapper subclass): it holds no memory to count
            continue
    return found


def _torch_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _reachable_tensors(roots: Sequence[object]) -> list[tuple[torch.Tensor, bool]]:
    """The tensors reachable from ``roots`` through Python references (``gc.get_referents``):
    attributes, containers, bound methods and partials; not through functions, classes or
    modules (whose globals reach everything). A tensor's ``.grad`` and a DTensor's local tensor
    are followed too. Each comes with whether it was reached as the ``.grad`` of a plain
    (unsharded) tensor."""
    import types

    from torch.distributed.tensor import DTensor

    opaque = (types.FunctionType, types.BuiltinFunctionType, types.ModuleType, types.CodeType,
              types.FrameType, type, str, bytes, int, float)  # fmt: skip
    seen: set[int] = set()
    tensors: list[tuple[torch.Tensor, bool]] = []
    stack: list[tuple[object, bool]] = [(r, False) for r in roots]
    while stack:
        o, is_grad = stack.pop()
        if id(o) in seen or isinstance(o, opaque):
            continue
        seen.add(id(o))
        if issubclass(type(o), torch.Tensor):
            sharded = issubclass(type(o), DTensor)
            if sharded:
                stack.append((o._local_tensor, is_grad))
            else:
                tensors.append((o, is_grad))
            if o.grad is not None:
                stack.append((o.grad, not sharded))
        stack.extend((r, False) for r in gc.get_referents(o))
    return tensors


@dataclass(frozen=True)
class FSDP2Measurement:
    """One real training step under FSDP2 (``fully_shard`` with a ``MixedPrecisionPolicy``),
    counted from the tensors torch holds, not from a :class:`Recipe`."""

    param_dtype: str
    reduce_dtype: str
    world_size: int
    n_local: int
    """Elements of this rank's shards of the parameters (all of them at world size 1)."""
    persistent: dict[str, int]
    """Bytes alive on this rank after the step, by :data:`FSDP2_PARTS`."""
    dtypes: dict[str, tuple[str, ...]]
    """The dtypes seen in each part."""
    step_counters: int
    """Bytes of the optimizer's scalar step counters (per tensor, not per parameter)."""
    gathered_params: int
    """At the moment of the step when the model held the most ``param_dtype`` bytes (forward or
    backward, looked at between units): the bytes of the unsharded parameters FSDP2 had
    all-gathered, its transient 16-bit copies."""
    gathered_grads: int
    """At that moment, the bytes of the gradients autograd had made on those unsharded
    parameters and FSDP2 had not yet reduce-scattered."""
    gathered_where: str
    """Where in the step that moment was."""
    unsharded_grad_dtypes: tuple[str, ...]
    """The dtypes of the gradients autograd left on the unsharded parameters in the backward."""

    @property
    def bytes_per_param(self) -> float:
        """Persistent bytes per parameter of this rank's shard (step counters excluded)."""
        return sum(self.persistent.values()) / self.n_local

    def per_param(self) -> dict[str, float]:
        """Bytes per parameter of each part, then the transient peak."""
        out = {k: v / self.n_local for k, v in self.persistent.items()}
        out["total (persistent)"] = self.bytes_per_param
        out[f"{self.param_dtype} gathered params at peak (transient)"] = (
            self.gathered_params / self.n_local
        )
        out["their gradients at peak (transient)"] = self.gathered_grads / self.n_local
        return out


def measure_fsdp2(
    model: nn.Module,
    batches: Sequence[Batch],
    *,
    param_dtype: str = "bfloat16",
    reduce_dtype: str = "float32",
    units: Sequence[str] = ("blocks",),
) -> FSDP2Measurement:
    """Train a copy of ``model`` for ONE real step with FSDP2 on the CPU and count what it holds.

    The copy's submodules in each ``ModuleList`` attribute named in ``units`` (a GPT's blocks)
    and then the copy itself get ``fully_shard(..., mp_policy=MixedPrecisionPolicy(param_dtype,
    reduce_dtype))``, as the FSDP2 tutorial wraps a transformer; AdamW steps the sharded
    parameters; one forward and backward per micro-batch in ``batches``. Runs in the current
    process group if there is one (gloo, CPU tensors), else in a one-rank gloo group made for
    this call and destroyed after it.

    Nothing here comes from a recipe. After the step, every tensor storage alive that was not
    alive before the copy was made (``gc.get_objects``, each storage once) is counted, and put in
    :data:`FSDP2_PARTS` by which object holds it: the model's parameters (their local shards),
    those parameters' ``.grad``, the optimizer's state, or none of these ("other"). During the
    forward (before each unit) and the backward (when each unit's input gradient is ready), the
    tensors of ``param_dtype`` reachable from the model are added up (:func:`_reachable_tensors`).
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor

    if not batches:
        raise ValueError("batches is empty: pass one (x, y) pair per micro-batch")
    low, reduce = DTYPES[recipe_dtype("param_dtype", param_dtype)], \
        DTYPES[recipe_dtype("reduce_dtype", reduce_dtype)]  # fmt: skip
    own_group = not dist.is_initialized()
    before = _live_storages()  # held until the count: no address is reused meanwhile
    if own_group:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        world = dist.get_world_size()
        mesh = init_device_mesh("cpu", (world,))
        policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=reduce)
        model = copy.deepcopy(model).to(device="cpu", dtype=torch.float32).train()
        wrapped: list[nn.Module] = []
        for name in units:
            for unit in getattr(model, name):
                fully_shard(unit, mesh=mesh, mp_policy=policy)
                wrapped.append(unit)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

        peak: list = [0, 0, "before any unit"]
        grad_dtypes: set[str] = set()

        def look(where: str) -> None:
            held = _reachable_tensors([model])
            grad_dtypes.update(_torch_name(t.dtype) for t, is_grad in held if is_grad)
            params_b = storage_bytes(t for t, is_grad in held if t.dtype == low and not is_grad)
            grads_b = storage_bytes(t for t, is_grad in held if t.dtype == low and is_grad)
            if params_b + grads_b > sum(peak[:2]):
                peak[:] = [params_b, grads_b, where]

        def pre_forward(i: int):
            def hook(module: nn.Module, args: tuple) -> None:
                look(f"forward, entering unit {i}")
                if args and isinstance(args[0], torch.Tensor) and args[0].requires_grad:
                    args[0].register_hook(lambda g: look(f"backward, unit {i} done"))

            return hook

        handles = [u.register_forward_pre_hook(pre_forward(i)) for i, u in enumerate(wrapped)]
        for x, y in batches:
            _, loss = model(x, y)
            (loss / len(batches)).backward()
            del loss, _
        for h in handles:
            h.remove()
        optimizer.step()

        params = list(model.parameters())
        local = [p.to_local() if isinstance(p, DTensor) else p for p in params]
        grads = [g.to_local() if isinstance(g, DTensor) else g
                 for g in (p.grad for p in params) if g is not None]  # fmt: skip
        states = [v.to_local() if isinstance(v, DTensor) else v
                  for s in optimizer.state.values() for v in s.values()
                  if isinstance(v, torch.Tensor)]  # fmt: skip
        owner: dict[int, str] = {}
        for part, tensors in (("parameters", local), ("gradients", grads),
                              ("optimizer_state", [t for t in states if t.dim() > 0])):  # fmt: skip
            for t in tensors:
                owner.setdefault(t.untyped_storage().data_ptr(), part)
        counters = {t.untyped_storage().data_ptr() for t in states if t.dim() == 0}
        persistent = dict.fromkeys(FSDP2_PARTS, 0)
        dtypes: dict[str, set[str]] = {part: set() for part in FSDP2_PARTS}
        step_counters = 0
        for ptr, (storage, dtype) in _live_storages().items():
            if ptr in before:
                continue
            if ptr in counters:
                step_counters += storage.nbytes()
                continue
            part = owner.get(ptr, "other")
            persistent[part] += storage.nbytes()
            dtypes[part].add(dtype)
        return FSDP2Measurement(
            param_dtype=dtype_name(low), reduce_dtype=dtype_name(reduce), world_size=world,
            n_local=sum(t.numel() for t in local), persistent=persistent,
            dtypes={k: tuple(sorted(map(_torch_name, v))) for k, v in dtypes.items()},
            step_counters=step_counters, gathered_params=peak[0], gathered_grads=peak[1],
            gathered_where=peak[2],
            unsharded_grad_dtypes=tuple(sorted(grad_dtypes)))  # fmt: skip
    finally:
        del before
        if own_group:
            dist.destroy_process_group()


@dataclass(frozen=True)
class FSDP2Comparison:
    """An FSDP2 measurement held against one recipe's prediction, part by part.

    The recipe's master copy and gradient buffer are compared with the measurement's "other"
    (FSDP2 keeps neither as such: a copy it kept would be counted there). A part agrees when its
    bytes per parameter are within ``tolerance`` and, where it holds bytes, its dtypes are the
    recipe's.
    """

    recipe: Recipe
    measured: dict[str, float]
    """Bytes per parameter by :data:`FSDP2_PARTS`."""
    measured_dtypes: dict[str, tuple[str, ...]]
    predicted: dict[str, float]
    """The recipe's bytes per parameter by :data:`FSDP2_PARTS` ("other": master + buffer)."""
    predicted_dtypes: dict[str, tuple[str, ...]]
    tolerance: float

    @property
    def differing(self) -> list[str]:
        """The parts whose bytes or dtypes differ."""
        out = []
        for part in FSDP2_PARTS:
            m, p = self.measured[part], self.predicted[part]
            dtypes_differ = m > self.tolerance and p > 0 and \
                set(self.measured_dtypes[part]) != set(self.predicted_dtypes[part])  # fmt: skip
            if abs(m - p) > self.tolerance or dtypes_differ:
                out.append(part)
        return out

    @property
    def totals_agree(self) -> bool:
        return abs(sum(self.measured.values()) - sum(self.predicted.values())) <= self.tolerance

    def _part(self, part: str) -> str:
        def dt(names: tuple[str, ...]) -> str:
            return "/".join(_SHORT.get(n, n) for n in names) or "none"

        m, p = self.measured[part], self.predicted[part]
        held = f"{m:.2f}" + (f" {dt(self.measured_dtypes[part])}" if m > self.tolerance else "")
        want = f"{p:g}" + (f" {dt(self.predicted_dtypes[part])}" if p else "")
        return f"{part} {held} against {want}"

    def sentence(self) -> str:
        """The verdict, chosen by the comparison."""
        m, p = sum(self.measured.values()), sum(self.predicted.values())
        name = self.recipe.name
        if not self.differing:
            return (
                f"FSDP2 holds what {name} predicts, part by part: {m:.2f} bytes per parameter "
                f"against {p:g}, every part within {self.tolerance:g} B and in the "
                "predicted dtype."
            )
        parts = "; ".join(self._part(k) for k in self.differing)
        if self.totals_agree:
            return (
                f"The totals agree ({m:.2f} against {name}'s {p:g} bytes per parameter), "
                f"the parts do not: {parts}."
            )
        return f"FSDP2 holds {m:.2f} bytes per parameter where {name} predicts {p:g}: {parts}."


_SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def compare_fsdp2(measurement: FSDP2Measurement, recipe: Recipe, *,
                  tolerance: float = 0.05) -> FSDP2Comparison:  # fmt: skip
    """Hold ``measurement`` against ``recipe``'s predicted bytes per parameter, part by part.

    ``tolerance`` (bytes per parameter) absorbs the few small tensors a process group and a
    device mesh allocate ("other"); every other part is an exact count.
    """
    if tolerance < 0:
        raise ValueError(f"tolerance={tolerance!r} is not allowed: give bytes per parameter >= 0")
    b = predicted_breakdown(recipe)
    predicted = {"parameters": b["parameters"], "gradients": b["gradients"],
                 "optimizer_state": b["optimizer_state"],
                 "other": b["master"] + b["grad_buffer"]}  # fmt: skip
    extra = tuple(sorted({d for d in (recipe.master_dtype, recipe.grad_buffer_dtype) if d}))
    predicted_dtypes = {"parameters": (recipe.param_dtype,), "gradients": (recipe.grad_dtype,),
                        "optimizer_state": (recipe.state_dtype,) if b["optimizer_state"] else (),
                        "other": extra}  # fmt: skip
    measured = {k: v / measurement.n_local for k, v in measurement.persistent.items()}
    return FSDP2Comparison(recipe=recipe, measured=measured,
                           measured_dtypes=dict(measurement.dtypes), predicted=predicted,
                           predicted_dtypes=predicted_dtypes, tolerance=tolerance)  # fmt: skip


def describe_fsdp2(fsdp: FSDP2Measurement, recipes: Mapping[str, Recipe],
                   amp: RecipeMeasurement) -> str:
    """FSDP2's measured parts per parameter, held against each of ``recipes``; then its
    transient 16-bit weights at their peak against autocast's copies in ``amp`` (the AMP
    recipe measured by ``measure_recipe``), and which held fewer."""
    lines = [f"FSDP2, MixedPrecisionPolicy(param_dtype={fsdp.param_dtype}, reduce_dtype="
             f"{fsdp.reduce_dtype}), {fsdp.world_size} gloo rank on the CPU, one real step; every "
             "tensor storage alive after it, by what holds it (measured):"]
    for part in FSDP2_PARTS:
        held = fsdp.persistent[part]
        lines.append(f"  {part:<16}{held / fsdp.n_local:>6.2f} B per parameter  ({held:,} bytes; "
                     f"{', '.join(fsdp.dtypes[part]) or 'nothing'})")
    lines.append(f"  and AdamW's step counters, {fsdp.step_counters} bytes in all (one scalar per "
                 "tensor)")
    lines.extend(f"against {name}: {compare_fsdp2(fsdp, recipe).sentence()}"
                 for name, recipe in recipes.items())
    # Transient: bf16 weight copies at the moment each implementation held the most, per parameter.
    fsdp_copies, amp_copies = fsdp.gathered_params / fsdp.n_local, amp.autocast_copies / amp.n_params
    lines.append(
        f"\ntransient bf16 weights at their peak (measured): FSDP2 {fsdp_copies:.2f} B per "
        f"parameter ({fsdp.gathered_where}; with {fsdp.gathered_grads / fsdp.n_local:.2f} B per "
        f"parameter of {'/'.join(fsdp.unsharded_grad_dtypes)} gradients not yet "
        f"reduce-scattered), AMP {amp_copies:.2f} (autocast's copies, kept from forward to "
        "backward)")
    if abs(fsdp_copies - amp_copies) <= 0.05:
        lines.append("The two held the same bf16 weight bytes at their peaks.")
    else:
        fewer, more = ("FSDP2", "AMP") if fsdp_copies < amp_copies else ("AMP", "FSDP2")
        lines.append(f"{fewer} held fewer bf16 weight bytes at its peak than {more}.")
    return "\n".join(lines)
