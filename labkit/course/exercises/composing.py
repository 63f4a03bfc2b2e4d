"""Exercise checks for notebook 03b (composing parallelisms), in the kernel and in real ranks.

As in notebook 03 (:mod:`labkit.course.exercises.model_parallel`; the machinery both use is
:mod:`labkit.course.exercises.rank_checks`), the learner writes each answer to a file with
``%%writefile`` and checks it with ``ex.check_in_workers``: first what the kernel can check
(every rank of several meshes), then a launch of ``labkit.course.exercises.model_parallel.worker``, whose
ranks import the same file and run the rank-side check (:func:`rank_check`). Notebook 03c's
checks (ring attention's merge, the experts' dispatch) work the same way in
:mod:`labkit.course.exercises.sequences_experts`.

Exercises (``EXERCISES``: id -> the names the learner's file defines):

* ``03b.mesh_groups``: ``groups_of(shape, rank)``, the ranks of ``rank``'s process group along
  each named dimension of a row-major mesh (``{"dp": 2, "tp": 2}``), as ``init_device_mesh``
  lays it out. Checked in the kernel against :func:`labkit.parallel.mesh.group_ranks` for
  2 × 2, 2 × 3 and 2 × 2 × 2 meshes; in 4 ranks against the groups of a real 2 × 2
  ``DeviceMesh``, and by an all-reduce over the learner's group.
* ``03b.choose_mesh`` (in the kernel, ``ex.check``): ``choose_mesh(measured, budget_bytes)``,
  the mesh to run on two nodes of two GPUs (outer dimension first) from the measured model
  state per rank and bytes per mesh dimension of both compositions, or None if neither fits.
  Checked on what the notebook measures for its model at the smoke and lab sizes
  (:func:`mesh_measurements`, equal to the counts to the byte) at six budgets, each usual
  mistake named (:func:`choose_mesh_diagnosis`); the notebook then runs the choice for real.

Importing this module registers the exercises and has no other effect.
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from labkit.course.exercises import ExerciseFailed, call, exercise, rank_checks, short_repr
from labkit.course.exercises.learner_code import require_callable

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
    return rank_checks.verify_file(exercise_id, path, EXERCISES, nproc=NPROC.get(exercise_id, 2))


def rank_check(exercise_id: str, objs: Sequence[Any], ctx: Any) -> dict[str, Any]:
    """Inside a worker rank: run ``exercise_id``'s rank-side check, reported, never raised."""
    checks: dict[str, Callable[..., str]] = {
        "03b.mesh_groups": _rank_mesh_groups,
    }
    return rank_checks.run_rank_check(exercise_id, checks, objs, ctx)


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

    require_callable(fn, "groups_of")
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
    return f"{said}; {rank_checks.run_in_workers('03b.mesh_groups', [answer], nproc=NPROC['03b.mesh_groups'])}"


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


# --------------------------------------------------------------------------- 03b.choose_mesh
#
# Four ranks on two nodes of two GPUs: a launcher numbers ranks node by node, so the groups of
# a 2 × 2 mesh's inner (last) dimension, {0, 1} and {2, 3}, each sit inside one node on the
# fast links, and the outer dimension's groups, {0, 2} and {1, 3}, cross the network.

PARTS_03B = ("fsdp_tp", "hsdp")
STATE_KEYS = ("parameters", "gradients", "optimizer_state")


def _state_bytes(m: dict[str, Any]) -> float:
    return float(sum(m["memory"][k] for k in STATE_KEYS))


def _ordered(m: dict[str, Any]) -> dict[str, int]:
    """The mesh of one composition, outer first, as the reference orders it: tensor
    parallelism inside (its all-reduces are waited for by the next matmul), else the dimension
    that carries more bytes inside."""
    sent, shape = m["sent"], m["mesh"]
    inner = "tp" if "tp" in shape else max(shape, key=lambda d: sent[d])
    outer = next(d for d in shape if d != inner)
    return {outer: shape[outer], inner: shape[inner]}


def reference_choose_mesh(measured: dict[str, Any], budget_bytes: float) -> dict[str, int] | None:
    """What later cells use while the learner's answer is not done or wrong: of the
    compositions whose model state fits the budget, each with its dimensions ordered, the one
    that sends the fewest bytes over the outer (slow) dimension; None if none fits."""
    best: tuple[float, float, dict[str, int]] | None = None
    for m in measured.values():
        if _state_bytes(m) > budget_bytes:
            continue
        mesh_ = _ordered(m)
        key = (m["sent"][next(iter(mesh_))], _state_bytes(m), mesh_)
        if best is None or key[:2] < best[:2]:
            best = key
    return None if best is None else best[2]


