"""Exercise checks for notebook 03b (composing parallelisms), in the kernel and in real ranks.

As in notebook 03 (:mod:`labkit.exercises.model_parallel`, whose machinery this module reuses),
the learner writes each answer to a file with ``%%writefile`` and checks it with
``ex.check_in_workers``: first what the kernel can check (every rank of several meshes), then a
launch of ``labkit.exercises.mp_worker``, whose ranks import the same file and run the
rank-side check (:func:`rank_check`). Notebook 03c's checks (ring attention's merge, the
experts' dispatch) work the same way in :mod:`labkit.exercises.sequences_experts`.

Exercises (``EXERCISES``: id -> the names the learner's file defines):

* ``03b.mesh_groups``: ``groups_of(shape, rank)``, the ranks of ``rank``'s process group along
  each named dimension of a row-major mesh (``{"dp": 2, "tp": 2}``), as ``init_device_mesh``
  lays it out. Checked in the kernel against :func:`labkit.parallel.mesh.group_ranks` for
  2 × 2, 2 × 3 and 2 × 2 × 2 meshes; in 4 ranks against the groups of a real 2 × 2
  ``DeviceMesh``, and by an all-reduce over the learner's group.

Importing this module registers the exercises and has no other effect.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from labkit.exercises import ExerciseFailed, _require_callable, call, exercise, short_repr
from labkit.exercises import model_parallel as mp

EXERCISES: dict[str, tuple[str, ...]] = {
    "03b.mesh_groups": ("groups_of",),
}
"""Exercise id -> the names the learner's file must define."""
NPROC = {"03b.mesh_groups": 4}
"""Ranks each exercise's rank-side check runs on: a 2 × 2 mesh needs four."""


def verify_file(exercise_id: str, path: str | Path) -> tuple[str, str]:
    """Check the learner's file ``path`` for ``exercise_id``, in the kernel and in ranks (what
    ``ex.check_in_workers`` calls)."""
    __tracebackhide__ = True
    return mp.verify_file(exercise_id, path, EXERCISES, nproc=NPROC.get(exercise_id, 2))


def rank_check(exercise_id: str, objs: Sequence[Any], ctx: Any) -> dict[str, Any]:
    """Inside a worker rank: run ``exercise_id``'s rank-side check, reported, never raised."""
    checks: dict[str, Callable[..., str]] = {
        "03b.mesh_groups": _rank_mesh_groups,
    }
    return mp.run_rank_check(exercise_id, checks, objs, ctx)


# --------------------------------------------------------------------------- 03b.mesh_groups

MESHES: tuple[dict[str, int], ...] = (  # 2 × 3 first: there every usual mistake looks different
    {"dp": 2, "tp": 3},
    {"dp": 2, "tp": 2},
    {"pp": 2, "dp": 2, "tp": 2},
)


def _normalise_groups(got: Any, shape: dict[str, int], call_text: str) -> dict[str, list[int]]:
    if not isinstance(got, dict):
        raise ExerciseFailed(
            f"{call_text} returned {short_repr(got)}: return a dict from each dimension's name "
            "to the list of ranks in this rank's group along it"
        )
    if set(got) != set(shape):
        raise ExerciseFailed(
            f"{call_text} returned keys {sorted(got)}: give one entry per dimension of the "
            f"mesh, {list(shape)}"
        )
    out = {}
    for dim, ranks in got.items():
        try:
            out[dim] = sorted(int(r) for r in ranks)
        except (TypeError, ValueError):
            raise ExerciseFailed(
                f"{call_text}[{dim!r}] is {short_repr(ranks)}: give a list of rank numbers"
            ) from None
    return out


