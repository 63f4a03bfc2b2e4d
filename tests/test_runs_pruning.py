"""procs.prune_runs: old job directories are deleted, oldest first, and nothing else is.

Job directories are faked on disk (a spec file, logs, a torchrun/ tree) with mtimes set by
os.utime; "running" jobs are faked by registry records naming this test process, which is
alive. Only the last test launches real jobs.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

import psutil
import pytest

from labkit import __main__ as cli
from labkit.jobs import launch, procs, runtime, supervisor
from labkit.workers.allreduce import AllReduceConfig

DAY = 86400.0


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A private LABKIT_HOME with no LABKIT_KEEP_RUNS from the environment."""
    path = tmp_path / "home"
    monkeypatch.setenv("LABKIT_HOME", str(path))
    monkeypatch.delenv(procs.KEEP_RUNS_ENV, raising=False)
    return path


def make_job(runs: Path, name: str, age_s: float, *, tmp: bool = False) -> Path:
    """A finished-looking job directory last modified ``age_s`` seconds ago."""
    job = runs / name
    (job / "torchrun" / "none_x" / "attempt_0" / "0").mkdir(parents=True)
    (job / "torchrun" / "none_x" / "attempt_0" / "0" / "stdout.log").write_text("hello\n")
    (job / "agent.log").write_text("agent\n")
    (job / "rank0.json").write_text("{}")
    if tmp:
        (job / "tmp").mkdir()
    runtime.write_json_atomic(job / runtime.SPEC_FILE, {"job_id": name})
    stamp = time.time() - age_s
    os.utime(job, (stamp, stamp))
    return job


def register(home: Path, job_id: str, owner: dict | None, *, job_dir: Path | None = None) -> Path:
    """A registry record in the format labkit.jobs.supervisor.Supervisor._save_record writes."""
    path = home / "jobs" / f"{job_id}.json"
    runtime.write_json_atomic(
        path,
        {
            "job_id": job_id,
            "module": "m",
            "job_dir": str(job_dir or home / "runs" / job_id),
            "owner": owner,
            "agent": None,
            "workers": [],
        },
    )
    return path


def names(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()}


# --- which directories go ------------------------------------------------------------------


def test_oldest_by_mtime_go_first_not_by_name(home):
    runs = home / "runs"
    # Name order is the reverse of age order: a by-name prune would delete the newest.
    ages = {"a-job": 1 * DAY, "b-job": 2 * DAY, "c-job": 3 * DAY, "d-job": 4 * DAY}
    for name, age in ages.items():
        make_job(runs, name, age)

    removed = procs.prune_runs(keep=2)

    assert removed == [runs / "d-job", runs / "c-job"]  # oldest first
    assert names(runs) == {"a-job", "b-job"}
    assert procs.prune_runs(keep=2) == []  # already at the limit


def test_keep_zero_deletes_every_finished_job_dir(home):
    runs = home / "runs"
    for i in range(3):
        make_job(runs, f"job-{i}", DAY + i)
    assert len(procs.prune_runs(keep=0)) == 3
    assert names(runs) == set()
    assert runs.is_dir(), "the runs folder itself stays"


def test_only_job_dirs_are_touched(home, tmp_path):
    runs = home / "runs"
    make_job(runs, "job", 5 * DAY)
    (runs / "notes").mkdir(parents=True)  # a folder of the learner's, no spec file
    (runs / "notes" / "todo.txt").write_text("keep me")
    (runs / "loose.txt").write_text("keep me too")
    elsewhere = make_job(tmp_path / "elsewhere", "linked-job", 6 * DAY)
    (runs / "link").symlink_to(elsewhere, target_is_directory=True)
    for entry in ("notes", "loose.txt"):
        old = time.time() - 10 * DAY
        os.utime(runs / entry, (old, old))

    assert procs.prune_runs(keep=0) == [runs / "job"]

    assert names(runs) == {"notes", "loose.txt", "link"}
    assert (runs / "notes" / "todo.txt").read_text() == "keep me"
    assert (elsewhere / runtime.SPEC_FILE).is_file() and (elsewhere / "agent.log").is_file()


def test_a_missing_runs_folder_is_nothing_to_prune(home):
    assert procs.prune_runs(keep=0) == []
    assert procs.prune_runs(keep=0, runs_dir=home / "nowhere") == []


