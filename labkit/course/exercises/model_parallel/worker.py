"""Run a learner's exercise code inside real ranks (notebooks 03, 03b and 03c) and report what
each rank saw.

    from labkit.course.exercises.rank_checks import CasesConfig
    labkit.jobs.launch.run(CasesConfig(cases=[
        {"exercise": "03.f_and_g", "path": ".../mp_fg.py", "module": "mp_fg",
         "names": ["Enter", "Leave", "TensorParallelMLP"]},
    ]), nproc=2)

The notebook's checks (``labkit.course.exercises.model_parallel`` for 03, ``labkit.course.exercises.composing``
for 03b, ``labkit.course.exercises.sequences_experts`` for 03c: the module that registered the
exercise) build each case from the learner's objects; this worker imports the learner's file
itself (``rank_checks.resolve``), because a process cannot import code that exists only in
the notebook kernel. Several cases run one after the other in one launch (the tests use that to
check a solution, a stub and a wrong answer at the cost of one start-up).

Config: :class:`labkit.course.exercises.rank_checks.CasesConfig`, its ``cases`` each a dict of
{"exercise", "path", "module", "names"} (see ``rank_checks.answer_spec``).

Result per rank: {"rank", "cases": [{"exercise", "status", "message"}, ...]}, status "ok",
"incomplete" (the stub) or "failed" (with the likely mistake). A learner's mistake is a result,
not a crash: the job only fails if the worker itself cannot run.
"""

from __future__ import annotations

import importlib
from typing import Any

from labkit import ids
from labkit.course.exercises import MODULES, collective_ledger, rank_checks
from labkit.jobs import runtime


@runtime.entrypoint
def main(ctx: runtime.Context) -> dict[str, Any]:
    cases = rank_checks.CasesConfig.from_dict(ctx.config).cases
    results = []
    with collective_ledger(ctx):  # which rank called which collective, for a check that hangs
        for i, spec in enumerate(cases):
            try:
                objs = rank_checks.resolve(spec)
            except Exception as err:  # the learner's file does not import: report, do not crash
                res = {"exercise": spec.get("exercise"), "status": "failed",
                       "message": f"importing {spec.get('path')} raised {type(err).__name__}: {err}"}  # fmt: skip
            else:
                checks = importlib.import_module(MODULES[ids.of(spec["exercise"])])
                res = checks.rank_check(spec["exercise"], objs, ctx)
            results.append(res)
            ctx.heartbeat(step=i + 1, total=len(cases))
    return {"rank": ctx.rank, "cases": results}


if __name__ == "__main__":
    main()