def mesh_measurements(cfg: Any, *, bytes_per_element: int = 4) -> dict[str, Any]:
    """What notebook 03b measures for ``cfg`` on 4 ranks (it finds the counts and the bytes
    equal to these predictions, to the byte): per composition its mesh, the model state one
    rank holds (bytes, by kind) and the bytes one rank sends per step on each dimension, for a
    global batch of 8 rows."""
    from labkit.parallel import mesh

    out = {}
    for part, shape, rows in (("fsdp_tp", {"dp": 2, "tp": 2}, 4),
                              ("hsdp", {"replicate": 2, "shard": 2}, 2)):  # fmt: skip
        mem = mesh.predict_memory(cfg, shape, part)
        comm_ = mesh.predict_comm(cfg, shape, part, rows, bytes_per_element=bytes_per_element)
        out[part] = {"mesh": dict(shape), "memory": {k: int(mem[k]) for k in STATE_KEYS},
                     "sent": {d: float(v["sent_per_rank"]) for d, v in comm_.items()}}  # fmt: skip
    return out


def _one_process_bytes(cfg: Any) -> float:
    from labkit.model import GPT

    return 16.0 * sum(p.numel() for p in GPT(cfg).parameters())


@functools.cache
def _mesh_cases() -> tuple[tuple[dict[str, Any], float, str], ...]:
    """(measured, budget_bytes, what): notebook 03b's models at its smoke and lab sizes, with
    budgets (a share of one process's state) where each usual mistake gives another answer."""
    from labkit.config import ModelConfig

    models = {"lab": ModelConfig(seq_len=128, n_layer=4, n_head=4, d_model=128),
              "smoke": ModelConfig(seq_len=32, n_layer=4, n_head=4, d_model=64)}  # fmt: skip
    cases = []
    for size, share in (("lab", 0.6), ("lab", 0.4), ("lab", 0.3), ("smoke", 0.4),
                        ("smoke", 0.6), ("lab", 0.2)):  # fmt: skip
        cfg = models[size]
        budget = share * _one_process_bytes(cfg)
        what = (f"notebook 03b's {size}-size GPT (d {cfg.d_model}, seq {cfg.seq_len}) with "
                f"{budget / 2**20:.2f} MiB of model state per GPU ({share:.0%} of one process's)")  # fmt: skip
        cases.append((mesh_measurements(cfg), budget, what))
    return tuple(cases)


def _describe_mesh(measured: dict[str, Any], shape: dict[str, int] | None) -> str:
    if shape is None:
        return "None"
    part = next(p for p, m in measured.items() if set(m["mesh"]) == set(shape))
    return f"{shape} ({part})"