def test_runs_dir_argument_prunes_that_folder_only(home, tmp_path):
    mine = tmp_path / "mine"
    make_job(mine, "old", 2 * DAY)
    make_job(mine, "new", DAY)
    make_job(home / "runs", "default-old", 3 * DAY)
    assert procs.prune_runs(keep=1, runs_dir=mine) == [mine / "old"]
    assert names(home / "runs") == {"default-old"}


# --- running jobs are spared -----------------------------------------------------------------


def test_running_jobs_are_kept_and_not_counted(home):
    runs = home / "runs"
    me = procs.record(psutil.Process())
    # The oldest job is "running": its record names this (live) test process.
    make_job(runs, "running-job", 9 * DAY)
    register(home, "running-job", me)
    # A stale record: the owner's PID with another start time (a recycled PID), so the job
    # is over although its record is still there. Its directory may go.
    make_job(runs, "stale-job", 8 * DAY)
    register(home, "stale-job", {"pid": me["pid"], "create_time": me["create_time"] - 1000})
    # An unreadable record: cannot tell, so keep the directory.
    make_job(runs, "garbled-job", 7 * DAY)
    (home / "jobs" / "garbled-job.json").write_text("{not json")
    # A running job whose record names its directory under another name.
    make_job(runs, "renamed-dir", 6 * DAY)
    register(home, "other-id", me, job_dir=runs / "renamed-dir")
    make_job(runs, "finished-1", 2 * DAY)
    make_job(runs, "finished-2", 1 * DAY)

    removed = procs.prune_runs(keep=1)

    assert removed == [runs / "stale-job", runs / "finished-1"]
    assert names(runs) == {"running-job", "garbled-job", "renamed-dir", "finished-2"}
    # Pruning reads the registry, it does not edit it (that is cleanup()'s job).
    assert names(home / "jobs") == {
        "running-job.json",
        "stale-job.json",
        "garbled-job.json",
        "other-id.json",
    }


def test_a_job_starting_before_its_record_exists_is_kept(home):
    """launch.run writes the spec, then starts torchrun, then registers the job: a fresh
    directory with tmp/ and no record is a starting job. An old one is a killed job's."""
    runs = home / "runs"
    make_job(runs, "starting", 1.0, tmp=True)
    make_job(runs, "killed-long-ago", DAY, tmp=True)
    assert procs.prune_runs(keep=0) == [runs / "killed-long-ago"]
    assert names(runs) == {"starting"}


# --- races and errors ------------------------------------------------------------------------


def test_vanishing_and_undeletable_dirs_are_skipped_silently(home, monkeypatch):
    runs = home / "runs"
    stuck = make_job(runs, "stuck", 3 * DAY)
    gone = make_job(runs, "gone", 2 * DAY)
    fine = make_job(runs, "fine", 1 * DAY)
    real_rmtree = shutil.rmtree

    def flaky_rmtree(path, *args, **kwargs):
        path = Path(path)
        if path.parent == stuck:
            raise PermissionError(13, "Permission denied", str(path))
        if path.parent == gone:  # another kernel pruned the whole directory meanwhile
            real_rmtree(gone)
            raise FileNotFoundError(2, "No such file or directory", str(path))
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", flaky_rmtree)
    assert procs.prune_runs(keep=0) == [fine]
    assert names(runs) == {"stuck"}
    # The spec file goes last, so the half-deleted directory is still a job directory and
    # the next prune (here without the fault) finishes it.
    assert (stuck / runtime.SPEC_FILE).is_file()
    monkeypatch.setattr(shutil, "rmtree", real_rmtree)
    assert procs.prune_runs(keep=0) == [stuck]


# --- the keep count ----------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [-1, 2.5, "3", True])
def test_bad_keep_raises_naming_value_and_fix(home, bad):
    make_job(home / "runs", "job", DAY)
    with pytest.raises(ValueError, match=rf"keep={re.escape(repr(bad))} is not allowed: an integer >= 0"):
        procs.prune_runs(keep=bad)
    assert names(home / "runs") == {"job"}, "nothing is deleted on bad input"


@pytest.mark.parametrize("bad", ["-1", "abc", "2.5", "ten"])
def test_bad_env_value_raises_naming_the_variable(home, monkeypatch, bad):
    make_job(home / "runs", "job", DAY)
    monkeypatch.setenv("LABKIT_KEEP_RUNS", bad)
    with pytest.raises(ValueError, match=rf"LABKIT_KEEP_RUNS='{bad}'.*whole number >= 0"):
        procs.prune_runs()
    assert names(home / "runs") == {"job"}


