"""Public profiler traces of real multi-GPU jobs: fetched on request, checked, labelled.

A learner without GPUs can still read what a real multi-GPU job's traces hold: NCCL kernels on
their own streams, communication overlapping compute, ranks that wait. Holistic Trace Analysis
publishes such traces as its test data (github.com/facebookresearch/HolisticTraceAnalysis,
``tests/data``, MIT licence): real ``torch.profiler`` exports of jobs on NVIDIA GPUs, among
them two of the 128 ranks of an NCCL job. They are not this course's recordings and labkit
does not ship them: ``python -m labkit public-traces fetch`` downloads the ones named below
from GitHub at one pinned commit into the labkit home, checks each file's size and SHA-256,
and writes HTA's licence beside them. Notebook 06 reads them with the learner's own functions
(``labkit.profiling``), and ``tests/test_gpu_traces_real.py`` checks labkit's analysis against
HTA's on them.

Where a copy is looked for, first found first (:func:`data_root`):

1. ``$LABKIT_GPU_TRACES``: a folder laid out as HTA's ``tests/data`` (a checkout's, for one);
2. ``../shared/gpu-traces`` beside the repository (the course's steering notes, where present);
3. the download folder, ``<labkit home>/gpu-traces/hta-<commit>``.

Nothing here touches the network unless :func:`fetch` is called; ``LABKIT_OFFLINE=1`` makes
:func:`find_or_fetch` never try (the test suite sets it).
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import os
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from labkit.errors import LabkitError

REPO = "facebookresearch/HolisticTraceAnalysis"
COMMIT = "f4d0062c382f42bd8a74838bcdad1916c7d5d2da"  # main on 2026-05-01
BASE_URL = f"https://raw.githubusercontent.com/{REPO}/{COMMIT}/tests/data/"
LICENSE_URL = f"https://raw.githubusercontent.com/{REPO}/{COMMIT}/LICENSE"
LICENSE_SHA256 = "da6d3703ed11cbe42bd212c725957c98da23cbff1998c05fa4b3d976d1a58e93"
TIMEOUT_S = 20.0


@dataclass(frozen=True)
class PublicFile:
    """One file of HTA's ``tests/data``: its path there, size in bytes and SHA-256."""

    path: str
    size: int
    sha256: str


@dataclass(frozen=True)
class PublicJob:
    """One job's traces in HTA's test data, and what is known of it (from the traces)."""

    key: str  # its folder in HTA's tests/data
    what: str  # the job, as its traces describe it
    added: str  # the HTA commit and date that added it: the traces are at least that old
    files: tuple[PublicFile, ...]

    @property
    def bytes(self) -> int:
        return sum(f.size for f in self.files)

    def label(self) -> str:
        """The line printed with every figure read from these traces."""
        return (f"Real GPU traces, not recorded by this course nor on this machine: {self.what}. "
                f"Published by Meta as Holistic Trace Analysis's test data ({REPO}, "
                f"tests/data/{self.key}, added {self.added}; MIT licence), read at commit "
                f"{COMMIT[:7]}.")  # fmt: skip


_F = PublicFile
JOBS: dict[str, PublicJob] = {job.key: job for job in (
    PublicJob("trace_filter",
              "2 of the 128 ranks of an NCCL training job (a recommendation model: embedding "
              "all-to-all and DDP all-reduce), 2 profiled steps each; the traces do not name "
              "the GPU, their CUTLASS kernels are built for compute capability 8.0 (Ampere)",
              "5c7898a, 2024-03-21",
              (_F("trace_filter/sampled_rank-0.json.gz", 124247,
                  "71b98c30a2751cc56d9bf78f8fb76467acd56e0be6a1f0da23c600941d29aafd"),
               _F("trace_filter/sampled_rank-1.json.gz", 119799,
                  "2f9a65fd5f319ec8e60468a22dc9a624eb4b40369c729f6f897259d587eca57e"))),
    PublicJob("nccl_parser_config", "rank 0 of a 2-rank NCCL job (a ResNet), 3 steps",
              "3cb077c, 2024-05-23",
              (_F("nccl_parser_config/nccl_data.json.gz", 749757,
                  "c1cf9c575fdcd7bdc6326ceab834f94b351f81ae55577a7471aa9e328fb8b58e"),)),
    PublicJob("ns_resolution_trace",
              "one GPU, 5 steps, its CPU running ahead of the GPU (kernels finish after their "
              "step's range closes)", "c980c48, 2024-04-09",
              (_F("ns_resolution_trace/rank-0.Apr_03_18_51_38.1102.pt.trace.json.gz", 1152519,
                  "e279d7280e73719e8dd9550e120cfe081fbe268596bd297fe5fcbf63e2b75a09"),)),
    PublicJob("trace_diff/control", "rank 3 of an 8-rank job", "0c2146a, 2022-12-15",
              (_F("trace_diff/control/control.json.gz", 1771264,
                  "43ed872e4c5dc2e8da5946d761ed61923a75c6c799cc62be9e1c859d440a56fd"),)),
    PublicJob("trace_diff/test", "rank 1 of a 2-rank job", "0c2146a, 2022-12-15",
              (_F("trace_diff/test/test.json.gz", 1568914,
                  "5e69e04ed19b2dbf59e632008146c1bd6da417dc3af7ab4885c619b11e34f1bf"),)),
    PublicJob("negative_queue_length_values_check", "rank 0 of a 16-rank job",
              "d54e43f, 2023-07-19",
              (_F("negative_queue_length_values_check/rank0.json.gz", 1384658,
                  "b8ce7a1a143b55dd1811d269272b09d1c693ffea85b91858f5fb246e7ad8c5f8"),)),
    PublicJob("trace_file_list", "rank 1 of an inference job, in the 2021 profiler's schema",
              "5f883b1, 2024-08-22",
              (_F("trace_file_list/inference_rank_1.json.gz", 1592,
                  "4c37e0ca5cae61bd6f9d46cc6db0e7e09260df07990d1bf6bbb253f0f636d5e8"),)),
)}  # fmt: skip
"""The jobs labkit reads, by their folder in HTA's tests/data (sizes and hashes at COMMIT)."""

