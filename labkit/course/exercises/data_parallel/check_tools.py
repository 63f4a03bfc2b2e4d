"""What every worker-run check of notebook 02 shares: the process group, running a piece of the
learner's code, the ranks agreeing on a verdict, and naming why a gradient differs.

Separate from the checks themselves (``dp_check_ddp``, ``dp_check_zero1``), which each use
all of it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as tdist
from torch import nn

from labkit.course.exercises import (
    ExerciseFailed,
    learner_frame,
)
from labkit.course.exercises.data_parallel.reference import ATOL, RTOL, trainable_params

# --------------------------------------------------------------------------- shared pieces


def default_group() -> tuple[int, int, torch.device]:
    """(rank, world size, device) of the default process group."""
    if not (tdist.is_available() and tdist.is_initialized()):
        raise RuntimeError(
            "the 02.* exercise checks run inside worker processes, where a process group "
            "exists: use labkit.course.exercises.check_in_workers(exercise_id, path_to_file)"
        )
    nccl = tdist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    return tdist.get_rank(), tdist.get_world_size(), device


def require_class(answer: object, signature: str) -> Callable[..., Any]:
    if not callable(answer):
        raise ExerciseFailed(
            f"expected the class {signature}, got {type(answer).__name__} {answer!r}"
        )
    return answer


def agree_on_problem(problem: str | None) -> None:
    """Every rank learns every rank's verdict, and all raise the first problem found.

    A rank that found a mistake must not leave the others waiting in the next collective:
    after each phase of a check the ranks compare notes (``all_gather_object``), so every
    rank stops at the same point, with the same message (which names the rank that found it).
    """
    n = tdist.get_world_size()
    found: list[str | None] = [None] * n
    tdist.all_gather_object(found, problem)
    for message in found:
        if message is not None:
            raise ExerciseFailed(message)


def try_learner_code(
    fn: Callable[[], Any], explain: Callable[[Exception], str | None] | None = None
) -> tuple[Any, str | None]:
    """Run a piece of the learner's code; (result, None), or (None, what went wrong).
    ``explain(err)`` may name the mistake behind an exception (None: it cannot)."""
    try:
        return fn(), None
    except NotImplementedError:
        raise
    except ExerciseFailed as err:
        return None, str(err)
    except Exception as err:  # call() turns most into ExerciseFailed; this is the rest
        why = explain(err) if explain is not None else None
        if why is not None:
            return None, f"{why}{learner_frame(err)}"
        return None, f"your code raised {type(err).__name__}: {err}{learner_frame(err)}"


def explain_missing_key(model: nn.Module) -> Callable[[Exception], str | None]:
    """An explainer for :func:`try_learner_code`: a KeyError whose key is one of ``model``'s trainable
    parameters (the tensor or its ``id``) means the learner's lookup table has no entry for
    it, most often because the bucket holding it was never made."""
    by_id = {id(p): name for name, p in trainable_params(model)}

    def explain(err: Exception) -> str | None:
        if not isinstance(err, KeyError) or not err.args:
            return None
        key = err.args[0]
        name = by_id.get(id(key)) if isinstance(key, torch.Tensor) else by_id.get(key)
        if name is None:
            return None
        return (f"your code raised KeyError when the gradient of {name} arrived: {name} is "
                "in no bucket, so its hook found nowhere to put it. Every trainable "
                "parameter must belong to a bucket: was the last, still open bucket ever "
                "added?")  # fmt: skip

    return explain


def tensors_close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, rtol=RTOL, atol=ATOL)


def why_gradient_differs(
    got: torch.Tensor, want: torch.Tensor, local: torch.Tensor, n: int, step: int = 1
) -> str:
    """The usual mistake a wrong averaged gradient points to (``step``: counted from 1)."""
    if not torch.isfinite(got).all():
        return "it contains inf/NaN"
    if tensors_close(got, local):
        return "it is still this rank's own gradient: it was never all-reduced with the other ranks"
    if tensors_close(got, n * want):
        return (f"it is {n}x the average: all_reduce sums over the {n} ranks, so divide by "
                "world_size once the all-reduce has finished")  # fmt: skip
    if tensors_close(got, want / n):
        if step > 1:
            return (f"it is 1/{n} of the average: it was divided by world_size twice, only from "
                    f"step 2 on. Is something of step 1 (its handles still in the list?) "
                    "divided again?")  # fmt: skip
        return f"it is 1/{n} of the average: it was divided by world_size twice"
    if tensors_close(got, local / n):
        return ("it is this rank's gradient divided by world_size: the sum over ranks never "
                "reached it (was it divided before the all-reduce finished, or was the "
                "all-reduce started on a copy?)")  # fmt: skip
    err = (got - want).abs().max().item()
    return f"it differs from DDP's by up to {err:.3g}"

