"""Notebook 03's ``03.f_and_g``: a tensor-parallel MLP from Megatron's f and g.

The learner's ``Enter`` and ``Leave`` (``torch.autograd.Function`` classes) and
``TensorParallelMLP(mlp, rank, world_size)``, one rank's shards of a ``labkit.model.MLP``. In
the kernel every rank's shards are compared for 2, 3 and 4 ranks with those of the course's own
layers (:class:`labkit.parallel.tensor.ColumnParallelLinear`, ``RowParallelLinear``); in
the ranks the f and g carry a bare MLP of the check's own, then the learner's module's output,
input gradient and shard gradients are compared with the unsplit MLP's, each usual mistake
(a bias counted on every rank, g or f missing, exact GELU) named.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from labkit.course.exercises import (
    ExerciseFailed,
    call,
    exercise,
    rank_checks,
    short_repr,
)
from labkit.course.exercises.rank_checks import tensors_close

# --------------------------------------------------------------------------- 03.f_and_g

# The check has two parts. First the learner's f and g alone, in a bare column-then-row MLP
# of the check's own (so a wrong f or g is named as such); then the learner's
# TensorParallelMLP, which must slice a labkit.model.MLP and call f and g itself.

FG_SHAPE = (2, 3, 8)  # x: (B, T, h); the MLP is h -> 2h -> h, split over the 2h hidden units


def _fg_case(device: torch.device) -> dict[str, torch.Tensor]:
    """The same x, weights and output gradient on every rank (seeded), in float64."""
    g = torch.Generator().manual_seed(3)
    B, T, h = FG_SHAPE
    kw = {"generator": g, "dtype": torch.float64}
    case = {
        "x": torch.randn(B, T, h, **kw),
        "w1": torch.randn(2 * h, h, **kw) / h**0.5,  # fc: (out, in), split by rows (columns of A)
        "b1": torch.randn(2 * h, **kw),
        "w2": torch.randn(h, 2 * h, **kw) / h**0.5,  # proj: split by columns (rows of B)
        "b2": torch.randn(h, **kw),
        "grad_out": torch.randn(B, T, h, **kw),
    }
    return {k: v.to(device) for k, v in case.items()}


def _mlp(case: dict[str, torch.Tensor], rows: slice, enter: Callable, leave: Callable) -> dict:
    """A column-then-row-parallel MLP over the hidden units ``rows``: y = g(gelu(f(x) W1ᵀ) W2ᵀ)."""
    x = case["x"].clone().requires_grad_()
    w1 = case["w1"][rows].clone().requires_grad_()
    b1 = case["b1"][rows].clone().requires_grad_()
    w2 = case["w2"][:, rows].clone().requires_grad_()
    hidden = torch.nn.functional.gelu(enter(x) @ w1.T + b1)  # (B, T, 2h/n): this rank's units
    y = leave(hidden @ w2.T) + case["b2"]  # (B, T, h): partial sums, completed by g
    y.backward(case["grad_out"])
    return {"out": y.detach(), "x_grad": x.grad, "w1_grad": w1.grad, "w2_grad": w2.grad}


def fg_diagnosis(got: dict, ref: dict, local: dict, n: int) -> str | None:
    """None if ``got`` (the learner's f and g) equals ``ref`` (the whole MLP); else the likely
    mistake. ``local`` is this rank's MLP with no communication at all (f and g identities)."""
    if not tensors_close(got["out"], ref["out"]):
        if tensors_close(got["out"], local["out"]):
            return ("the output is this rank's partial sum: g's forward must all-reduce (sum) "
                    "its input across ranks")  # fmt: skip
        return ("the output differs from the unsplit MLP's: check what each forward does "
                "with a tensor every rank holds in full, and with one it holds a part of")  # fmt: skip
    if tensors_close(got["w2_grad"], n * ref["w2_grad"]):
        return (f"the weight gradients are {n}× too large: g's backward must return the gradient "
                "unchanged (the gradient of a sum with respect to each term is the gradient "
                "of the sum), not all-reduce it")  # fmt: skip
    if not tensors_close(got["x_grad"], ref["x_grad"]):
        if tensors_close(got["x_grad"], local["x_grad"]):
            return ("x.grad holds only this rank's part of dL/dx: f's backward must all-reduce "
                    "(sum) the gradient, since every rank's slice of the weights used x")  # fmt: skip
        return ("x.grad differs from the unsplit MLP's: check f's backward against the sum "
                "of every rank's part of dL/dx")  # fmt: skip
    for key in ("w1_grad", "w2_grad"):
        if not tensors_close(got[key], ref[key]):
            return f"{key} differs from the unsplit MLP's slice"
    return None


def _check_f_and_g(ctx: Any, enter: Any, leave: Any) -> None:
    """On a rank: the learner's f and g carry the check's own bare MLP (raises ExerciseFailed)."""
    n, r = ctx.world_size, ctx.rank
    for cls, role in ((enter, "f (Enter)"), (leave, "g (Leave)")):
        if not (isinstance(cls, type) and issubclass(cls, torch.autograd.Function)):
            raise ExerciseFailed(f"{role} is {cls!r}: subclass torch.autograd.Function")
    case = _fg_case(ctx.device)
    h2 = case["w1"].shape[0]
    rows = slice(r * h2 // n, (r + 1) * h2 // n)
    got = _mlp(case, rows, enter.apply, leave.apply)
    ref = _mlp(case, slice(None), lambda t: t, lambda t: t)  # the unsplit MLP, on this rank
    ref = {**ref, "w1_grad": ref["w1_grad"][rows], "w2_grad": ref["w2_grad"][:, rows]}
    local = _mlp(case, rows, lambda t: t, lambda t: t)
    why = fg_diagnosis(got, ref, local, n)
    if why:
        raise ExerciseFailed(f"your f and g, tried on a bare column-then-row MLP: Likely: {why}")


# The learner's TensorParallelMLP slices a labkit.model.MLP with d_model 12: 48 hidden units
# split over 2, 3 and 4 ranks, and an input size (12) that 2, 3 and 4 divide too, so a slice
# of the wrong dimension gives a shape of its own. Float32, as labkit's model is (a learner's
# nn.Linear shards are float32 by default); every mistake below moves the output by far more
# than TP_TOL.
TP_MODEL = {"d_model": 12, "n_head": 2, "n_layer": 1, "seq_len": 3}
TP_BATCH = 2
TP_WORLD_SIZES = (2, 3, 4)  # every rank of each, in the kernel
TP_TOL = 1e-5
SHARDS = ("fc.weight", "fc.bias", "proj.weight", "proj.bias")

# What a slice that does not fit its layer most likely got wrong: a diagnosis (which features
# were cut), never the indexing that fixes it (review N02-8).
FC_MISFIT = ("the slice copied into fc does not have the shape of fc's weight: was it cut along "
             "fc's input features, which every rank keeps whole, instead of its output "
             "features, the hidden units?")  # fmt: skip
PROJ_MISFIT = ("the slice copied into proj does not have the shape of proj's weight: was it cut "
               "along proj's output features, which every rank computes in full, instead of its "
               "input features, the hidden units?")  # fmt: skip


def _weight_shape_diagnosis(layer: str, got: tuple[int, ...], h: int, k: int) -> str:
    """Which of a sharded weight's two dimensions holds the wrong features, and what they are.

    fc (column-parallel) keeps k of its output features (the hidden units) and all h inputs;
    proj (row-parallel) keeps all h outputs and k of its input features (the same units)."""
    if len(got) != 2:
        return "a Linear layer's weight has two dimensions"
    out_dim, in_dim = got
    if layer == "fc":
        parts = ([f"its first dimension holds {out_dim}, not this rank's {k} hidden units (fc's "
                  "output features)"] * (out_dim != k)
                 + [f"its second dimension holds {in_dim} of fc's {h} input features, which "
                    "every rank keeps whole"] * (in_dim != h))  # fmt: skip
        return "column-parallel fc holds the wrong features: " + "; ".join(parts)
    parts = ([f"its first dimension holds {out_dim} of proj's {h} output features, which every "
              "rank computes in full (a partial sum of each)"] * (out_dim != h)
             + [f"its second dimension holds {in_dim}, not this rank's {k} hidden units (proj's "
                "input features)"] * (in_dim != k))  # fmt: skip
    return "row-parallel proj holds the wrong features: " + "; ".join(parts)


def tp_mlp_case(device: Any = "cpu") -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """(a labkit.model.MLP, x, dL/dy): seeded, the same on every rank, float32.

    The weights and biases are redrawn at unit scale: with nn.Linear's small default init a
    bias counted twice would still move the output visibly, but less plainly.
    """
    from labkit.config import ModelConfig
    from labkit.model import MLP

    cfg = ModelConfig(**TP_MODEL)
    g = torch.Generator().manual_seed(7)
    mlp = MLP(cfg)
    with torch.no_grad():
        for lin in (mlp.fc, mlp.proj):
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) / lin.in_features**0.5)
            lin.bias.copy_(torch.randn(lin.bias.shape, generator=g))
    x = torch.randn(TP_BATCH, cfg.seq_len, cfg.d_model, generator=g)
    grad_out = torch.randn(TP_BATCH, cfg.seq_len, cfg.d_model, generator=g)
    return mlp.to(device), x.to(device), grad_out.to(device)


