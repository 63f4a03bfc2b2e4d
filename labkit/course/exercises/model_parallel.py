"""Exercise checks for notebook 03 (model parallelism), run in the kernel and inside worker ranks.

Parallel code is only proven by running it in parallel, so two of these exercises run the
learner's code inside real ranks, and a third (a pure function) is also executed there, as
the schedule of a real pipeline; a fourth, a decision (``03.choose_m``), is checked in the
kernel and its answer runs as a real pipeline. A worker process cannot import code that exists
only in a notebook kernel (pytorch #20375), so the learner writes each answer to a file with
``%%writefile``, as in notebook 02 (``labkit.course.exercises.data_parallel``)::

    ex_dir = ex.workspace("03")               # labkit_home()/exercises/03
    %%writefile {ex_dir}/mp_fg.py
    ...
    ex.check_in_workers("03.f_and_g", ex_dir / "mp_fg.py")
    # ✓ 03.f_and_g: every rank's shards are right for world sizes 2, 3, 4; your ...

``check_in_workers`` (through :func:`verify_file`) imports the file in the kernel and runs the exercise's registered check
(``labkit.course.exercises.verify``): first what can be checked here (a stub is reported at once, an
order of operations is compared action by action, a shard is checked for every rank of 2, 3
and 4), then a launch of ``labkit.course.exercises.mp_worker`` on 2 ranks, each of which imports the
same file and runs the rank-side check (``rank_check``). A rank's verdict comes back as the
notebook's ``ExerciseIncomplete`` or ``ExerciseFailed``, naming the rank.

Exercises (``EXERCISES``: id -> the names the learner's file defines):

* ``03.one_f_one_b``: the 1F1B order of one stage, ``one_f_one_b(p, m, stage)``; in the
  workers, the learner's order drives a real 2-stage pipeline (``labkit.parallel.pipeline``)
  whose loss and gradients must equal GPipe's.
* ``03.f_and_g``: Megatron's f and g as ``torch.autograd.Function`` classes ``Enter`` and
  ``Leave``, and ``TensorParallelMLP(mlp, rank, world_size)``, an ``nn.Module`` holding one
  rank's shards of a ``labkit.model.MLP`` (fc column-parallel, proj row-parallel) whose forward
  is f, fc, GELU, proj, g, then proj's bias once. In the kernel every rank's shards are checked
  for 2, 3 and 4 ranks; in the workers the f and g carry a bare MLP of the check's own, then
  the learner's module's output, input gradient (the same on every rank) and shard gradients
  are checked against the unsplit MLP.
* ``03.column_parallel``: ``column_parallel_linear(x, linear, rank, world_size)``, one rank's
  output features of ``linear(x)``; in the workers each rank's shard, its gradient, and the
  all-gathered shards are checked against ``nn.Linear``.
* ``03.choose_m``: a decision from measurements, checked in the kernel:
  ``choose_m(steps_s, p, candidates)``, the number of 1F1B micro-batches with the shortest step,
  from the steps measured at a few m (a model of the bubble's m + p − 1 slots and a fixed cost
  per micro-batch, fitted to them). Checked on pipelines where each usual mistake (the fastest
  measured m, the most micro-batches, one micro-batch) picks an m of its own; the notebook then
  runs the choice for real with :func:`run_m_plan`, 1F1B at it and its neighbours, and
  :func:`judge_m_plan` says with ``labkit.verdict`` whether a neighbour ran faster.

Importing this module registers the exercises and has no other effect.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from labkit.course.exercises import (
    ExerciseFailed,
    ExerciseIncomplete,
    _name,
    _require_callable,
    call,
    exercise,
    explain_job_error,
    get,
    incomplete,
    learner_frame,
    ranks_apart,
    short_repr,
    time_limit_paused,
    verify,
)
from labkit.jobs.diagnosis import is_echo

WORKER = "labkit.course.exercises.mp_worker"
NPROC = 2  # ranks the worker-run checks use
DEVICE = "cpu"  # gloo ranks: every machine has them, and the checks are about correctness
LAUNCH_TIMEOUT_S = 90.0  # start-up takes seconds; only a hung rank gets near it
PG_TIMEOUT_S = 15.0  # a learner's unmatched collective fails after this, not after 30 minutes
# (the checks' collectives move kB between ranks started together: see data_parallel's)

EXERCISES: dict[str, tuple[str, ...]] = {
    "03.one_f_one_b": ("one_f_one_b",),
    "03.f_and_g": ("Enter", "Leave", "TensorParallelMLP"),
    "03.column_parallel": ("column_parallel_linear",),
}
"""Exercise id -> the names the learner's file must define (the answer, in this order)."""