MULTI_RANK = "trace_filter"
"""The job notebook 06 reads: the only one with two ranks of one job (244 kB)."""


class PublicTraceError(LabkitError):
    """Public traces that could not be fetched or do not match; the message says why."""


def download_dir() -> Path:
    """Where :func:`fetch` puts the files: ``<labkit home>/gpu-traces/hta-<commit>``."""
    from labkit.jobs.procs import labkit_home

    return labkit_home() / "gpu-traces" / f"hta-{COMMIT[:12]}"


def _candidates() -> list[Path]:
    out = []
    if os.environ.get("LABKIT_GPU_TRACES"):
        out.append(Path(os.environ["LABKIT_GPU_TRACES"]).expanduser())
    out.append(Path(__file__).resolve().parents[2].parent / "shared" / "gpu-traces")
    out.append(download_dir())
    return out


def _whole(root: Path, job: PublicJob) -> bool:
    return all((root / f.path).is_file() and (root / f.path).stat().st_size == f.size
               for f in job.files)  # fmt: skip


def job_folder(key: str) -> Path | None:
    """The folder holding ``key``'s traces (each file whole), or None where no copy has it."""
    job = _job(key)
    for root in _candidates():
        if _whole(root, job):
            return root / key
    return None


def data_root(key: str = MULTI_RANK) -> Path | None:
    """The first folder laid out as HTA's tests/data that holds ``key``'s traces whole."""
    folder = job_folder(key)
    return None if folder is None else folder.parents[len(Path(key).parts) - 1]


def _job(key: str) -> PublicJob:
    if key not in JOBS:
        raise KeyError(f"no public job {key!r}: the jobs are {', '.join(JOBS)}")
    return JOBS[key]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _download(url: str, dest: Path, size: int | None, sha256: str, timeout_s: float) -> None:
    """Fetch ``url`` into ``dest`` atomically; a file of the wrong size or hash is removed.

    What the network refuses and what this machine cannot write are told apart: the first
    names the URL and the offline way, the second the folder."""
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.part")
    try:
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            out = tmp.open("wb")
        except OSError as e:
            raise PublicTraceError(f"could not write into {dest.parent}: {e.strerror or e}; "
                                   "free space there, or set LABKIT_HOME to a folder you can "
                                   "write") from None  # fmt: skip
        with out:
            try:
                with urllib.request.urlopen(url, timeout=timeout_s) as response:
                    for block in iter(lambda: response.read(1 << 16), b""):
                        out.write(block)
            except (urllib.error.URLError, http.client.HTTPException, TimeoutError,
                    ConnectionError) as e:  # fmt: skip
                reason = getattr(e, "reason", None) or f"{type(e).__name__}: {e}"
                raise PublicTraceError(
                    f"could not download {url}: {reason}. These traces come from GitHub: on a "
                    "machine without access to it, copy HTA's tests/data folder from a checkout "
                    f"of {REPO} (commit {COMMIT[:7]}) and point LABKIT_GPU_TRACES at it") from None
            except OSError as e:  # the network answered; this disk did not take it
                raise PublicTraceError(f"could not write {tmp}: {e.strerror or e}; free space "
                                       f"in {dest.parent}, or set LABKIT_HOME to a folder with "
                                       "room") from None  # fmt: skip
        got = tmp.stat().st_size
        if size is not None and got != size:
            raise PublicTraceError(f"{url}: {got} bytes arrived, {size} expected (a cut-off "
                                   "download, or the file changed upstream); run the fetch "
                                   "again")  # fmt: skip
        digest = _sha256(tmp)
        if digest != sha256:
            raise PublicTraceError(f"{url}: its SHA-256 is {digest}, not the {sha256} labkit "
                                   "checked: refused and removed (the file is not the one "
                                   "these figures were checked on)")  # fmt: skip
        tmp.replace(dest)
    finally:
        with contextlib.suppress(OSError):  # gone already, or its folder never was
            tmp.unlink()


