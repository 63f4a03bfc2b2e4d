"""Check a learner's data-parallel exercise inside real ranks.

    from labkit.course.exercises.data_parallel import DPChecksConfig
    labkit.jobs.launch.run(DPChecksConfig(exercises=["02.allreduce_grads"], module="dp_overlap",
                                          module_dir="/path/to/folder"), nproc=2)

Usually started by ``labkit.course.exercises.check_in_workers``. Every rank imports the learner's
``<module_dir>/<module>.py`` and runs each exercise's check (``labkit.course.exercises.data_parallel``) in its
own process group, so an all-reduce in the learner's code really sums over ranks. A wrong
answer or the unfinished stub is reported in the rank's result, not raised: every rank
finishes the job and the notebook shows one clean message. Only a crash or a hang ends the
job with an error.

Config: :class:`labkit.course.exercises.data_parallel.DPChecksConfig`:
    exercises   ids from ``labkit.course.exercises.data_parallel.EXERCISES``
    module      the learner's module name (default "dp_exercises")
    module_dir  the folder that holds it (required)
"""

from __future__ import annotations

from typing import Any

from labkit.course.exercises import collective_ledger
from labkit.jobs import runtime


@runtime.entrypoint
def main(ctx: runtime.Context) -> dict[str, Any]:
    from labkit.course.exercises import data_parallel  # registers the 02.* checks

    cfg = data_parallel.DPChecksConfig.from_dict(ctx.config)
    # Not marked as a collective: the learner's code runs here, and may never reach one.
    with ctx.phase("check", collective=False), collective_ledger(ctx):
        results = data_parallel.run_checks(cfg.exercises, cfg.module, cfg.module_dir)
    for r in results:
        ctx.print0(f"{r['id']}: {r['status']}")
    return {"rank": ctx.rank, "world_size": ctx.world_size, "results": results}


if __name__ == "__main__":
    main()