# --------------------------------------------------------------------------- learner files


def load_file(path: str | Path, name: str | None = None) -> ModuleType:
    """Import the Python file at ``path`` afresh as module ``name`` (default: the file's stem).

    The module is (re)placed in ``sys.modules``, so a class or function it defines knows its
    module and file, and a cell that rewrote the file gets the new code. No bytecode cache is
    written: a file rewritten within the same second could otherwise load stale bytecode.
    """
    path = Path(path)
    name = name or path.stem
    if path.suffix != ".py" or not path.is_file():
        raise FileNotFoundError(
            f"{path} is not an existing .py file: run the %%writefile cell that writes it first"
        )
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    before, sys.dont_write_bytecode = sys.dont_write_bytecode, True
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    finally:
        sys.dont_write_bytecode = before
    return module


def answer_from_file(
    exercise_id: str, path: str | Path, exercises: Mapping[str, tuple[str, ...]] = EXERCISES
) -> Any:
    """The learner's answer to ``exercise_id``: the objects ``exercises`` (this notebook's
    ``EXERCISES`` by default) names, from ``path`` (one object, or a tuple of them)."""
    if exercise_id not in exercises:
        raise ValueError(f"exercise_id={exercise_id!r}: use one of {sorted(exercises)}")
    module = load_file(path)
    missing = [n for n in exercises[exercise_id] if not hasattr(module, n)]
    if missing:
        raise ExerciseFailed(
            f"{path} defines no {', '.join(missing)}: keep the names the exercise cell uses"
        )
    objs = tuple(getattr(module, n) for n in exercises[exercise_id])
    return objs[0] if len(objs) == 1 else objs


def verify_file(
    exercise_id: str, path: str | Path, exercises: Mapping[str, tuple[str, ...]] = EXERCISES,
    nproc: int = NPROC,
) -> tuple[str, str]:
    """Check the learner's file ``path`` for ``exercise_id``, in the kernel and on ``nproc`` ranks.

    Returns (what was verified, where) or raises ``ExerciseIncomplete`` (still the stub) or
    ``ExerciseFailed`` (what was expected, what came back, the likely mistake, which rank).
    Notebooks call it through :func:`labkit.course.exercises.check_in_workers`.
    """
    __tracebackhide__ = True
    if exercise_id not in exercises:
        raise ValueError(f"exercise_id={exercise_id!r}: use one of {sorted(exercises)}")
    try:
        answer = answer_from_file(exercise_id, path, exercises)
    except ExerciseFailed as err:
        err.args = (f"Exercise {exercise_id} ({get(exercise_id).title}) failed: {err}",)
        err.exercise_id = exercise_id
        raise
    except Exception as err:  # the file does not import: a learner's mistake, reported
        raise ExerciseFailed(
            f"importing {path} raised {type(err).__name__}: {err}{learner_frame(err)}"
        ) from err
    return verify(exercise_id, answer), f"checked in the kernel and on {nproc} ranks"


def _source_file(obj: Any, what: str) -> tuple[str, str, str]:
    """(module name, file path, qualified name) of a learner's class or function.

    Workers import the answer by these, so it must come from a file, not from a notebook cell.
    """
    module = sys.modules.get(getattr(obj, "__module__", None) or "")
    path = getattr(module, "__file__", None)
    if module is None or not path or module.__name__ == "__main__":
        raise ExerciseFailed(
            f"{what} was defined in the notebook itself, so worker processes cannot import it; "
            "write it with the %%writefile cell and check the file with ex.check_in_workers"
        )
    return module.__name__, str(path), obj.__qualname__


def answer_spec(exercise_id: str, objs: Sequence[Any]) -> dict[str, Any]:
    """The JSON the worker gets to find the learner's objects: {exercise, path, module, names}."""
    specs = [_source_file(o, _name(o)) for o in objs]
    modules = {(m, p) for m, p, _ in specs}
    if len(modules) != 1:
        raise ExerciseFailed(
            f"the objects come from several modules {sorted(m for m, _ in modules)}: "
            "define them in one %%writefile cell"
        )
    module, path = next(iter(modules))
    return {"exercise": exercise_id, "module": module, "path": path,
            "names": [q for _, _, q in specs]}  # fmt: skip


