"""Command line: ``python -m labkit <command>`` (also installed as ``labkit``).

    labkit doctor      an instructor's pre-flight check of this machine (--json for scripts)
    labkit tier        which tier this machine runs the course in, and what that can show
    labkit launch      run a worker module on this machine's ranks, alone or as one node of a
                       job across machines (--nodes N --endpoint HOST:PORT: the same on every node)
    labkit cleanup     end processes left by jobs whose notebook kernel was killed
                       (--runs N: also delete all but the newest N job log folders)
    labkit notebooks   regenerate the learners' notebooks from solutions/ (--check to compare)
    labkit record-trace  record notebook 01's training run on a GPU, for replay without one
    labkit record-profile  profile notebook 06's training step on a GPU, for learners without one
    labkit recordings  build the key GPU figures that ship from a GPU run's benchmark results
                       (build FILES --out DIR), or show what ships (show)
    labkit public-traces  fetch real multi-GPU profiler traces (Holistic Trace Analysis's
                       test data, MIT) for notebook 06 and the tests (fetch [--all], where)
    labkit exam        a mock exam drawn from every quiz bank, scored by sub-topic (--history)
    labkit capstone    new [--level L]: a job code for notebook 07's slow job (and the
                       instructor's key file); reveal --job CODE (or --seed N --level L): its
                       answer key (needs the key file); reveal --give-up: a learner opens
                       their own job's key, and the record says so
    labkit timings     each notebook's run time, per section, and peak memory on this machine
    labkit slurm       an sbatch script that runs a worker on a SLURM cluster's nodes
    labkit hosted-check  what this machine shows the course (versions, tier, training dtype,
                       what is missing), as a hosted notebook's setup cell prints it
"""

from __future__ import annotations

import argparse
import importlib
import sys


def _tier(_: argparse.Namespace) -> int:
    from labkit import hardware

    print(hardware.describe_tier())
    print(hardware.cpu_info())
    status = hardware.nvml_status()
    print(f"NVML: {'ok' if status.ok else 'unavailable'}: {status.message}")
    return 0


def _cleanup(args: argparse.Namespace) -> int:
    from labkit.jobs import launch, procs

    if args.runs is not None and args.runs < 0:
        print(f"labkit cleanup: --runs {args.runs}: need a number >= 0 of job log folders to "
              "keep (0 deletes all of them but those of running jobs)", file=sys.stderr)
        return 2
    # Processes first: a job whose leftovers are ended here no longer counts as running below.
    ended = launch.cleanup()
    n_pids = sum(len(job["pids"]) for job in ended)
    print(f"ended {n_pids} process(es) left by {len(ended)} job(s)" if ended
          else "no leftover job processes")
    if args.runs is not None:
        removed = procs.prune_runs(args.runs)
        print(f"deleted {len(removed)} job log folder(s) in {procs.default_runs_dir()}")
    return 0


def _capstone(args: argparse.Namespace) -> int:
    from labkit.course import capstone
    from labkit.course.capstone import attempts, keys

    def refuse(message: str) -> int:
        print(f"labkit capstone: {message}", file=sys.stderr)
        return 2

    if args.action == "reveal" and args.give_up:
        code = args.job or attempts.last_code()
        if code is None:
            return refuse("reveal --give-up opens a job's key, and no capstone job has run "
                          "here: give --job CODE (the code notebook 07 printed)")
        try:
            job = keys.read_code(code)
        except keys.CapstoneKeyError as err:
            return refuse(str(err))
        record = attempts.give_up(job.text)
        print(capstone.describe(job.open(), job.tier, f"job {job.text} ({job.tier} tier) plants:"),
              end="")
        print(f"recorded: you opened this job's key on {record['gave_up']}, after "
              f"{len(record['attempts'])} attempt(s) ({attempts.path(job.text)})")
        return 0
    if args.action == "reveal" and args.job:  # the instructor, by the learner's code
        try:
            job, key = keys.read_code(args.job), keys.load(args.key)
        except keys.CapstoneKeyError as err:
            return refuse(str(err))
        level = next(lv for lv, (count, _) in capstone.LEVELS.items() if count == len(job.open()))
        if capstone.plan(job.seed, job.tier, key, level) != job.open():
            return refuse(f"job {job.text} was not made with the key file {key.path}: reveal it "
                          "with the key that made it (--key PATH)")  # fmt: skip
        print(capstone.reveal(job.seed, job.tier, key, level), end="")
        return 0
    if args.give_up or args.job:
        return refuse("--give-up and --job go with reveal: "
                      "`python -m labkit capstone reveal --give-up [--job CODE]`")
    # notebook 07's job: one GPU per rank (2 ranks) or CPU ranks, whatever else the machine has
    tier = args.tier or capstone.placement()[1]
    if args.action == "reveal" and args.seed is None:
        return refuse("reveal needs --seed N, the seed of the learner's job code "
                      "('cpu-N-…'), and your key file (--key PATH if not the default); a "
                      "learner opens their own job with reveal --give-up")
    try:
        seed = capstone.new_seed() if args.seed is None else capstone.parse_seed(args.seed)
        if args.action == "new":
            key, made = keys.create(args.key)
        else:
            key = keys.load(args.key)
    except (capstone.SeedError, keys.CapstoneKeyError) as err:
        return refuse(str(err))
    if args.action == "reveal":
        print(capstone.reveal(seed, tier, key, args.level), end="")
        return 0
    code = keys.code_for(capstone.plan(seed, tier, key, args.level), tier, seed)
    print(f"capstone job {code} (seed {seed}, {tier} tier, level {args.level}): give the "
          f"learner this code, as "
          f"job_code={code!r} in notebook 07 (or LABKIT_CAPSTONE_JOB={code})")
    print(f"your key file: {key.path} ({'made now, mode 0600' if made else 'the one you had'}): "
          "keep it to yourself and keep a copy; with it, reveal --seed N shows a seed's faults")
    return 0