def test_env_sets_the_default_keep(home, monkeypatch):
    runs = home / "runs"
    for i in range(4):
        make_job(runs, f"job-{i}", DAY * (i + 1))  # job-3 is the oldest
    assert procs.keep_runs() == procs.KEEP_RUNS == 50
    monkeypatch.setenv("LABKIT_KEEP_RUNS", "")  # empty means unset
    assert procs.keep_runs() == 50
    monkeypatch.setenv("LABKIT_KEEP_RUNS", " 3 ")
    assert procs.prune_runs() == [runs / "job-3"]
    monkeypatch.setenv("LABKIT_KEEP_RUNS", "0")
    assert len(procs.prune_runs()) == 3
    assert names(runs) == set()


# --- the command line ------------------------------------------------------------------------


def test_cleanup_command_prunes_with_runs_option(home, capsys):
    runs = home / "runs"
    for i in range(3):
        make_job(runs, f"job-{i}", DAY * (i + 1))
    assert cli.main(["cleanup"]) == 0
    assert names(runs) == {"job-0", "job-1", "job-2"}, "plain cleanup leaves job folders alone"
    assert cli.main(["cleanup", "--runs", "1"]) == 0
    assert f"deleted 2 job log folder(s) in {runs}" in capsys.readouterr().out
    assert names(runs) == {"job-0"}
    assert cli.main(["cleanup", "--runs", "-1"]) == 2
    assert "--runs -1: need a number >= 0" in capsys.readouterr().err
    assert names(runs) == {"job-0"}


# --- launch.run ------------------------------------------------------------------------------


class Started(Exception):
    """Raised instead of starting torchrun: what run() did before that is what we check."""


@pytest.fixture
def no_start(home, monkeypatch):
    def refuse(self):
        raise Started

    monkeypatch.setattr(supervisor.Supervisor, "start", refuse)
    return home


def test_run_prunes_the_default_folder_but_not_a_chosen_log_dir(no_start, monkeypatch, tmp_path):
    runs = no_start / "runs"
    mine = tmp_path / "mine"
    for folder in (runs, mine):
        make_job(folder, "old", 2 * DAY)
        make_job(folder, "older", 3 * DAY)
    monkeypatch.setenv("LABKIT_KEEP_RUNS", "2")

    with pytest.raises(Started):
        launch.run(AllReduceConfig(), nproc=2, log_dir=mine)
    assert {"old", "older"} < names(mine) and len(names(mine)) == 3
    assert names(runs) == {"old", "older"}, "with log_dir given, run() prunes nothing"

    with pytest.raises(Started):
        launch.run(AllReduceConfig(), nproc=2)
    # keep=2 counts the new job's folder: one old one stays.
    assert "old" in names(runs) and "older" not in names(runs) and len(names(runs)) == 2


def test_run_launches_anyway_when_pruning_fails(no_start, monkeypatch, capsys):
    def broken(*args, **kwargs):
        raise PermissionError(13, "Permission denied", "runs")

    monkeypatch.setattr(procs, "prune_runs", broken)
    with pytest.raises(Started):  # it went on to start the job
        launch.run(AllReduceConfig(), nproc=2)
    assert "could not delete old job folders" in capsys.readouterr().out
    assert len(names(no_start / "runs")) == 1


def test_run_with_bad_env_fails_before_making_a_job_dir(no_start, monkeypatch):
    make_job(no_start / "runs", "old", DAY)
    monkeypatch.setenv("LABKIT_KEEP_RUNS", "lots")
    with pytest.raises(ValueError, match="LABKIT_KEEP_RUNS='lots'"):
        launch.run(AllReduceConfig(), nproc=2)
    assert names(no_start / "runs") == {"old"}


@pytest.mark.slow
def test_two_real_launches_with_keep_one_leave_one_job_dir(home, monkeypatch):
    monkeypatch.setenv("LABKIT_KEEP_RUNS", "1")
    config = AllReduceConfig(numel=1000, repeats=2, warmup=1)
    first = launch.run(config, nproc=2, timeout_s=60)
    second = launch.run(config, nproc=2, timeout_s=60)
    assert first.status == second.status == "ok"
    assert [p.name for p in (home / "runs").iterdir()] == [second.log_dir.name]
    assert (second.log_dir / runtime.SPEC_FILE).is_file() and second.log(0)
