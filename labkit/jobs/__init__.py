"""Running jobs: a multi-process job launched from a cell, watched, diagnosed and ended cleanly.

A notebook calls :func:`labkit.jobs.launch.run`; everything else here serves it or the ranks it
starts. From the bottom up:

    nodes        where this machine sits in a multi-node job; torchrun's flags for it
    spec         a job before it runs: a worker's typed config, naming its module (no torch)
    spawn        the exec wrapper that ties a child's life to its parent's (and supervises)
    runtime      a rank's side of a job: process group, heartbeats, stack dumps, results
    procs        process trees of launched jobs, ended cleanly; the job registry
    diagnosis    which rank caused a failure, how it ended, who merely followed
    slurm        the sbatch script for a course job on a SLURM cluster
    launch       one way to run a job from a cell: checks, supervision, results, the CLI
    checkpoint   atomic DCP checkpoints a restarted job resumes from

Importing this folder imports none of them: ``from labkit.jobs import launch``.
"""