def capstone_levels() -> tuple[str, ...]:
    from labkit.course.capstone.faults import LEVELS

    return tuple(LEVELS)


def _notebooks(args: argparse.Namespace) -> int:
    from labkit.course import nbgen

    return nbgen.main(["--check"] if args.check else [])


# Commands that parse their own options: name -> (module with main(argv), help line).
DELEGATED: dict[str, tuple[str, str]] = {
    "doctor": ("labkit.hardware.doctor", "pre-flight check of this machine"),
    "record-trace": ("labkit.course.record", "record notebook 01's run on a GPU"),
    "record-profile": ("labkit.recordings.profiles", "profile notebook 06's step on a GPU"),
    "recordings": ("labkit.recordings.build", "key GPU figures recorded on real hardware"),
    "public-traces": ("labkit.recordings.public", "real multi-GPU traces, fetched and checked"),
    "exam": ("labkit.course.exam", "a mock exam from every quiz bank"),
    "launch": ("labkit.jobs.launch", "run a worker, alone or as one node of several"),
    "timings": ("labkit.course.timings", "time every notebook, per section, with peak memory"),
    "slurm": ("labkit.jobs.slurm", "an sbatch script for a job on a SLURM cluster"),
    "hosted-check": ("labkit.course.hosted", "what a hosted notebook's machine shows the course"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] and argv[0] in DELEGATED:
        module = importlib.import_module(DELEGATED[argv[0]][0])
        return module.main(argv[1:])
    parser = argparse.ArgumentParser(prog="labkit", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (_, help_line) in DELEGATED.items():  # listed in --help; parsed by their own main
        sub.add_parser(name, help=f"{help_line} (see: labkit {name} -h)")
    sub.add_parser("tier", help="show this machine's tier and what it can show").set_defaults(
        fn=_tier)
    cl = sub.add_parser("cleanup", help="end leftovers of jobs whose kernel died")
    cl.add_argument("--runs", type=int, metavar="N",
                    help="also delete all but the newest N job log folders")
    cl.set_defaults(fn=_cleanup)
    cap = sub.add_parser("capstone", help="notebook 07's job codes and answer keys")
    cap.add_argument("action", choices=["new", "reveal"])
    cap.add_argument("--seed", help="a whole number (new: draw one if absent)")
    cap.add_argument("--key", metavar="PATH",
                     help="the instructor's key file (default labkit_home()/capstone/key.json; "
                          "new makes it if missing)")
    cap.add_argument("--give-up", action="store_true",
                     help="reveal, for a learner: open your job's key (recorded in your "
                          "attempt record)")
    cap.add_argument("--job", metavar="CODE",
                     help="reveal: the job code to open, with your key file (the instructor), or "
                          "with --give-up (a learner; default: the last job run here)")
    cap.add_argument("--level", choices=list(capstone_levels()), default="standard",
                     help="how many faults and how subtle: intro (3, each shown by one "
                          "measurement), standard (4, some by a comparison), expert (5, some "
                          "only in a trace or a series); reveal --seed N needs the level the "
                          "code was made at, reveal --job CODE reads it (default standard)")
    cap.add_argument("--tier", choices=["cpu", "single-gpu", "multi-gpu"],
                     help="the tier notebook 07's job runs on: multi-gpu with a GPU per rank, "
                          "single-gpu for a one-rank job on one GPU, else cpu (default: this "
                          "machine's)")
    cap.set_defaults(fn=_capstone)
    nb = sub.add_parser("notebooks", help="generate notebooks/ from solutions/")
    nb.add_argument("--check", action="store_true", help="only compare; exit 1 on drift")
    nb.set_defaults(fn=_notebooks)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