def reference_shards(mlp: torch.nn.Module, rank: int, n: int) -> dict[str, torch.Tensor]:
    """What rank ``rank`` of ``n`` holds, by the course's own layers (labkit.parallel.tensor)."""
    from labkit.parallel.tensor import ColumnParallelLinear, RowParallelLinear

    fc = ColumnParallelLinear.from_linear(mlp.fc, world_size=n, rank=rank, copy_input=False)
    proj = RowParallelLinear.from_linear(mlp.proj, world_size=n, rank=rank)
    return {"fc.weight": fc.weight, "fc.bias": fc.bias,
            "proj.weight": proj.weight, "proj.bias": proj.bias}  # fmt: skip


def _shard(module: torch.nn.Module, name: str) -> Any:
    obj: Any = module
    for part in name.split("."):
        obj = getattr(obj, part, None)
    return obj


def shard_diagnosis(module: torch.nn.Module, mlp: torch.nn.Module, rank: int, n: int) -> str | None:
    """None if ``module`` holds exactly rank ``rank`` of ``n``'s shards of ``mlp``; else the
    likely mistake (shapes first, then values, then anything held besides the shards)."""
    h, hidden = mlp.fc.in_features, mlp.fc.out_features
    k = hidden // n
    want = reference_shards(mlp, rank, n)
    got = {name: _shard(module, name) for name in SHARDS}
    params = {id(p) for p in module.parameters()}
    for name in SHARDS:
        t = got[name]
        if not isinstance(t, torch.Tensor):
            layer = name.split(".")[0]
            return (f"your module has no {name}: the check looks for this rank's shard of "
                    f"mlp.{layer} in a Linear layer your module keeps under the name {layer}, "
                    "as labkit.model.MLP names it")  # fmt: skip
        if id(t) not in params:
            return (f"{name} is not a parameter of your module (a plain tensor, or a buffer?): "
                    "autograd keeps no gradient for it, and an optimizer never sees it")  # fmt: skip
        if not t.requires_grad:
            return (f"{name} does not require a gradient, so it would never be trained: a "
                    "shard is trained like the weight it came from")  # fmt: skip
    shape = {name: tuple(t.shape) for name, t in got.items()}
    if shape["fc.weight"] != (k, h):
        return (f"fc.weight has shape {shape['fc.weight']}, expected ({k}, {h}), (4h/n, h) for "
                f"{n} ranks: {_weight_shape_diagnosis('fc', shape['fc.weight'], h, k)}")  # fmt: skip
    if shape["fc.bias"] != (k,):
        return (f"fc.bias has shape {shape['fc.bias']}, expected ({k},): fc's bias has one "
                f"entry per output feature, and this rank keeps only its {k} hidden units'")  # fmt: skip
    if shape["proj.weight"] != (h, k):
        return (f"proj.weight has shape {shape['proj.weight']}, expected ({h}, {k}), (h, 4h/n) "
                f"for {n} ranks: "
                f"{_weight_shape_diagnosis('proj', shape['proj.weight'], h, k)}")  # fmt: skip
    if shape["proj.bias"] != (h,):
        return (f"proj.bias has shape {shape['proj.bias']}, expected ({h},): proj's bias "
                "belongs to the full output every rank holds after g, so it is not split")  # fmt: skip
    for name in SHARDS:
        if torch.equal(got[name].detach().cpu(), want[name].detach().cpu()):
            continue
        for other in range(n):
            if other != rank and torch.equal(got[name].detach().cpu(),
                                              reference_shards(mlp, other, n)[name].detach().cpu()):  # fmt: skip
                return (f"{name} holds rank {other}'s slice, not rank {rank}'s: its hidden "
                        "units start at another rank's")  # fmt: skip
        return (f"{name} holds other values than rank {rank}'s slice of mlp's {name}: not "
                "mlp's trained weights (a freshly initialised layer's?), or not the same "
                "hidden units")  # fmt: skip
    held = sum(p.numel() for p in module.parameters())
    shards = sum(t.numel() for t in got.values())
    if held != shards:
        return (f"your module holds {held} parameters, its shards {shards}: keep only this "
                "rank's slices (a rank that also keeps the whole MLP, or a copy of it, saves "
                "no memory, which is what tensor parallelism is for)")  # fmt: skip
    return None