def resolve(spec: dict[str, Any]) -> list[Any]:
    """Inside a worker: import the learner's file and return the objects ``spec`` names."""
    module = load_file(spec["path"], spec["module"])
    objs = []
    for qualname in spec["names"]:
        obj: Any = module
        for part in qualname.split("."):
            obj = getattr(obj, part)
        objs.append(obj)
    return objs


# --------------------------------------------------------------------------- running in ranks


def run_in_workers(exercise_id: str, objs: Sequence[Any], nproc: int = NPROC) -> str:
    """Launch ``WORKER`` on ``nproc`` ranks to check ``objs`` there.

    Returns the ranks' sentence; raises ``ExerciseIncomplete`` or ``ExerciseFailed`` as the
    ranks report, naming the first rank that failed. The one place these checks launch a job
    (tests replace it to check the kernel side alone).
    """
    from labkit.jobs import launch  # lazy: importing this module must stay cheap

    spec = answer_spec(exercise_id, objs)
    try:
        with time_limit_paused():  # the job has its own limit, and ends its processes
            job = launch.run(WORKER, nproc=nproc, device=DEVICE, config={"cases": [spec]},
                             timeout_s=LAUNCH_TIMEOUT_S, pg_timeout_s=PG_TIMEOUT_S,
                             stream=False)  # fmt: skip
    except (launch.JobFailed, launch.JobTimeout) as err:
        raise ExerciseFailed(explain_job_error(err, _reports(err.result.ranks, nproc))) from None
    reports = _reports(job.ranks, nproc)
    if any(is_echo(m) for m in reports.values()):  # a rank saw its peer go, or timed out
        apart = ranks_apart(job, reports)
        if apart is not None:
            raise ExerciseFailed(apart)
    return raise_for_results(exercise_id, [r["cases"][0] for r in job.ranks])


def _reports(ranks: Sequence[dict[str, Any]], nproc: int) -> dict[int, str]:
    """{rank: its report} for the ranks whose check failed."""
    return {
        r: f"on rank {r} of {nproc}: {res['cases'][0]['message']}"
        for r, res in enumerate(ranks)
        if res.get("cases") and res["cases"][0].get("status") == "failed"
    }


def raise_for_results(exercise_id: str, per_rank: Sequence[dict[str, Any]]) -> str:
    """Turn each rank's {"status", "message"} into a sentence, or the first rank's error."""
    for rank, res in enumerate(per_rank):
        if res.get("exercise") != exercise_id:
            raise RuntimeError(f"rank {rank} checked {res.get('exercise')!r}, not {exercise_id!r}")
        err: ExerciseIncomplete | ExerciseFailed | None = None
        if res["status"] == "incomplete":
            err = ExerciseIncomplete(res["message"])
        elif res["status"] != "ok":
            err = ExerciseFailed(f"on rank {rank} of {len(per_rank)}: {res['message']}")
        if err is not None:
            err.exercise_id = exercise_id
            raise err
    return per_rank[0]["message"]


def rank_check(exercise_id: str, objs: Sequence[Any], ctx: Any) -> dict[str, Any]:
    """Run ``exercise_id``'s rank-side check; never raises for the learner's mistakes.

    Returns {"exercise", "status": "ok" | "incomplete" | "failed", "message"}: every rank
    reports, so the notebook can say which rank saw what.
    """
    checks: dict[str, Callable[..., str]] = {
        "03.one_f_one_b": _rank_one_f_one_b,
        "03.f_and_g": _rank_f_and_g,
        "03.column_parallel": _rank_column_parallel,
    }
    return run_rank_check(exercise_id, checks, objs, ctx)


def run_rank_check(
    exercise_id: str, checks: dict[str, Callable[..., str]], objs: Sequence[Any], ctx: Any
) -> dict[str, Any]:
    """Run ``checks[exercise_id](ctx, *objs)`` and turn its outcome into the rank's report:
    {"exercise", "status": "ok" | "incomplete" | "failed", "message"}. Every notebook whose
    checks run in ranks (03, 03b, 03c) reports through here."""
    if exercise_id not in checks:
        raise ValueError(f"exercise={exercise_id!r}: no rank-side check; use one of {list(checks)}")
    out = {"exercise": exercise_id}
    try:
        return {**out, "status": "ok", "message": checks[exercise_id](ctx, *objs)}
    except ExerciseFailed as err:
        return {**out, "status": "failed", "message": str(err)}
    except NotImplementedError:
        return {**out, "status": "incomplete",
                "message": str(incomplete(exercise_id))}  # fmt: skip
    except Exception as err:  # the learner's code raised: report it, with where
        import traceback

        where = traceback.format_exc(limit=-3).strip()
        return {**out, "status": "failed",
                "message": f"your code raised {type(err).__name__}: {err}\n{where}"}  # fmt: skip


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-9) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, atol=tol, rtol=tol)


