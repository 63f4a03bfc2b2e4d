"""Notebook 03's ``03.column_parallel``: one rank's output features of a linear layer.

``column_parallel_linear(x, linear, rank, world_size)`` is checked in the kernel for every
rank of 2, 3 and 4 (the shard, then its gradient), then in 2 ranks, whose all-gathered shards
must equal ``linear(x)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from labkit.course.exercises import ExerciseFailed, call, exercise, rank_checks
from labkit.course.exercises.learner_code import callable_name, require_callable
from labkit.course.exercises.rank_checks import tensors_close

# --------------------------------------------------------------------------- 03.column_parallel

# Non-square first (nn.Linear's (out, in) layout then matters for the shapes), then square (a
# split of the wrong dimension gives the right shape and wrong values), both without and with
# a bias; out_features divisible by 2, 3 and 4.
COLUMN_CASES = ((16, 24, True), (12, 12, True), (16, 24, False))


def _column_case(in_f: int, out_f: int, bias: bool, device: Any = "cpu"):
    g = torch.Generator().manual_seed(in_f * 100 + out_f)
    lin = torch.nn.Linear(in_f, out_f, bias=bias, dtype=torch.float64)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(out_f, in_f, generator=g, dtype=torch.float64))
        if bias:
            lin.bias.copy_(torch.randn(out_f, generator=g, dtype=torch.float64))
    x = torch.randn(2, 3, in_f, generator=g, dtype=torch.float64)
    return lin.to(device), x.to(device)


def column_diagnosis(
    got: Any, x: torch.Tensor, lin: torch.nn.Linear, rank: int, n: int
) -> str | None:
    """None if ``got`` is rank ``rank``'s output columns of ``lin(x)``; else the likely mistake."""
    out_f, in_f = lin.out_features, lin.in_features
    per = out_f // n
    cols = slice(rank * per, (rank + 1) * per)
    if not isinstance(got, torch.Tensor):
        return f"returned {type(got).__name__}, not a tensor of shape (..., out_features/n)"
    with torch.no_grad():
        full = lin(x)
        want = full[..., cols]
        if got.shape != want.shape:
            if got.shape == full.shape:
                return (f"the output has all {out_f} features; a rank keeps only its {per} "
                        "(and the matching part of the bias)")  # fmt: skip
            return (f"shape {tuple(got.shape)}, expected {tuple(want.shape)}: a rank computes "
                    f"its share of the output features, {per} here (out_features divided by "
                    "world_size), for every input row")  # fmt: skip
        got = got.detach()
        if tensors_close(got, want):
            return None
        for other in range(n):
            o = slice(other * per, (other + 1) * per)
            if other != rank and tensors_close(got, full[..., o]):
                return f"that is rank {other}'s slice: its rows start at another rank's"
        if lin.bias is not None and tensors_close(got, want - lin.bias[cols]):
            return "the bias is missing: add this rank's slice of linear.bias"
        if in_f == out_f:  # square: a slice of the wrong dimension still has the right shape
            b = lin.bias[cols] if lin.bias is not None else 0
            if tensors_close(got, x @ lin.weight[:, cols] + b):
                return ("you sliced the input dimension of linear.weight: the shapes happen to "
                        "fit because the layer is square, but a rank's share is of the output "
                        "features")  # fmt: skip
    return "values differ from the same columns of linear(x)"


def _column_grad_problem(
    got: torch.Tensor, x: torch.Tensor, lin: torch.nn.Linear, rank: int, n: int
) -> str | None:
    """The shard must stay on autograd's graph, so the gradient reaches this rank's rows."""
    if not got.requires_grad:
        return ("the output is cut off from autograd (no gradient would reach linear.weight): "
                "it was computed from a detached copy of the weight, or with autograd off")  # fmt: skip
    lin.zero_grad(set_to_none=True)
    got.sum().backward()
    if lin.weight.grad is None:
        return ("no gradient reached linear.weight: compute with the layer's own parameter, "
                "not a detached copy")  # fmt: skip
    per = lin.out_features // n
    expected = torch.zeros_like(lin.weight)
    expected[rank * per : (rank + 1) * per] = x.reshape(-1, x.shape[-1]).sum(0)  # d(Σ y)/dW
    if not tensors_close(lin.weight.grad, expected):
        return "the gradient of linear.weight differs from that of linear(x)'s same columns"
    return None


def check_column(fn: Callable, rank: int, n: int, device: Any = "cpu") -> None:
    """Rank ``rank`` of ``n``: every COLUMN_CASES shard and its gradient; raises ExerciseFailed."""
    for in_f, out_f, bias in COLUMN_CASES:
        lin, x = _column_case(in_f, out_f, bias, device)
        text = (f"{callable_name(fn)}(x of shape {tuple(x.shape)}, nn.Linear({in_f}, {out_f}, "
                f"bias={bias}), rank={rank}, world_size={n})")  # fmt: skip
        try:
            got = call(fn, x, lin, rank, n)
        except ExerciseFailed as err:
            if isinstance(err.__cause__, RuntimeError):  # a shape mismatch, almost always
                raise ExerciseFailed(
                    f"{err}. Likely: the slice of linear.weight does not line up with x; "
                    "check which of its two dimensions holds the output features"
                ) from err.__cause__
            raise
        why = column_diagnosis(got, x, lin, rank, n) or _column_grad_problem(got, x, lin, rank, n)
        if why:
            raise ExerciseFailed(f"{text}: Likely: {why}")


def _rank_column_parallel(ctx: Any, fn: Callable) -> str:
    import torch.distributed as tdist

    n, r = ctx.world_size, ctx.rank
    check_column(fn, r, n, ctx.device)
    # The shards of all ranks, side by side, are the whole layer's output.
    lin, x = _column_case(*COLUMN_CASES[0], ctx.device)
    shard = fn(x, lin, r, n).detach().contiguous()
    parts = [torch.empty_like(shard) for _ in range(n)]
    tdist.all_gather(parts, shard)
    if not tensors_close(torch.cat(parts, dim=-1), lin(x).detach()):
        raise ExerciseFailed("the shards of all ranks, concatenated, differ from linear(x)")
    return (f"column_parallel_linear on {n} ranks: each rank's output columns and weight "
            "gradient match nn.Linear, and the all-gathered shards equal the whole output")  # fmt: skip


@exercise(
    "03.column_parallel",
    "A column-parallel linear layer's forward",
    hints=(
        "a column-parallel layer gives each rank an equal share of the output features and "
        "every input feature; which dimension of nn.Linear's weight indexes output features?",
        "nn.Linear stores weight as (out_features, in_features), so output features are rows; "
        "the bias has one entry per output feature and is split the same way",
        "recipe: divide the output features evenly by world_size for this rank's share; take "
        "that many consecutive rows of the layer's weight, starting at this rank's number times "
        "the share, and the same entries of its bias where it has one; apply the linear map to "
        "x with those rows and bias entries alone, staying on autograd's graph, and return the "
        "result",
    ),
)
def _verify_column_parallel(answer: Any) -> str:
    fn = require_callable(answer, "column_parallel_linear(x, linear, rank, world_size)")
    for n in (2, 3, 4):  # every rank of several world sizes, here in the kernel
        for r in range(n):
            check_column(fn, r, n)
    return rank_checks.run_in_workers("03.column_parallel", [fn])


RANK_CHECKS: dict[str, Callable[..., str]] = {"03.column_parallel": _rank_column_parallel}
"""This exercise's rank-side check, for :func:`labkit.course.exercises.model_parallel.rank_check`."""