def groups_diagnosis(shape: dict[str, int], rank: int, got: dict[str, list[int]]) -> str:
    """The likely mistake behind a wrong answer (the reference is row-major)."""
    from labkit.parallel import mesh

    want = {d: mesh.group_ranks(shape, d, rank) for d in shape}
    reversed_shape = dict(reversed(list(shape.items())))
    column_major = {d: mesh.group_ranks(reversed_shape, d, rank) for d in shape}
    text = f"for mesh {shape} rank {rank} you gave {got}, expected {want}. Likely: "
    if any(rank not in ranks for ranks in got.values()):
        return text + "a rank always belongs to its own group along every dimension"
    if got == column_major:
        return text + ("you laid the ranks out column-major (the first dimension varying "
                       "fastest). init_device_mesh is row-major, like torch.arange(n).reshape"
                       "(shape): the last dimension varies fastest, so its groups are runs of "
                       "neighbouring ranks")  # fmt: skip
    names = list(shape)
    if len(names) == 2 and got == {names[0]: want[names[1]], names[1]: want[names[0]]}:
        return text + ("each dimension got the other's group. The group along a dimension "
                       "holds the ranks that differ in that dimension's coordinate and share "
                       "all the others")  # fmt: skip
    if any(len(got[d]) != shape[d] for d in shape):
        return text + ("a group along a dimension holds as many ranks as that dimension's size: "
                       "the ranks that differ from this one in that coordinate only")  # fmt: skip
    return text + ("write the rank's coordinates first (divide by the product of the sizes after "
                   "each dimension), then vary one coordinate at a time")  # fmt: skip


def check_groups(fn: Any) -> str:
    """Compare ``fn(shape, rank)`` with the row-major layout for every rank of every mesh."""
    from labkit.parallel import mesh

    _require_callable(fn, "groups_of")
    for shape in MESHES:
        for rank in range(math.prod(shape.values())):
            text = f"groups_of({shape}, {rank})"
            got = _normalise_groups(call(fn, dict(shape), rank), shape, text)
            want = {d: mesh.group_ranks(shape, d, rank) for d in shape}
            if got != want:
                raise ExerciseFailed(groups_diagnosis(shape, rank, got))
    return "every rank of 2 × 3, 2 × 2 and 2 × 2 × 2 meshes gets its row-major groups"


@exercise(
    "03b.mesh_groups",
    "The process groups of a rank in a named device mesh",
    hints=(
        "A rank's group along one dimension is every rank that shares all its other "
        "coordinates: write the rank's coordinates first, then vary one at a time.",
        "init_device_mesh lays ranks out row-major, like torch.arange(world).reshape(sizes): "
        "the last dimension varies fastest, so with {'dp': 2, 'tp': 2} rank 1 sits at "
        "dp 0, tp 1.",
        "recipe: for each dimension, work out its stride (how far apart in rank number two "
        "neighbours along it are: it follows from the sizes after it); read this rank's "
        "coordinate on that dimension from its rank and the stride; its group is the ranks "
        "that differ from it only in that coordinate, so they step by that stride.",
    ),
)
def _verify_mesh_groups(answer: Any) -> str:
    said = check_groups(answer)
    return f"{said}; {mp.run_in_workers('03b.mesh_groups', [answer], nproc=NPROC['03b.mesh_groups'])}"


def _rank_mesh_groups(ctx: Any, fn: Callable[[dict[str, int], int], Any]) -> str:
    """On 4 ranks: a real 2 × 2 DeviceMesh's groups, and an all-reduce over the learner's."""
    import torch.distributed as tdist

    from labkit.parallel import mesh

    shape = {"dp": 2, "tp": 2}
    device_mesh = mesh.build(shape, "cpu")
    mine = _normalise_groups(call(fn, dict(shape), ctx.rank), shape,
                             f"groups_of({shape}, {ctx.rank})")  # fmt: skip
    real = {d: sorted(tdist.get_process_group_ranks(device_mesh.get_group(d))) for d in shape}
    if mine != real:
        raise ExerciseFailed(
            f"the real DeviceMesh puts rank {ctx.rank} in {real}; you gave {mine}"
        )
    # The group is real: summing the rank numbers over it gives the sum of its members.
    x = torch.tensor([float(ctx.rank)])
    tdist.all_reduce(x, group=device_mesh.get_group("tp"))
    if int(x.item()) != sum(real["tp"]):
        raise ExerciseFailed(f"an all-reduce over the tp group summed {x.item()}")
    return ("and on 4 ranks a real 2 × 2 DeviceMesh has exactly your groups (an all-reduce "
            f"over rank 0's tp group {real['tp']} summed their ranks)" if ctx.rank == 0
            else "ok")  # fmt: skip