# --------------------------------------------------------------------------- 03.one_f_one_b

# (p, m, stage): m >= p, m < p (the warm-up is cut short), every stage, a single stage. The
# first case tells the usual mistakes apart (at p = 2 several give the same order).
ORDER_CASES = (
    (4, 8, 0), (4, 8, 1), (4, 8, 2), (4, 8, 3), (2, 4, 0), (2, 4, 1),
    (4, 2, 0), (4, 2, 2), (3, 1, 0), (1, 3, 0),
)  # fmt: skip


def _reference_order(p: int, m: int, stage: int) -> list[tuple[str, int]]:
    from labkit.parallel.schedules import one_f_one_b_order

    return one_f_one_b_order(p, m, stage)


def _warmup_order(p: int, m: int, warmup: int) -> list[tuple[str, int]]:
    """1F1B with a given warm-up, to recognise an off-by-one."""
    w = max(0, min(warmup, m))
    order = [("F", j) for j in range(w)]
    for j in range(m - w):
        order += [("F", w + j), ("B", j)]
    return order + [("B", j) for j in range(m - w, m)]


def _normalise_order(got: Any, call_text: str) -> list[tuple[str, int]]:
    if not isinstance(got, (list, tuple)):
        raise ExerciseFailed(
            f"{call_text} returned {type(got).__name__} {got!r}; return a list of "
            "(kind, micro-batch) pairs such as [('F', 0), ('F', 1), ('B', 0), ...]"
        )
    out = []
    for item in got:
        ok = (isinstance(item, (list, tuple)) and len(item) == 2 and item[0] in ("F", "B")
              and isinstance(item[1], int) and not isinstance(item[1], bool))  # fmt: skip
        if not ok:
            raise ExerciseFailed(
                f"{call_text} returned an entry {item!r}; each entry is a pair ('F' or 'B', "
                "micro-batch index as an int), e.g. ('F', 0)"
            )
        out.append((item[0], int(item[1])))
    return out


def order_diagnosis(p: int, m: int, stage: int, got: list[tuple[str, int]]) -> str:
    """The usual mistake that gives ``got`` instead of the 1F1B order, if one does."""
    from labkit.parallel.schedules import gpipe_order

    warmup = min(p - 1 - stage, m)
    if any(j >= m for _, j in got) and m < p - 1 - stage:
        return (f"with m={m} < p−1−stage={p - 1 - stage} there are only m forwards to run: "
                "the warm-up is min(p−1−stage, m)")  # fmt: skip
    if sorted(got) != sorted([("F", j) for j in range(m)] + [("B", j) for j in range(m)]):
        return ("every micro-batch 0..m−1 needs exactly one ('F', j) and one ('B', j); "
                "count what your list holds")  # fmt: skip
    if got == gpipe_order(p, m, stage):
        return ("this is GPipe's order (every forward, then every backward); 1F1B starts each "
                "backward as soon as the stage can, so it holds fewer micro-batches")  # fmt: skip
    for w, why in (
        (p - stage, "one warm-up forward too many: the last stage needs none, so stage s runs "
                    "p−1−s"),
        (p - 2 - stage, "one warm-up forward too few: stage s runs p−1−s before its first backward"),
        (stage, "the warm-up is reversed: the *first* stage runs the most (p−1), the last none"),
    ):  # fmt: skip
        if min(max(w, 0), m) != warmup and got == _warmup_order(p, m, w):
            return why
    live = 0
    for kind, j in got:
        live += 1 if kind == "F" else -1
        if live < 0:
            return f"('B', {j}) comes before ('F', {j}): a backward needs its forward's activations"
    backward = [j for kind, j in got if kind == "B"]
    if backward != sorted(backward):
        return ("backwards must go oldest first (B0, B1, ...): the next stage sends the "
                "gradients back in the order it received the forwards")  # fmt: skip
    return "compare with the description: warm-up, then steady state (F then B), then cool-down"


