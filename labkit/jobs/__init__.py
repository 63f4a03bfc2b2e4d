"""Running jobs: a multi-process job launched from a cell, watched, diagnosed and ended cleanly.

A notebook calls :func:`labkit.jobs.launch.run`; everything else here serves it or the ranks it
starts. From the bottom up:

    nodes        where this machine sits in a multi-node job; torchrun's flags for it
    spec         a job before it runs: a worker's typed config; the job folder (no torch)
    spawn        the exec wrapper that ties a child's life to its parent's (and supervises)
    runtime      a rank's side of a job: process group, heartbeats, stack dumps, results
    procs        process trees of launched jobs, ended cleanly; the job registry
    diagnosis    which rank caused a failure, how it ended, who merely followed (a folder:
                 evidence, tracebacks, hangs, fingerprints, collective_ledger)
    slurm        the sbatch script for a course job on a SLURM cluster
    observers    a running job as a live plot sees it (Job); ProgressLines
    outcome      what a job leaves: JobResult, or the error that says why not
    preflight    launch's checks before anything starts, and the job's folder
    supervisor   a running job: torchrun started, watched, ended with all it began
    cli          ``python -m labkit launch`` on each node; several nodes rehearsed on one
    launch       one way to run a job from a cell: run() and the names notebooks use
    checkpoint   atomic DCP checkpoints a restarted job resumes from (a folder: saving,
                 loading, folders, costs, ranks)

Importing this folder imports none of them: ``from labkit.jobs import launch``.
"""