def fetch(keys: tuple[str, ...] | list[str] = (MULTI_RANK,), *, dest: Path | None = None,
          base_url: str = BASE_URL, license_url: str = LICENSE_URL,
          timeout_s: float = TIMEOUT_S) -> Path:  # fmt: skip
    """Download the traces of ``keys`` (and HTA's licence) into ``dest``, skipping files
    already there whole; return the folder, laid out as HTA's tests/data. Each file is
    checked against the size and SHA-256 recorded here, so a figure read from it is the one
    the tests checked."""
    dest = download_dir() if dest is None else Path(dest)
    try:
        return _fetch(keys, dest, base_url, license_url, timeout_s)
    except OSError as e:  # a copy already there that cannot be read, a SOURCE.txt not written
        raise PublicTraceError(f"{e.filename or dest}: {e.strerror or e}; remove {dest} and "
                               "fetch again, or set LABKIT_HOME to a folder you can "
                               "write") from None  # fmt: skip


def _fetch(keys: tuple[str, ...] | list[str], dest: Path, base_url: str, license_url: str,
           timeout_s: float) -> Path:  # fmt: skip
    for key in keys:
        for f in _job(key).files:
            target = dest / f.path
            if target.is_file() and target.stat().st_size == f.size and _sha256(target) == f.sha256:
                continue
            _download(base_url + f.path, target, f.size, f.sha256, timeout_s)
    licence = dest / "LICENSE-HolisticTraceAnalysis"
    if not (licence.is_file() and _sha256(licence) == LICENSE_SHA256):
        _download(license_url, licence, None, LICENSE_SHA256, timeout_s)
    (dest / "SOURCE.txt").write_text(
        f"Holistic Trace Analysis test data, https://github.com/{REPO}/tree/{COMMIT}/tests/data\n"
        "MIT licence (LICENSE-HolisticTraceAnalysis); fetched by `python -m labkit "
        "public-traces fetch`, each file checked against labkit.recordings.public.JOBS\n")
    return dest


def offline() -> bool:
    """True when ``LABKIT_OFFLINE`` asks labkit never to reach the network."""
    return os.environ.get("LABKIT_OFFLINE", "").strip() not in ("", "0")


def how_to_get(key: str = MULTI_RANK) -> str:
    job = _job(key)
    return (f"The public traces {key} ({job.bytes / 1e3:.0f} kB: {job.what}) are not on this "
            f"machine. `python -m labkit public-traces fetch` downloads them from GitHub "
            f"({REPO}, MIT licence) and checks them; offline, point LABKIT_GPU_TRACES at a copy "
            "of HTA's tests/data.")  # fmt: skip


def find_or_fetch(key: str = MULTI_RANK, *, allow_fetch: bool = True) -> tuple[Path | None, str]:
    """``key``'s folder, fetching it when absent and allowed; and a sentence on where it came
    from, or why there is none (never an exception: a notebook goes on without it)."""
    folder = job_folder(key)
    if folder is not None:
        return folder, f"read from {folder}"
    if not allow_fetch or offline():
        why = "LABKIT_OFFLINE is set" if offline() else "fetching was not asked for"
        return None, f"{how_to_get(key)} ({why}: nothing was downloaded.)"
    try:
        root = fetch((key,))
    except PublicTraceError as e:
        return None, f"{how_to_get(key)} The download failed: {e}."
    return root / key, f"downloaded into {root / key} and checked (size and SHA-256)"


def main(argv: list[str] | None = None) -> int:
    """``python -m labkit public-traces {fetch [--all] | where}``."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m labkit public-traces",
                                description="Real GPU profiler traces from Holistic Trace "
                                "Analysis's test data (MIT), fetched and checked.")  # fmt: skip
    sub = p.add_subparsers(dest="command", required=True)
    f = sub.add_parser("fetch", help=f"download {MULTI_RANK} (notebook 06's), or --all")
    f.add_argument("--all", action="store_true", help="every job the tests read (about 7 MB)")
    f.add_argument("--dest", type=Path, help=f"folder (default {download_dir()})")
    sub.add_parser("where", help="where each job's traces are found, if anywhere")
    args = p.parse_args(argv)
    if args.command == "where":
        for key, job in JOBS.items():
            print(f"{key:38s} {job.bytes / 1e3:7.0f} kB  {job_folder(key) or 'not here'}")
        return 0
    keys = list(JOBS) if args.all else [MULTI_RANK]
    try:
        root = fetch(keys, dest=args.dest)
    except PublicTraceError as e:
        print(f"public-traces: {e}")
        return 1
    print(f"{len(keys)} job(s) in {root} (checked: size and SHA-256); "
          f"LABKIT_GPU_TRACES={root} points the tests at them")
    return 0