def check_order(fn: Any) -> str:
    """In the kernel: ``fn(p, m, stage)`` equals the 1F1B order for every case of ORDER_CASES."""
    fn = _require_callable(fn, "one_f_one_b(p, m, stage) -> list[tuple[str, int]]")
    for p, m, stage in ORDER_CASES:
        call_text = f"{_name(fn)}(p={p}, m={m}, stage={stage})"
        got = _normalise_order(call(fn, p, m, stage), call_text)
        expected = _reference_order(p, m, stage)
        if got != expected:
            # Where the orders part, not the whole expected order: that would be the answer.
            at = next((i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b),
                      min(len(got), len(expected)))  # fmt: skip
            raise ExerciseFailed(
                f"{call_text} returned {got}: it goes wrong at position {at} "
                f"({got[at] if at < len(got) else 'the list ends'}). Likely: "
                + order_diagnosis(p, m, stage, got)
            )
    return (f"one_f_one_b(p, m, stage) gives the 1F1B order for {len(ORDER_CASES)} cases "
            "(m >= p, m < p, every stage)")  # fmt: skip


@exercise(
    "03.one_f_one_b",
    "The 1F1B order of operations for one pipeline stage",
    hints=(
        "a stage can run a micro-batch's backward only after the later stages have run its "
        "forward and backward; 1F1B starts each backward as early as that allows, so a stage "
        "never holds more micro-batches than it must",
        "the schedule has three phases: a warm-up of forwards only (longer for earlier stages, "
        "which wait longest for their first backward), a steady phase alternating one forward "
        "and one backward, and a cool-down of the backwards left; the last stage needs no "
        "warm-up",
        "recipe: begin with the warm-up, forwards only: one for each stage after this one, but "
        "never more than m; then, as long as micro-batches are left to run forward, run the "
        "next one's forward and then the backward of the oldest micro-batch still waiting for "
        "its backward; last, run the backwards still owed, oldest first",
    ),
)
def _verify_one_f_one_b(answer: Any) -> str:
    said = check_order(answer)
    return f"{said}; {run_in_workers('03.one_f_one_b', [answer])}"


# Small enough for a quick CPU run, deep enough that each of 2 stages holds 2 blocks.
PIPE_MODEL = {"seq_len": 16, "n_layer": 4, "n_head": 2, "d_model": 32}
PIPE_BATCH, PIPE_M = 8, 4