def choose_mesh_diagnosis(measured: dict[str, Any], budget: float, got: dict[str, int] | None) -> str:
    """The likely mistake behind a wrong choice (every wrong rule a learner plausibly writes is
    tried on the same measurements; the first that gives ``got`` is named)."""
    want = reference_choose_mesh(measured, budget)
    if got is None:
        return ("you returned None, but a composition's model state fits the budget: add its "
                "parameters, gradients and optimizer state and compare the sum with it")  # fmt: skip
    if want is None:
        return ("neither composition's model state fits the budget (parameters + gradients + "
                "optimizer state, per rank): return None")  # fmt: skip
    m = next(m for m in measured.values() if set(m["mesh"]) == set(got))
    outer, inner = list(got)
    if _state_bytes(m) > budget:
        mem = m["memory"]
        text = (f"its model state does not fit: parameters + gradients + AdamW's state come to "
                f"{_state_bytes(m) / 2**20:.2f} MiB per rank, over the budget of "
                f"{budget / 2**20:.2f} MiB. Keep only the compositions that fit before comparing "
                "their traffic")  # fmt: skip
        if mem["parameters"] <= budget:
            text += (f" (its parameters alone, {mem['parameters'] / 2**20:.2f} MiB, would fit: "
                     "a rank holds all three kinds)")  # fmt: skip
        return text
    if list(got.items()) != list(_ordered(m).items()):
        if "tp" in got and inner != "tp":
            return (f"tensor parallelism is on the outer dimension, across nodes. Its "
                    f"all-reduces ({m['sent']['tp'] / 2**20:.2f} MiB here"
                    + (", fewer bytes than dp's" if m["sent"]["tp"] < m["sent"]["dp"] else "")
                    + ") sit on the critical path: the next matmul waits for each one, while "
                    "FSDP's gathers are issued ahead and overlap compute. TP goes inside, "
                    "whatever its bytes")  # fmt: skip
        return (f"'{outer}' is outer, so its {m['sent'][outer] / 2**20:.2f} MiB per step cross "
                f"the network while '{inner}' carries {m['sent'][inner] / 2**20:.2f} MiB inside "
                "a node. The last dimension is the inner one (neighbouring ranks, one node): "
                "give it the traffic that must stay on the fast links")  # fmt: skip
    other = next(x for x in measured.values() if set(x["mesh"]) != set(got))
    if _state_bytes(other) <= budget:
        o = _ordered(other)
        mine_out, other_out = m["sent"][outer], other["sent"][next(iter(o))]
        total_mine, total_other = sum(m["sent"].values()), sum(other["sent"].values())
        if total_mine < total_other:
            return (f"both fit; you chose the one that sends fewer bytes over both dimensions "
                    f"together. Only the outer dimension's cross the slow links: "
                    f"{mine_out / 2**20:.2f} MiB for yours, {other_out / 2**20:.2f} MiB for "
                    f"{o}")  # fmt: skip
        if _state_bytes(m) < _state_bytes(other):
            return (f"both fit; you chose the one with the least memory. Memory under the "
                    f"budget is enough: among those that fit, choose by what crosses the slow "
                    f"links ({mine_out / 2**20:.2f} MiB for yours, {other_out / 2**20:.2f} MiB "
                    f"for {o})")  # fmt: skip
    return ("among the compositions whose model state fits, choose the one that sends the "
            "fewest bytes over the outer dimension")  # fmt: skip


@exercise(
    "03b.choose_mesh",
    "Choose the 2-D layout of 4 GPUs on 2 nodes from measured bytes and memory",
    hints=(
        "Two questions for each composition: does its model state fit in a GPU's budget, and "
        "how many bytes per step must cross between the nodes? Inside a node the links are "
        "fast; between nodes they are slow.",
        "A mesh's last dimension is its innermost: its groups are neighbouring ranks, which "
        "share a node. The outer dimension's groups cross nodes, so its bytes are the ones "
        "that ride the slow links.",
        "Not all traffic is alike: tensor parallelism's all-reduces are waited for by the next "
        "matmul, FSDP's gathers and reduce-scatters can be issued ahead and overlap compute. "
        "Which of the two must never cross the network, whatever the byte counts say?",
        "recipe: for each composition, add up the three kinds of state a rank holds and drop "
        "it if the sum exceeds the budget; order the survivor's two dimensions so that the one "
        "whose traffic must stay fast is last (tensor parallelism if present, else the busier "
        "one); among the survivors keep the one whose outer dimension sends the fewest bytes; "
        "if none survives there is no layout to return.",
    ),
    reference=reference_choose_mesh,
)
def _verify_choose_mesh(answer: Any) -> str:
    fn = require_callable(answer, "choose_mesh(measured, budget_bytes) -> dict | None")

    for measured, budget, what in _mesh_cases():
        got = call(fn, copy.deepcopy(measured), budget)
        want = reference_choose_mesh(measured, budget)
        if got is not None and not (isinstance(got, dict) and all(
                isinstance(v, int) for v in got.values())):  # fmt: skip
            raise ExerciseFailed(
                f"{what}: you returned {short_repr(got)}: return the mesh to build, a dict of "
                "dimension name to size, outer dimension first (as init_device_mesh takes it), "
                "or None"
            )
        if got is not None and not any(set(got) == set(m["mesh"]) and
                                       all(got[d] == m["mesh"][d] for d in got)
                                       for m in measured.values()):  # fmt: skip
            raise ExerciseFailed(
                f"{what}: you returned {short_repr(got)}, which is not one of the measured "
                f"meshes {[m['mesh'] for m in measured.values()]} (in either order)"
            )
        if (got is None) != (want is None) or (
                got is not None and list(got.items()) != list(want.items())):  # fmt: skip
            raise ExerciseFailed(f"{what}: you chose {_describe_mesh(measured, got)}. "
                                 f"{choose_mesh_diagnosis(measured, budget, got)}")  # fmt: skip
    return ("your choice is right on the measurements of this notebook's model at both sizes, "
            "six budgets in all (one where nothing fits); the next cell runs it for real")