def _line_in(err: BaseException, cls: Any) -> str:
    """The last line of ``err``'s traceback in the file that defines ``cls`` (the learner's)."""
    import inspect
    import traceback

    try:
        path = inspect.getsourcefile(cls)
    except TypeError:
        return ""
    lines = [f.line or "" for f in traceback.extract_tb(err.__traceback__) if f.filename == path]
    return lines[-1] if lines else ""


def _build(cls: Any, mlp: torch.nn.Module, rank: int, n: int) -> torch.nn.Module:
    """``cls(mlp, rank, n)`` on a copy of ``mlp`` (a learner's module may share its memory),
    with a construction error worded for this exercise."""
    import copy

    try:
        module = call(cls, copy.deepcopy(mlp), rank, n)
    except ExerciseFailed as err:
        cause, text = err.__cause__, str(err).rstrip(".")
        line = _line_in(cause, cls) if cause is not None else ""
        if line and " (at " not in text:  # labkit's learner_frame skips paths with /labkit/ in
            text += f" (at your line: {line})"  # them, and the workspace is ~/.cache/labkit/...
        if cause is not None and "process group" in str(cause):
            text += (". Likely: the rank or the world size came from the process group, not "
                     "from the rank and world_size arguments: the check builds every rank's "
                     "shards here, outside any process group")  # fmt: skip
        elif isinstance(cause, RuntimeError) and "size" in str(cause):
            fc, proj = "fc" in line, "proj" in line
            split = FC_MISFIT if fc and not proj else PROJ_MISFIT if proj and not fc else (
                f"{FC_MISFIT} Or {PROJ_MISFIT[0].lower() + PROJ_MISFIT[1:]}")  # fmt: skip
            text += f". Likely: a slice does not fit its layer: {split}"
        raise ExerciseFailed(text) from cause
    if not isinstance(module, torch.nn.Module):
        raise ExerciseFailed(f"TensorParallelMLP(...) made a {type(module).__name__}, not a module")
    return module