def _rank_one_f_one_b(ctx: Any, fn: Callable[[int, int, int], Any]) -> str:
    """Drive a real pipeline with the learner's order; compare with our GPipe on the same batch."""
    from unittest import mock

    import torch.distributed as tdist

    from labkit.config import ModelConfig
    from labkit.parallel import pipeline
    from labkit.workers import pp_train

    p, m, r = ctx.world_size, PIPE_M, ctx.rank
    cfg = ModelConfig(**PIPE_MODEL)
    x, y = pp_train.make_batch(cfg, PIPE_BATCH, seed=0)
    pipe = pipeline.Pipeline(pp_train.build_model(cfg, seed=0), pipeline.partition(cfg, p),
                             rank=r, device=ctx.device)  # fmt: skip
    ref_loss = pipe.step("gpipe", x, y, m)
    ref_grads = pp_train.grads_by_name(pipe.stage)

    try:
        mine = _normalise_order(fn(p, m, r), f"{_name(fn)}(p={p}, m={m}, stage={r})")
        why = None if mine == _reference_order(p, m, r) else order_diagnosis(p, m, r, mine)
    except NotImplementedError:
        raise  # a stub raises on every rank alike, before any collective
    except Exception as err:  # reported below, once the ranks agree
        mine, why = [], f"{type(err).__name__}: {err}"
    # Every rank learns whether every order is right *before* any runs: a wrong order would
    # leave its neighbour waiting for a tensor that never comes.
    verdicts: list[Any] = [None] * p
    tdist.all_gather_object(verdicts, why)
    if any(verdicts):
        stage = next(s for s, v in enumerate(verdicts) if v)
        raise ExerciseFailed(f"stage {stage}'s order is wrong. Likely: {verdicts[stage]}")
    real = pipeline.schedule_order

    def learner_order(name: str, p_: int, m_: int, stage: int) -> list[tuple[str, int]]:
        return list(mine) if name == "1f1b" else real(name, p_, m_, stage)

    with mock.patch.object(pipeline, "schedule_order", learner_order):
        loss = pipe.step("1f1b", x, y, m)
        held = pipe.activation_summary("1f1b", m)["peak_in_flight"]
    ran = [(e["kind"], e["mb"]) for e in sorted(pipe.timeline.events, key=lambda e: e["start_s"])]
    grads = pp_train.grads_by_name(pipe.stage)
    if ran != mine:
        raise ExerciseFailed(f"stage {r} ran {ran}, not your order {mine}")
    bad = [n for n, g in ref_grads.items() if not torch.allclose(grads[n], g, atol=1e-6, rtol=1e-4)]
    if abs(loss - ref_loss) > 1e-5 or bad:
        raise ExerciseFailed(
            f"stage {r}: loss {loss} vs GPipe's {ref_loss}; gradients differ: {bad}"
        )
    tdist.barrier()
    return (f"and it ran a real {p}-stage pipeline on {p} ranks: same loss ({loss:.4f}) and "
            f"gradients as GPipe, stage 0 holding {held} of m={m} micro-batches' activations"
            if r == 0 else "ok")  # fmt: skip


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
    if not _close(got["out"], ref["out"]):
        if _close(got["out"], local["out"]):
            return ("the output is this rank's partial sum: g's forward must all-reduce (sum) "
                    "its input across ranks")  # fmt: skip
        return ("the output differs from the unsplit MLP's: check what each forward does "
                "with a tensor every rank holds in full, and with one it holds a part of")  # fmt: skip
    if _close(got["w2_grad"], n * ref["w2_grad"]):
        return (f"the weight gradients are {n}× too large: g's backward must return the gradient "
                "unchanged (the gradient of a sum with respect to each term is the gradient "
                "of the sum), not all-reduce it")  # fmt: skip
    if not _close(got["x_grad"], ref["x_grad"]):
        if _close(got["x_grad"], local["x_grad"]):
            return ("x.grad holds only this rank's part of dL/dx: f's backward must all-reduce "
                    "(sum) the gradient, since every rank's slice of the weights used x")  # fmt: skip
        return ("x.grad differs from the unsplit MLP's: check f's backward against the sum "
                "of every rank's part of dL/dx")  # fmt: skip
    for key in ("w1_grad", "w2_grad"):
        if not _close(got[key], ref[key]):
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
    said = run_in_workers("03.f_and_g", list(answer))
    return f"every rank's shards are right for world sizes {sizes}; {said}"


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
        if _close(got, want):
            return None
        for other in range(n):
            o = slice(other * per, (other + 1) * per)
            if other != rank and _close(got, full[..., o]):
                return f"that is rank {other}'s slice: its rows start at another rank's"
        if lin.bias is not None and _close(got, want - lin.bias[cols]):
            return "the bias is missing: add this rank's slice of linear.bias"
        if in_f == out_f:  # square: a slice of the wrong dimension still has the right shape
            b = lin.bias[cols] if lin.bias is not None else 0
            if _close(got, x @ lin.weight[:, cols] + b):
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
    if not _close(lin.weight.grad, expected):
        return "the gradient of linear.weight differs from that of linear(x)'s same columns"
    return None


