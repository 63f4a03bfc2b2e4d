"""labkit.recordings.public: fetching public GPU traces, checked, and finding a copy.

No network here: the "server" is a folder read through ``file://`` URLs, holding SYNTHETIC
traces (``tests/gpu_traces.py``) in a job registered for the test with their real sizes and
hashes. The real jobs' table is checked against the files where a copy is present.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest
from gpu_traces import build

from labkit.recordings import public


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture()
def server(tmp_path, monkeypatch):
    """A folder laid out as HTA's tests/data with a 2-rank job, and its licence."""
    root = tmp_path / "upstream" / "tests" / "data"
    (root / "toy_job").mkdir(parents=True)
    files = []
    for r in range(2):
        path = build(rank=r, world_size=2).write(root / "toy_job" / f"rank-{r}.json.gz", gz=True)
        files.append(public.PublicFile(f"toy_job/rank-{r}.json.gz", path.stat().st_size, _sha(path)))
    licence = tmp_path / "upstream" / "LICENSE"
    licence.write_text("MIT License (test copy)\n")
    job = public.PublicJob("toy_job", "a synthetic 2-rank job", "test, 2026-12-06", tuple(files))
    monkeypatch.setitem(public.JOBS, "toy_job", job)
    monkeypatch.setattr(public, "LICENSE_SHA256", _sha(licence))
    monkeypatch.setenv("LABKIT_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("LABKIT_GPU_TRACES", raising=False)
    monkeypatch.delenv("LABKIT_OFFLINE", raising=False)
    return {"base_url": root.as_uri() + "/", "license_url": licence.as_uri(), "root": root}


def _fetch(server, **kw):
    return public.fetch(["toy_job"], base_url=server["base_url"],
                        license_url=server["license_url"], **kw)  # fmt: skip


def test_fetch_downloads_checks_and_keeps_the_licence_beside_the_traces(server):
    root = _fetch(server)
    assert root == public.download_dir()
    assert sorted(p.name for p in (root / "toy_job").iterdir()) == ["rank-0.json.gz", "rank-1.json.gz"]
    assert (root / "LICENSE-HolisticTraceAnalysis").read_text().startswith("MIT")
    assert public.COMMIT in (root / "SOURCE.txt").read_text()
    assert public.job_folder("toy_job") == root / "toy_job"
    assert not list(root.rglob("*.part"))


def test_a_second_fetch_downloads_nothing(server):
    root = _fetch(server)
    before = {p: p.stat().st_mtime_ns for p in (root / "toy_job").iterdir()}
    for p in server["root"].rglob("*.gz"):
        p.unlink()  # the "server" is gone: a fetch that tried to download would fail
    _fetch(server)
    assert {p: p.stat().st_mtime_ns for p in (root / "toy_job").iterdir()} == before


def test_a_file_that_changed_upstream_is_refused_and_removed(server):
    victim = server["root"] / "toy_job" / "rank-1.json.gz"
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF  # same size, another hash
    victim.write_bytes(bytes(data))
    with pytest.raises(public.PublicTraceError, match=r"SHA-256 .* refused and removed"):
        _fetch(server)
    target = public.download_dir() / "toy_job"
    assert not (target / "rank-1.json.gz").exists() and not list(target.glob(".*part"))


def test_a_cut_off_download_is_refused(server):
    victim = server["root"] / "toy_job" / "rank-0.json.gz"
    victim.write_bytes(victim.read_bytes()[:100])
    with pytest.raises(public.PublicTraceError, match=r"100 bytes arrived, \d+ expected"):
        _fetch(server)


def test_no_network_names_the_url_and_the_offline_way(server):
    with pytest.raises(public.PublicTraceError) as err:
        public.fetch(["toy_job"], base_url="file:///nonexistent/labkit/", license_url="file:///x")
    assert "file:///nonexistent/labkit/toy_job/rank-0.json.gz" in str(err.value)
    assert "LABKIT_GPU_TRACES" in str(err.value)


def test_a_folder_that_cannot_be_written_is_named_not_blamed_on_the_network(server, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(public.PublicTraceError, match=r"could not write into .*a-file") as err:
        _fetch(server, dest=blocker / "traces")
    assert "download" not in str(err.value)


def test_find_or_fetch_never_raises_for_a_home_it_cannot_write(server, monkeypatch, tmp_path):
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("LABKIT_HOME", str(tmp_path / "a-file" / "home"))
    folder, note = public.find_or_fetch("toy_job")
    assert folder is None and "could not write" in note


def test_find_or_fetch_offline_says_how_and_downloads_nothing(server, monkeypatch):
    monkeypatch.setenv("LABKIT_OFFLINE", "1")
    folder, note = public.find_or_fetch("toy_job")
    assert folder is None
    assert "python -m labkit public-traces fetch" in note and "LABKIT_OFFLINE" in note
    assert not public.download_dir().exists()


def test_find_or_fetch_reports_a_failed_download_without_raising(server, monkeypatch):
    def unreachable(*_, **__):
        raise public.PublicTraceError("could not download https://example.invalid/x: no route")

    monkeypatch.setattr(public, "fetch", unreachable)
    folder, note = public.find_or_fetch("toy_job")
    assert folder is None and "The download failed: could not download" in note


def test_a_copy_named_by_labkit_gpu_traces_is_found_first(server, monkeypatch):
    monkeypatch.setenv("LABKIT_GPU_TRACES", str(server["root"]))
    folder, note = public.find_or_fetch("toy_job", allow_fetch=False)
    assert folder == server["root"] / "toy_job" and "read from" in note
    assert public.data_root("toy_job") == server["root"]


def test_a_partial_copy_is_not_taken_for_the_job(server, monkeypatch):
    (server["root"] / "toy_job" / "rank-1.json.gz").unlink()
    monkeypatch.setenv("LABKIT_GPU_TRACES", str(server["root"]))
    assert public.job_folder("toy_job") is None


def test_the_jobs_table_is_consistent():
    for key, job in public.JOBS.items():
        assert job.files and all(f.path.startswith(key + "/") for f in job.files), key
        assert all(re.fullmatch(r"[0-9a-f]{64}", f.sha256) and f.size > 0 for f in job.files)
        assert "MIT" in job.label() and public.COMMIT[:7] in job.label()
    assert len(public.JOBS[public.MULTI_RANK].files) >= 2  # notebook 06 reads two ranks of one job


def test_present_copies_are_the_files_the_table_names():
    root = public.data_root()
    if root is None:
        pytest.skip("no copy of the public traces here (python -m labkit public-traces fetch)")
    for job in public.JOBS.values():
        for f in job.files:
            if (root / f.path).is_file():
                assert _sha(root / f.path) == f.sha256, f.path


def test_the_command_line_lists_where_each_job_is(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("LABKIT_HOME", str(tmp_path))
    monkeypatch.delenv("LABKIT_GPU_TRACES", raising=False)
    assert public.main(["where"]) == 0
    out = capsys.readouterr().out
    assert all(key in out for key in public.JOBS)