def check_tp_shards(cls: Any) -> str:
    """In the kernel: every rank's shards for each of TP_WORLD_SIZES (no collectives needed)."""
    if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
        raise ExerciseFailed(
            f"TensorParallelMLP is {cls!r}: define it as a class, a subclass of torch.nn.Module"
        )
    mlp, _, _ = tp_mlp_case()
    for n in TP_WORLD_SIZES:
        for r in range(n):
            why = shard_diagnosis(_build(cls, mlp, r, n), mlp, r, n)
            if why:
                raise ExerciseFailed(
                    f"TensorParallelMLP(mlp, rank={r}, world_size={n}): Likely: {why}"
                )
    return ", ".join(map(str, TP_WORLD_SIZES))


def _tp_forward_backward(module: Any, x: torch.Tensor, grad_out: torch.Tensor) -> dict[str, Any]:
    x = x.clone().requires_grad_()
    out = module(x)
    if not isinstance(out, torch.Tensor) or out.shape != grad_out.shape:
        # every rank runs the same code, so every rank stops here alike, before a collective
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ExerciseFailed(
            f"forward returned {shape}, expected a tensor of x's shape {tuple(x.shape)}: after "
            "g every rank holds the whole output"
        )
    out.backward(grad_out)
    return {"out": out.detach(), "x_grad": x.grad}