def check_column(fn: Callable, rank: int, n: int, device: Any = "cpu") -> None:
    """Rank ``rank`` of ``n``: every COLUMN_CASES shard and its gradient; raises ExerciseFailed."""
    for in_f, out_f, bias in COLUMN_CASES:
        lin, x = _column_case(in_f, out_f, bias, device)
        text = (f"{_name(fn)}(x of shape {tuple(x.shape)}, nn.Linear({in_f}, {out_f}, "
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
    if not _close(torch.cat(parts, dim=-1), lin(x).detach()):
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
    fn = _require_callable(answer, "column_parallel_linear(x, linear, rank, world_size)")
    for n in (2, 3, 4):  # every rank of several world sizes, here in the kernel
        for r in range(n):
            check_column(fn, r, n)
    return run_in_workers("03.column_parallel", [fn])


# --------------------------------------------------------------------------- 03.choose_m
# A decision from measurements, checked in the kernel: no ranks run the learner's code, but the
# notebook runs its decision for real (run_m_plan, below).


def fit_m_model(steps_s: Mapping[int, float], p: int) -> tuple[float, float]:
    """(T, c): least squares of the measured 1F1B steps against step(m) = (m + p − 1)·(T/m + c),
    the bubble formula's m + p − 1 slots each lasting a micro-batch's share of the compute, T/m,
    plus a fixed cost per micro-batch, c (hand-over, launches, Python). Linear in T and c."""
    rows = [((m + p - 1) / m, m + p - 1, t) for m, t in steps_s.items()]
    saa = sum(a * a for a, _, _ in rows)
    sab = sum(a * b for a, b, _ in rows)
    sbb = sum(b * b for _, b, _ in rows)
    sat = sum(a * t for a, _, t in rows)
    sbt = sum(b * t for _, b, t in rows)
    det = saa * sbb - sab * sab
    if len(rows) < 2 or det == 0:
        raise ValueError(f"steps_s={dict(steps_s)!r}: need steps measured at two or more m")
    return (sat * sbb - sbt * sab) / det, (saa * sbt - sab * sat) / det


def predicted_step(m: int, p: int, T: float, c: float) -> float:
    return (m + p - 1) * (T / m + c)


def reference_choose_m(steps_s: Mapping[int, float], p: int, candidates: Sequence[int]) -> int:
    """What later cells use while the learner's answer is not done or wrong."""
    T, c = fit_m_model(steps_s, p)
    return min(candidates, key=lambda m: (predicted_step(m, p, T, c), m))


def _m_case(p: int, T: float, c: float, measured: Sequence[int], candidates: Sequence[int],
            what: str) -> tuple[dict[int, float], int, tuple[int, ...], str]:  # fmt: skip
    return ({m: predicted_step(m, p, T, c) for m in measured}, p, tuple(candidates), what)


# (measured steps by m, p, candidates, what): built from known T and c, so that each usual
# mistake picks an m of its own in at least one case, with the right m clear of its neighbours
M_CASES = (
    _m_case(2, 0.136, 0.0047, (1, 2, 4, 8), (1, 2, 4, 8, 16, 32),
            "a CPU-like pipeline of 2 stages (measured at m = 1, 2, 4, 8)"),
    _m_case(2, 0.5, 0.0005, (1, 2, 4, 8), (1, 2, 4, 8, 16, 32),
            "2 stages with little cost per micro-batch (measured at m = 1, 2, 4, 8)"),
    _m_case(4, 0.1, 0.012, (1, 2, 8, 16), (1, 2, 4, 8, 16),
            "4 stages, measured at m = 1, 2, 8, 16 but not 4"),
    _m_case(2, 0.01, 0.02, (1, 2, 4), (1, 2, 4, 8),
            "2 stages whose cost per micro-batch outweighs the compute"),
)


def _m_diagnosis(steps_s: dict[int, float], p: int, candidates: tuple[int, ...], got: int) -> str:
    right = reference_choose_m(steps_s, p, candidates)
    measured_best = min(steps_s, key=steps_s.get)
    if got not in candidates:
        return f"choose one of the candidates {list(candidates)} (m must divide the batch)"
    if got == measured_best and right not in steps_s:
        return ("that is the fastest m that was measured; the plan must predict the candidates "
                "that were not measured too: fit the measured steps, then predict every "
                "candidate")
    if got == max(candidates):
        return ("that is the most micro-batches: the bubble formula alone always asks for more, "
                "but each micro-batch also pays a fixed cost (hand-over, launches), and with m "
                "micro-batches the step pays it m + p − 1 times")
    if got == min(candidates):
        return ("that is one micro-batch: without the bubble in the model, fewer micro-batches "
                "always win; the (p − 1) idle slots shrink as m grows")
    if got > right:
        return (f"the model predicts m = {got} slower than a smaller candidate: past the "
                "optimum the fixed cost per micro-batch grows faster than the bubble shrinks")
    return (f"the model predicts m = {got} slower than a larger candidate: the bubble still "
            "shrinks faster there than the fixed cost per micro-batch grows")


@exercise(
    "03.choose_m",
    "Choose the number of micro-batches for 1F1B, from measured step times",
    hints=(
        "more micro-batches shrink the bubble, (p−1)/(m+p−1), but each micro-batch also "
        "costs a fixed amount (its sends and receives, its launches, Python) whatever its size. "
        "Model a step as both, fit the model to the measured steps, then predict every candidate",
        "a 1F1B step has m + p − 1 slots per stage; each slot lasts one micro-batch's forward "
        "and backward, T/m for a batch whose compute is T, plus the fixed cost c: "
        "step(m) = (m + p − 1)·(T/m + c). The unknowns are T and c, and the model is linear "
        "in them",
        "two measured m give two equations for T and c; with more, fit by least squares "
        "(every measured m weighs in, and one noisy step moves the fit less). Then predict the "
        "candidates that were not measured too, and keep the fastest",
        "recipe: for each measured m, write its step as hint 2's model, T times a factor that "
        "depends on m and p alone plus c times another such factor; "
        "solve for T and c by least squares over the measured steps (two unknowns: the 2×2 "
        "normal equations); predict each candidate's step with them; return the candidate "
        "with the smallest predicted step",
    ),
    reference=reference_choose_m,
)
def _verify_choose_m(choose_m: Any) -> str:
    fn = _require_callable(choose_m, "choose_m(steps_s: dict[int, float], p: int, "
                                     "candidates: list[int]) -> int")  # fmt: skip
    for steps_s, p, candidates, what in M_CASES:
        shown = f"{_name(fn)}({{{', '.join(f'{m}: {t:.4g}' for m, t in steps_s.items())}}}, {p}, {list(candidates)})"
        got = call(fn, dict(steps_s), p, list(candidates))
        if isinstance(got, bool) or not isinstance(got, int):
            raise ExerciseFailed(f"{shown} returned {type(got).__name__} {short_repr(got)}; "
                                 "return one of the candidates, an int")  # fmt: skip
        if got != reference_choose_m(steps_s, p, candidates):
            raise ExerciseFailed(f"for {what}, {shown} chose m = {got}: "
                                 f"{_m_diagnosis(steps_s, p, candidates, got)}")  # fmt: skip
    return (f"{_name(fn)} predicts every candidate from the measured steps and picks the "
            f"fastest, on {len(M_CASES)} pipelines (2 and 4 stages, the best m measured or not); "
            "below, your choice runs for real beside its neighbours")


M_REPEATS = 5  # timed steps per m in the run: the fewest a verdict takes (labkit.verdict.MIN_RUNS)


def judge_m_plan(chosen: int, steps_s: Mapping[int, Sequence[float]]) -> str:
    """The verdict on a chosen m from the measured steps of it and its neighbours
    (``labkit.verdict.compare_times``, one comparison per neighbour), and a conclusion chosen
    by their outcomes."""
    from labkit import verdict

    lines, beaten, noisy = [], [], []
    for m in sorted(steps_s):
        if m == chosen:
            continue
        v = verdict.compare_times(steps_s[chosen], steps_s[m],
                                  names=(f"1F1B, m = {chosen} (your choice)", f"1F1B, m = {m}"))  # fmt: skip
        lines.append(str(v))
        if v.outcome == "noisy":
            noisy.append(m)
        elif v.outcome == "faster" and v.faster is v.b:
            beaten.append(m)
    if beaten:
        end = (f"the plan missed: m = {', '.join(map(str, beaten))} ran faster (measured). The "
               "model charges each micro-batch a fixed cost and shares the compute evenly; "
               "compute that does not shrink in proportion to the micro-batch (small matrices "
               "run below the machine's rate) or a busier machine during the sweep moves the "
               "optimum")
    elif noisy:
        end = (f"no neighbour ran clearly faster, but against m = "
               f"{', '.join(map(str, noisy))} it is too noisy to tell: rerun the cell, or run it "
               "when the machine is quieter")
    else:
        end = f"the plan held: no neighbour of m = {chosen} ran faster (measured)"
    return "\n".join([*lines, end])


def run_m_plan(chosen: int, candidates: Sequence[int], model: dict[str, int], batch_size: int,
               p: int = NPROC, repeats: int = M_REPEATS) -> str:  # fmt: skip
    """Run 1F1B for real at the chosen m and at its neighbours among ``candidates`` (one job of
    ``labkit.workers.pp_train``) and judge it with :func:`judge_m_plan`."""
    from labkit.jobs import launch

    ordered = sorted(candidates)
    if chosen not in ordered:
        return f"m = {chosen!r} is not one of the candidates {ordered}: nothing run"
    i = ordered.index(chosen)
    ms = ordered[max(0, i - 1): i + 2]
    job = launch.run("labkit.workers.pp_train", nproc=p, timeout_s=300, stream=False,
                     config={"model": model, "schedules": ["1f1b"], "microbatches": ms,
                             "batch_size": batch_size, "warmup": 1, "repeats": repeats},
                     observers=[launch.ProgressLines("1F1B timing job")])  # fmt: skip
    steps = {r["m"]: r["steps_s"] for r in job.rank(0)["runs"]}
    return (f"ran 1F1B on {p} ranks ({job.backend}), batch {batch_size}, m = "
            f"{', '.join(map(str, ms))}: {repeats} timed steps each (rank 0's)\n"
            + judge_m_plan(chosen, steps))
