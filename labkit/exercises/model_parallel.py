"""Exercise checks for notebook 03 (model parallelism), run in the kernel and inside worker ranks.

Parallel code is only proven by running it in parallel, so two of these exercises run the
learner's code inside real ranks, and the third (a pure function) is also executed there, as
the schedule of a real pipeline. A worker process cannot import code that exists only in a
notebook kernel (pytorch #20375), so the learner writes each answer to a file with
``%%writefile``, as in notebook 02 (``labkit.exercises.data_parallel``)::

    ex_dir = ex.workspace("03")               # labkit_home()/exercises/03
    %%writefile {ex_dir}/mp_fg.py
    ...
    ex.check_in_workers("03.f_and_g", ex_dir / "mp_fg.py")
    # ✓ 03.f_and_g: your f and g carry a column-then-row-parallel MLP on 2 ranks: ...

``check_in_workers`` (through :func:`verify_file`) imports the file in the kernel and runs the exercise's registered check
(``labkit.exercises.verify``): first what can be checked here (a stub is reported at once, an
order of operations is compared action by action, a shard is checked for every rank of 2, 3
and 4), then a launch of ``labkit.exercises.mp_worker`` on 2 ranks, each of which imports the
same file and runs the rank-side check (``rank_check``). A rank's verdict comes back as the
notebook's ``ExerciseIncomplete`` or ``ExerciseFailed``, naming the rank.

Exercises (``EXERCISES``: id -> the names the learner's file defines):

* ``03.one_f_one_b``: the 1F1B order of one stage, ``one_f_one_b(p, m, stage)``; in the
  workers, the learner's order drives a real 2-stage pipeline (``labkit.parallel.pipeline``)
  whose loss and gradients must equal GPipe's.
* ``03.f_and_g``: Megatron's f and g as ``torch.autograd.Function`` classes ``Enter`` and
  ``Leave``; in the workers they carry a column-then-row-parallel MLP, checked against the
  unsplit MLP.
* ``03.column_parallel``: ``column_parallel_linear(x, linear, rank, world_size)``, one rank's
  output features of ``linear(x)``; in the workers each rank's shard, its gradient, and the
  all-gathered shards are checked against ``nn.Linear``.

Importing this module registers the exercises and has no other effect.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from labkit.exercises import (
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
    time_limit_paused,
    verify,
)

WORKER = "labkit.exercises.mp_worker"
NPROC = 2  # ranks the worker-run checks use
DEVICE = "cpu"  # gloo ranks: every machine has them, and the checks are about correctness
LAUNCH_TIMEOUT_S = 90.0  # start-up takes seconds; only a hung rank gets near it
PG_TIMEOUT_S = 30.0  # a learner's unmatched collective fails after this, not after 30 minutes

EXERCISES: dict[str, tuple[str, ...]] = {
    "03.one_f_one_b": ("one_f_one_b",),
    "03.f_and_g": ("Enter", "Leave"),
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


def answer_from_file(exercise_id: str, path: str | Path) -> Any:
    """The learner's answer to ``exercise_id``: the objects ``EXERCISES`` names, from ``path``
    (one object, or a tuple of them)."""
    if exercise_id not in EXERCISES:
        raise ValueError(f"exercise_id={exercise_id!r}: use one of {sorted(EXERCISES)}")
    module = load_file(path)
    missing = [n for n in EXERCISES[exercise_id] if not hasattr(module, n)]
    if missing:
        raise ExerciseFailed(
            f"{path} defines no {', '.join(missing)}: keep the names the exercise cell uses"
        )
    objs = tuple(getattr(module, n) for n in EXERCISES[exercise_id])
    return objs[0] if len(objs) == 1 else objs


def verify_file(exercise_id: str, path: str | Path) -> tuple[str, str]:
    """Check the learner's file ``path`` for ``exercise_id``, in the kernel and on 2 ranks.

    Returns (what was verified, where) or raises ``ExerciseIncomplete`` (still the stub) or
    ``ExerciseFailed`` (what was expected, what came back, the likely mistake, which rank).
    Notebooks call it through :func:`labkit.exercises.check_in_workers`.
    """
    __tracebackhide__ = True
    if exercise_id not in EXERCISES:
        raise ValueError(f"exercise_id={exercise_id!r}: use one of {sorted(EXERCISES)}")
    try:
        answer = answer_from_file(exercise_id, path)
    except ExerciseFailed as err:
        err.args = (f"Exercise {exercise_id} ({get(exercise_id).title}) failed: {err}",)
        err.exercise_id = exercise_id
        raise
    except Exception as err:  # the file does not import: a learner's mistake, reported
        raise ExerciseFailed(
            f"importing {path} raised {type(err).__name__}: {err}{learner_frame(err)}"
        ) from err
    return verify(exercise_id, answer), f"checked in the kernel and on {NPROC} ranks"


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


def run_in_workers(exercise_id: str, objs: Sequence[Any]) -> str:
    """Launch ``WORKER`` on ``NPROC`` ranks to check ``objs`` there.

    Returns the ranks' sentence; raises ``ExerciseIncomplete`` or ``ExerciseFailed`` as the
    ranks report, naming the first rank that failed. The one place these checks launch a job
    (tests replace it to check the kernel side alone).
    """
    from labkit import launch  # lazy: importing this module must stay cheap

    spec = answer_spec(exercise_id, objs)
    try:
        with time_limit_paused():  # the job has its own limit, and ends its processes
            job = launch.run(WORKER, nproc=NPROC, device=DEVICE, config={"cases": [spec]},
                             timeout_s=LAUNCH_TIMEOUT_S, pg_timeout_s=PG_TIMEOUT_S,
                             stream=False)  # fmt: skip
    except (launch.JobFailed, launch.JobTimeout) as err:
        reports = {
            r: f"on rank {r} of {NPROC}: {res['cases'][0]['message']}"
            for r, res in enumerate(err.result.ranks)
            if res.get("cases") and res["cases"][0].get("status") == "failed"
        }
        raise ExerciseFailed(explain_job_error(err, reports)) from None
    return raise_for_results(exercise_id, [r["cases"][0] for r in job.ranks])


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
        "recipe: warm-up = min(p − 1 − stage, m) forwards; then, while forwards remain, one "
        "forward followed by one backward; then the remaining backwards, oldest micro-batch "
        "first",
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


def _rank_f_and_g(ctx: Any, enter: Any, leave: Any) -> str:
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
        raise ExerciseFailed(f"Likely: {why}")
    return (f"your f and g carry a column-then-row-parallel MLP on {n} ranks: output, dL/dx "
            "and every weight gradient equal the unsplit MLP's")  # fmt: skip


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
    "Megatron's f and g operators as autograd Functions",
    hints=(
        "f and g are conjugates: where one communicates in the forward pass the other "
        "communicates in the backward pass; ask which quantities each rank already holds in "
        "full and which it holds only a part of",
        "before the column-parallel layer every rank has all of x, but each computes only part "
        "of dL/dx; after the row-parallel layer each rank has a partial sum of the output, and "
        "the gradient of a sum is passed to every term unchanged",
        "recipe: Enter (f): forward returns x unchanged, backward all-reduces a clone of grad; "
        "Leave (g): forward all-reduces a clone of x, backward returns grad unchanged",
    ),
)
def _verify_f_and_g(answer: Any) -> str:
    if not (isinstance(answer, (tuple, list)) and len(answer) == 2):
        raise ExerciseFailed(f"expected the pair (Enter, Leave) of classes, got {answer!r}")
    _probe_backward(answer[0], "f (Enter)")
    _probe_backward(answer[1], "g (Leave)")
    return run_in_workers("03.f_and_g", list(answer))


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
                    f"out_features / world_size = {per} output features for every input "
                    "row")  # fmt: skip
        got = got.detach()
        if _close(got, want):
            return None
        for other in range(n):
            o = slice(other * per, (other + 1) * per)
            if other != rank and _close(got, full[..., o]):
                return f"that is rank {other}'s slice: start at row rank × out_features/n"
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
                "slice the parameters, without .detach(), .data or torch.no_grad()")  # fmt: skip
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
        "recipe: k = out_features // world_size; take rows rank·k to (rank + 1)·k of the weight "
        "and of the bias, and return x @ Wᵀ + b with them",
    ),
)
def _verify_column_parallel(answer: Any) -> str:
    fn = _require_callable(answer, "column_parallel_linear(x, linear, rank, world_size)")
    for n in (2, 3, 4):  # every rank of several world sizes, here in the kernel
        for r in range(n):
            check_column(fn, r, n)
    return run_in_workers("03.column_parallel", [fn])