def tp_mlp_diagnosis(
    got: dict[str, Any],
    ref: dict[str, Any],
    mlp: torch.nn.Module,
    x: torch.Tensor,
    rank: int,
    n: int,
) -> str | None:
    """None if the learner's rank output, input gradients (``got["x_grads"]``, every rank's)
    and shard gradients (``got["grads"]``) match the unsplit MLP (``ref``); else the mistake."""
    import torch.nn.functional as F

    def close(a: Any, b: torch.Tensor) -> bool:
        return (isinstance(a, torch.Tensor) and a.shape == b.shape
                and torch.allclose(a, b, atol=TP_TOL, rtol=TP_TOL))  # fmt: skip

    shard = reference_shards(mlp, rank, n)
    with torch.no_grad():
        hidden = F.gelu(F.linear(x, shard["fc.weight"], shard["fc.bias"]), approximate="tanh")
        partial = F.linear(hidden, shard["proj.weight"])  # this rank's term of the sum
        exact = F.linear(F.gelu(mlp.fc(x)), mlp.proj.weight, mlp.proj.bias)  # GELU without tanh
    bias = mlp.proj.bias.detach()
    if not close(got["out"], ref["out"]):
        if close(got["out"], ref["out"] + (n - 1) * bias):
            return (f"the output is off by (world_size − 1) × proj.bias, here {n - 1} × "
                    f"proj.bias: the bias is added on every rank before g sums the ranks' "
                    f"outputs, so the sum counts it {n} times")  # fmt: skip
        if close(got["out"], partial + bias) or close(got["out"], partial):
            return ("the output is this rank's partial sum, not the whole MLP's: g is missing, "
                    "so nothing summed the ranks' partial outputs after proj")  # fmt: skip
        if close(got["out"], exact):
            return ("the output is the MLP's with exact GELU: labkit.model.MLP uses GELU's tanh "
                    "approximation")  # fmt: skip
        return ("the output differs from the unsplit MLP's, and not as a bias counted on every "
                "rank, a missing g or the exact GELU would make it: compare each step of your "
                "forward with labkit.model.MLP's")  # fmt: skip
    x_grads = got["x_grads"]
    if any(g is None for g in x_grads):
        return ("x received no gradient on some rank: the forward must compute the output from "
                "x (through f), not from a detached copy")  # fmt: skip
    if not all(close(g, x_grads[0]) for g in x_grads) or not close(x_grads[rank], ref["x_grad"]):
        return ("the input gradients differ across ranks: each holds only its own part of "
                "dL/dx, the part its slice of fc produced, so f is missing: nothing on the way "
                "in sums those parts in the backward pass")  # fmt: skip
    for name in SHARDS:
        layer, kind = name.split(".")
        want = getattr(getattr(mlp, layer), kind).grad
        if layer == "fc":
            want = want[rank * want.shape[0] // n : (rank + 1) * want.shape[0] // n]
        elif kind == "weight":
            want = want[:, rank * want.shape[1] // n : (rank + 1) * want.shape[1] // n]
        g = got["grads"][name]
        if g is None:
            return (f"{name} received no gradient: the output was not computed from your "
                    f"module's own {name} (a detached copy of it, or mlp's?)")  # fmt: skip
        if not close(g, want):
            return f"{name}.grad differs from the matching slice of the unsplit MLP's gradient"
    return None


def _rank_f_and_g(ctx: Any, enter: Any, leave: Any, tp_mlp: Any) -> str:
    import copy

    import torch.distributed as tdist

    n, r = ctx.world_size, ctx.rank
    _check_f_and_g(ctx, enter, leave)
    mlp, x, grad_out = tp_mlp_case(ctx.device)
    module = _build(tp_mlp, mlp, r, n)
    got = _tp_forward_backward(module, x, grad_out)
    x_grads: list[Any] = [None] * n  # every rank's dL/dx, gathered before any verdict
    tdist.all_gather_object(x_grads, None if got["x_grad"] is None else got["x_grad"].cpu())
    got["x_grads"] = [g if g is None else g.to(ctx.device) for g in x_grads]
    got["grads"] = {name: _shard(module, name).grad for name in SHARDS}
    whole = copy.deepcopy(mlp)
    ref = _tp_forward_backward(whole, x, grad_out)
    why = tp_mlp_diagnosis(got, ref, whole, x, r, n)
    if why:
        raise ExerciseFailed(f"your TensorParallelMLP: Likely: {why}")
    return (f"your TensorParallelMLP, with your f and g, on {n} ranks: the output, dL/dx (the "
            "same on every rank) and every shard's weight and bias gradient equal the unsplit "
            "MLP's")  # fmt: skip


def _probe_backward(cls: Any, role: str) -> None:
    """In the kernel: report a stub at once, without launching (other errors are left to the
    ranks: outside a process group ``all_reduce`` cannot run here)."""
    if not (isinstance(cls, type) and issubclass(cls, torch.autograd.Function)):
        raise ExerciseFailed(
            f"{role} is {cls!r}: pass the class itself, a subclass of torch.autograd.Function"
        )
    t = torch.ones(2, dtype=torch.float64)

    class _Ctx:  # what autograd passes as ctx, enough for a forward that saves nothing
        def save_for_backward(self, *args: Any) -> None:
            self.saved_tensors = args

    for method in (cls.forward, cls.backward):
        try:
            method(_Ctx(), t)
        except NotImplementedError:
            raise
        except Exception:  # e.g. no process group in the kernel: the ranks will tell
            pass


@exercise(
    "03.f_and_g",
    "A tensor-parallel MLP from Megatron's f and g",
    hints=(
        "f and g are conjugates: where one communicates in the forward pass the other "
        "communicates in the backward pass; ask which quantities each rank already holds in "
        "full and which it holds only a part of. The MLP's hidden units are what the ranks "
        "share out: fc makes them, proj reads them",
        "before the column-parallel layer every rank has all of x, but each computes only part "
        "of dL/dx; after the row-parallel layer each rank has a partial sum of the output, and "
        "the gradient of a sum is passed to every term unchanged",
        "nn.Linear stores weight as (out_features, in_features): the hidden units are fc's "
        "output features (rows of its weight, entries of its bias) and proj's input features "
        "(columns of its weight); rank r keeps units r·k to (r + 1)·k, with k = 4h / world_size",
        "proj's bias belongs to the whole output, which exists only after g has summed the "
        "ranks' partial outputs: a bias added on every rank before g is counted world_size "
        "times. Keep it whole, and add it once, after g",
        "recipe: f's forward hands its input on unchanged and its backward sums the incoming "
        "gradient over the ranks; g's forward sums its input over the ranks and its backward "
        "hands the gradient on unchanged (the all-reduce works in place: give it a copy). In "
        "__init__, make fc a Linear layer from h inputs to this rank's k hidden units and proj "
        "one from those k units back to h; copy into them, without autograd recording the "
        "copies, fc's rows and bias entries for this rank's units, proj's columns for the same "
        "units, and proj's whole bias. In forward: f on the input, this rank's fc, GELU with "
        "the tanh approximation, proj's weight without its bias, g, and last proj's bias, "
        "added once",
    ),
)
def _verify_f_and_g(answer: Any) -> str:
    if not (isinstance(answer, (tuple, list)) and len(answer) == 3):
        raise ExerciseFailed(
            f"expected (Enter, Leave, TensorParallelMLP), three classes, got {short_repr(answer)}"
        )
    _probe_backward(answer[0], "f (Enter)")
    _probe_backward(answer[1], "g (Leave)")
    sizes = check_tp_shards(answer[2])
    said = rank_checks.run_in_workers("03.f_and_g", list(answer))
    return f"every rank's shards are right for world sizes {sizes}; {said}"


RANK_CHECKS: dict[str, Callable[..., str]] = {"03.f_and_g": _rank_f_and_g}
"""This exercise's rank-side check, for :func:`labkit.course.exercises.model_parallel.rank_check`."""
