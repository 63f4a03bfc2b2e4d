"""Planted collective bugs run side by side, and what each debugging tool said about them.

    from labkit import collective_debug as cd
    outcomes = cd.run_trials([cd.Trial("desync"), cd.Trial("desync", detail=True)])
    print(cd.table(outcomes))

Each :class:`Trial` is one real 2-rank job of ``labkit.workers.collective_faults`` with one bug
planted on rank 1, launched by ``labkit.jobs.launch`` with a short process-group timeout, with or
without ``TORCH_DISTRIBUTED_DEBUG=DETAIL``. The jobs run at the same time (one thread each:
``launch.run`` blocks), so four of them cost about the wall time of the slowest. Each
:class:`Outcome` keeps the launcher's error and reads off it: what ended the job, which rank the
launcher named as the root cause and which as hung, DETAIL's mismatch (``diagnosis.
collective_mismatch``), and the time from the bug to the report in this process (measured).
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from labkit.jobs import diagnosis, launch, procs, runtime
from labkit.workers.collective_faults_config import FAULTS, CollectiveFaultsConfig

WORKER = CollectiveFaultsConfig.WORKER


def first_divergence(plans: dict[int, Sequence[str]]) -> tuple[int, dict[int, str]] | None:
    """Where the ranks' planned collectives first differ: (index, {rank: entry}), an entry
    "(none: finished)" for a rank whose plan is shorter; None when every plan is the same.
    The prediction a mismatch report is checked against."""
    longest = max((len(p) for p in plans.values()), default=0)
    for i in range(longest):
        here = {r: (p[i] if i < len(p) else "(none: finished)") for r, p in plans.items()}
        if len(set(here.values())) > 1:
            return i, here
    return None


def plan_key(entry: str) -> tuple[str, tuple[int, ...]] | None:
    """("ALLREDUCE", (1024,)) for a plan entry "step 2: all_reduce [1024]", in the names
    DETAIL's fingerprints use; None for an entry that is no collective (a sleep)."""
    _, _, what = entry.partition(": ")
    op, _, shape = what.partition(" [")
    if not shape.endswith("]") or not op.replace("_", "").isalpha():
        return None
    return op.replace("_", "").upper(), tuple(int(s) for s in shape[:-1].split(",") if s.strip())


@dataclass(frozen=True)
class Trial:
    """One job: ``fault`` planted on rank 1, with DETAIL's checks on or off."""

    fault: str
    detail: bool = False

    def __post_init__(self) -> None:
        if self.fault not in FAULTS:
            raise ValueError(f"fault={self.fault!r}: use one of {FAULTS}")

    @property
    def label(self) -> str:
        return f"{self.fault}, DETAIL {'on' if self.detail else 'off'}"


@dataclass
class Outcome:
    """What one trial's job ended with, as the learner reads it.

    Attributes:
        trial: the job's fault and DETAIL setting.
        error: the launcher's ``JobFailed``/``JobTimeout`` (None: the job finished).
        result: what the job left (per-rank results, logs in ``result.log_dir``).
        detect_s: measured seconds from the moment the first rank reached the bug's step (rank
            1 plants it there; a wait that times out starts after that) to the first
            exception a rank raised (None where no rank raised: the bug never struck, or the
            ranks were killed, as gloo's abort does); ``report_s`` (property) to the launcher's
            error in this process, which adds the job's teardown.
        wall_s: measured seconds of the whole job, start-up included.
    """

    trial: Trial
    error: launch.JobError | None
    result: launch.JobResult | None
    detect_s: float | None
    wall_s: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def rank(self) -> int | None:
        """The rank the launcher named as the root cause (None if it finished)."""
        return getattr(self.error, "rank", None)

    @property
    def hung(self) -> list[int]:
        """The ranks the launcher named as hung (outside any collective while others waited)."""
        if isinstance(self.error, launch.JobTimeout):
            return list(self.error.ranks)
        return list(getattr(self.error, "hung_ranks", []) or [])

    @property
    def message(self) -> str:
        return str(self.error) if self.error is not None else ""

    @property
    def headline(self) -> str:
        """The first line of the launcher's message, without the module's name."""
        return self.message.splitlines()[0].removeprefix(WORKER + " ") if self.error else "finished"

    @property
    def mismatch(self) -> diagnosis.CollectiveMismatch | None:
        """DETAIL's mismatch, if DETAIL found one (in any rank's exception)."""
        return diagnosis.collective_mismatch(self.message) if self.error else None

    @property
    def ended_by(self) -> str:
        """Which mechanism ended the job, in words."""
        msg, kind = self.message, getattr(self.error, "kind", "")
        if self.error is None:
            return "nothing: the job finished"
        if isinstance(self.error, launch.JobTimeout):
            return "the launcher's timeout"
        if self.mismatch is not None:
            return "DETAIL's fingerprint check"
        if "monitoredBarrier" in msg:
            return f"DETAIL's monitored barrier ({self.pg_timeout_s:g} s)"
        if "SIGABRT" in msg and "collective mismatch" in msg:
            return "gloo's own size check (abort)"
        if "Timed out waiting" in msg or kind == "waited":
            return f"the collective timeout ({self.pg_timeout_s:g} s)"
        return kind or "an error"

    @property
    def report_s(self) -> float | None:
        """Measured seconds from the bug to the launcher's error in this process."""
        return self.extra.get("report_s")

    @property
    def pg_timeout_s(self) -> float:
        return float(self.extra.get("pg_timeout_s", float("nan")))


def run_trials(
    trials: Sequence[Trial],
    *,
    pg_timeout_s: float = 3.0,
    timeout_s: float = 90.0,
    nproc: int = 2,
    device: str = "cpu",
    backend: str = "auto",
    env: dict[str, str] | None = None,
    config: dict[str, Any] | None = None,
    flight_recorder: bool = False,
    write: Callable[[str], None] = print,
) -> list[Outcome]:
    """Run every trial as its own job, all at once; their outcomes in the trials' order.

    ``pg_timeout_s`` is the process-group timeout inside the workers (how long a collective
    waits), ``timeout_s`` the launcher's outer limit per job. ``env`` adds environment variables
    to every job (NCCL_DEBUG, say). ``flight_recorder`` turns on NCCL's flight recorder with a
    dump on timeout into a folder of each job's own (``outcome.extra["fr_dir"]``). A line is
    written as each job starts and ends.
    """
    if not trials:
        raise ValueError("trials is empty: give at least one Trial")
    if len(trials) > 6:
        raise ValueError(f"{len(trials)} trials at once: at most 6 (each starts {nproc} ranks)")
    for t in trials:
        if not isinstance(t, Trial):
            raise ValueError(f"{t!r}: give Trial objects, e.g. Trial('desync', detail=True)")
    if not pg_timeout_s < timeout_s:
        raise ValueError(f"pg_timeout_s={pg_timeout_s} must be < timeout_s={timeout_s}: the "
                         "collective timeout is what the lesson shows, not the launcher's")  # fmt: skip
    # Every trial's config is checked before any job starts: a bad one fails the whole call.
    jobs = {t: CollectiveFaultsConfig.from_dict({**(config or {}), "fault": t.fault}) for t in trials}
    for job in jobs.values():
        job.check_ranks(nproc)

    def one(trial: Trial) -> Outcome:
        job_env = dict(env or {})
        if trial.detail:
            job_env["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
        extra: dict[str, Any] = {"pg_timeout_s": pg_timeout_s}
        if flight_recorder:  # torch/csrc/distributed/c10d/FlightRecorder.hpp reads these
            fr_dir = procs.labkit_home() / "flight_recorder" / uuid.uuid4().hex[:8]
            fr_dir.mkdir(parents=True, exist_ok=True)
            job_env.update(TORCH_FR_BUFFER_SIZE="2000",  # TORCH_NCCL_TRACE_BUFFER_SIZE: deprecated
                           TORCH_NCCL_DUMP_ON_TIMEOUT="1",
                           TORCH_FR_DUMP_TEMP_FILE=str(fr_dir / "rank_"))  # fmt: skip
            extra["fr_dir"] = str(fr_dir)
        start = time.monotonic()
        error: launch.JobError | None = None
        try:
            result = launch.run(jobs[trial], nproc=nproc, pg_timeout_s=pg_timeout_s,
                                timeout_s=timeout_s, device=device, backend=backend, env=job_env,
                                stream=False)  # fmt: skip
        except launch.JobError as e:
            error, result = e, e.result
        ended = time.time()
        wall_s = time.monotonic() - start
        fault_at = min((r["fault_at"] for r in result.ranks if r.get("fault_at")), default=None)
        # A rank that raises writes a last heartbeat at that moment (labkit.jobs.runtime): the first
        # such is when the bug was detected. A rank that aborts (SIGABRT) writes none.
        beats = runtime.read_heartbeats(result.log_dir, nproc).values()
        raised = [b["time"] for b in beats if b.get("failed") and isinstance(b.get("time"), float)]
        detect = min(raised) - fault_at if fault_at and raised else None
        extra["report_s"] = ended - fault_at if fault_at else None
        return Outcome(trial, error, result, detect, wall_s, extra)

    write(f"{len(trials)} jobs of {nproc} ranks side by side: "
          + "; ".join(t.label for t in trials))  # fmt: skip
    out: dict[Trial, Outcome] = {}
    with ThreadPoolExecutor(max_workers=len(trials)) as pool:
        futures = {pool.submit(one, t): t for t in trials}
        for fut in as_completed(futures):
            o = fut.result()
            out[futures[fut]] = o
            write(f"  {o.trial.label}: ended after {o.wall_s:.1f} s ({o.ended_by})")
    return [out[t] for t in trials]


def table(outcomes: Sequence[Outcome]) -> str:
    """One line per outcome: what ended it, the ranks named, the time to detection."""

    def secs(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f} s"

    rows = [("trial", "ended by", "root cause", "hung", "bug → error", "bug → report")]
    for o in outcomes:
        rows.append((
            o.trial.label, o.ended_by,
            "-" if o.rank is None else f"rank {o.rank}",
            ", ".join(f"rank {r}" for r in o.hung) or "-",
            secs(o.detect_s), secs(o.report_s),
        ))  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                     for r in rows)  # fmt: skip


def report_lines(o: Outcome, limit: int = 6) -> list[str]:
    """The launcher's message, shortened for a notebook: the headline and the lines that explain,
    what a killed rank wrote to stderr included (tracebacks and log paths left out)."""
    keep, said = [], False
    for line in o.message.splitlines()[1:]:
        if line.startswith("what rank ") and line.endswith("wrote to stderr last:"):
            said = True  # a rank killed without an exception: what it said is the evidence
        elif not (said and line.startswith("  ")):
            said = False
            if line.startswith(("  ", "full ", "logs in", "what followed", "other ranks")):
                continue
        keep.append(line)
    return [o.headline, *keep[:limit]]


def nvidia_topology() -> str:
    """``nvidia-smi topo -m``'s output, or a sentence saying why there is none."""
    import subprocess

    exe = shutil.which("nvidia-smi")
    if exe is None:
        return "nvidia-smi is not installed here (no NVIDIA driver): no GPU topology to show"
    try:
        out = subprocess.run([exe, "topo", "-m"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"nvidia-smi topo -m failed to run: {e}"
    text = (out.stdout or "") + (out.stderr or "")
    return text.rstrip() if out.returncode == 0 else f"nvidia-smi topo -m failed:\n{text.rstrip()}"


def flight_recorder_files(folder: str | os.PathLike) -> list[Path]:
    """The flight-recorder dumps written under ``folder`` (one file per rank)."""
    p = Path(folder)
    return sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else []


def read_flight_recorder(folder: str | os.PathLike, last: int = 15) -> str:
    """What torch's flight-recorder analyzer says about the dumps in ``folder`` (its last
    ``last`` lines), or a sentence saying there are none. The dumps are named
    ``rank_<rank>`` (``run_trials`` sets ``TORCH_FR_DUMP_TEMP_FILE`` to ``<folder>/rank_``)."""
    import subprocess
    import sys

    files = flight_recorder_files(folder)
    if not files:
        return (f"no flight-recorder dump in {folder}: nothing timed out under NCCL's watchdog, "
                "or the recorder was off (TORCH_FR_BUFFER_SIZE=0)")  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", "--prefix",
           "rank_", str(folder)]  # fmt: skip
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"the analyzer failed to run: {e}"
    lines = (out.stdout + out.stderr).strip().splitlines()
    return "\n".join([f"{len(files)} dump file(s); `{' '.join(cmd[1:])}` says:", *lines[-last:]])


def read_dumps(folder: str | os.PathLike) -> dict[int, list[dict[str, Any]]]:
    """{rank: its flight-recorder entries, oldest first} from the ``rank_<r>`` dumps in
    ``folder`` (torch's pickle: each entry has ``collective_seq_id``, ``profiling_name`` such as
    "gloo:all_reduce" or "nccl:all_reduce", ``input_sizes``, ``input_dtypes`` and ``state``:
    "scheduled", "started" or "completed"). A file that is no dump is skipped."""
    import pickle

    found: dict[int, list[dict[str, Any]]] = {}
    for f in flight_recorder_files(folder):
        rank = f.name.removeprefix("rank_")
        if not rank.isdigit():
            continue
        try:
            dump = pickle.loads(f.read_bytes())  # torch's own dump, written by this job
        except Exception:  # a half-written or foreign file: not evidence
            continue
        entries = [e for e in dump.get("entries", []) if not e.get("is_p2p")]
        found[int(rank)] = sorted(entries, key=lambda e: e.get("collective_seq_id", 0))
    return found


def _entry(e: dict[str, Any]) -> str:
    name = str(e.get("profiling_name", "?")).split(":")[-1]
    sizes = ", ".join(str(list(s)) for s in e.get("input_sizes", []))
    return f"#{e.get('collective_seq_id')} {name} {sizes} ({e.get('state')})"


def flight_recorder_summary(folder: str | os.PathLike, nproc: int, last: int = 3,
                            *, brief: bool = False) -> list[str]:  # fmt: skip
    """What the dumps in ``folder`` say, in lines: each rank's last ``last`` collectives, then
    the first collective number at which the ranks disagree (another op or size, or a rank that
    never issued it), or the ranks that left no dump. ``brief``: where every rank left a dump
    and they disagree, only the line that says where (it names each rank's entry there); a rank
    without a dump in one short line."""
    dumps = read_dumps(folder)
    lines = []
    for r in range(nproc):
        if r not in dumps and brief:
            lines.append(f"rank {r}: no dump (it never raised: stuck elsewhere, or killed first)")
        elif r not in dumps:
            lines.append(f"rank {r}: no dump (it never raised: stuck outside a collective, or "
                         "killed first): the recorder cannot say what it was doing")  # fmt: skip
        else:
            lines.append(f"rank {r}: " + "; ".join(_entry(e) for e in dumps[r][-last:]))
    if len(dumps) < 2:
        return lines
    if brief and len(dumps) == nproc:
        found = [line for line in flight_recorder_summary(folder, nproc, last)[nproc:]
                 if line.startswith("first disagreement")]  # fmt: skip
        if found:
            return found
    by_seq = {r: {e.get("collective_seq_id"): e for e in es} for r, es in dumps.items()}
    for seq in sorted({s for d in by_seq.values() for s in d}):
        what = {r: (d[seq].get("profiling_name"), d[seq].get("input_sizes")) if seq in d else None
                for r, d in by_seq.items()}  # fmt: skip
        if len(set(map(str, what.values()))) > 1:
            each = ", ".join(f"rank {r}: {_entry(by_seq[r][seq]) if seq in by_seq[r] else 'none'}"
                             for r in sorted(what))  # fmt: skip
            lines.append(f"first disagreement at collective #{seq}: {each}")
            break
    else:
        lines.append("the ranks' recorded collectives agree")
    return lines


def nccl_report(o: Outcome, last: int = 3, width: int = 400) -> list[str]:
    """One NCCL trial, for a notebook: what ended it, the launcher's report, each rank's last
    ``last`` collective lines from ``NCCL_DEBUG=INFO`` (``NCCL_DEBUG_SUBSYS=COLL``), and what
    the flight-recorder dumps and torch's analyzer say. Lines longer than ``width`` are cut."""
    lines = [f"--- {o.trial.label} over NCCL: ended by {o.ended_by}"]
    lines += ["    " + line[:width] for line in report_lines(o)]
    n = 2 if o.result is None else o.result.nproc
    for r in range(n):
        logs = "" if o.result is None else o.result.log(r) + o.result.log(r, "stderr")
        said = [s for s in logs.splitlines()
                if "NCCL INFO" in s and ("AllReduce" in s or "AllGather" in s)]  # fmt: skip
        lines.append(f"  rank {r}: NCCL_DEBUG=INFO's last collective lines:")
        lines += ["    " + s[:width] for s in said[-last:]] or ["    (none)"]
    if "fr_dir" in o.extra:
        lines.append("  flight recorder:")
        lines += ["    " + line for line in flight_recorder_summary(o.extra["fr_dir"], nproc=n)]
        lines += ["    " + line for line in read_flight_recorder(o.extra["fr_dir"]).splitlines()]
    return lines


# --- notebook 03d: the prediction, the reports and the reconcile, as the notebook prints them ---


@dataclass(frozen=True)
class Divergences:
    """Per fault, where the ranks' planned collectives first part (``first_divergence`` of
    ``collective_faults_config.planned``): the prediction each report is held against."""

    healthy: list[str]
    """The first collectives of the healthy plan (rank 0)."""
    at: dict[str, int]
    """Per fault: the index of the first collective where the ranks part."""
    where: dict[str, dict[int, str]]
    """Per fault: each rank's plan entry there."""

    def __getitem__(self, fault: str) -> dict[int, str]:
        return self.where[fault]

    def describe(self) -> str:
        lines = ["the healthy plan: " + " | ".join(self.healthy)]
        for fault, where in self.where.items():
            lines.append(f"predicted, {fault}: the ranks part at collective #{self.at[fault] + 1}: "
                         + "; ".join(f"rank {r}: {w}" for r, w in where.items()))
        return "\n".join(lines)


def predict_divergences(config: dict[str, Any], faults: Sequence[str] = ("desync", "shape", "hang"),
                        nproc: int = 2) -> Divergences:  # fmt: skip
    """Each fault's plans for ``nproc`` ranks (``config`` without the fault), and where they part."""
    from labkit.workers.collective_faults_config import planned

    at, where = {}, {}
    for fault in faults:
        found = first_divergence({r: planned({**config, "fault": fault}, r) for r in range(nproc)})
        if found is None:
            raise ValueError(f"fault={fault!r}: the ranks' plans never part; nothing to predict")
        at[fault], where[fault] = found
    return Divergences(healthy=list(planned({**config, "fault": "none"}, 0)[:4]), at=at, where=where)


def describe_reports(outcomes: Sequence[Outcome], limit: int = 4, width: int = 400) -> str:
    """What each tool reported, as the launcher words it (``report_lines``), and, for each trial
    without DETAIL (whose own all-gathers the recorder records too), the flight recorder's
    summary of the dumps."""
    lines = []
    for o in outcomes:
        lines.append(f"--- {o.trial.label}: ended by {o.ended_by}")
        lines += ["    " + line[:width] for line in report_lines(o, limit=limit)]
        if not o.trial.detail:
            lines += ["    flight recorder: " + line for line in
                      flight_recorder_summary(o.extra["fr_dir"], nproc=2, last=1, brief=True)]
    return "\n".join(lines)


@dataclass(frozen=True)
class Reconciliation:
    """Each trial's report held against the prediction: DETAIL's fingerprints against the
    planned collectives, the hung rank against the one that slept, each timeout against
    ``pg_timeout_s``."""

    outcomes: tuple[Outcome, ...]
    predicted: Divergences
    pg_timeout_s: float

    def line(self, o: Outcome) -> str:
        """One trial: what it said, against what was predicted."""
        fault, pg_s, said = o.trial.fault, self.pg_timeout_s, []
        if o.mismatch is not None:
            seen = {f.rank: (f.op, f.shape) for f in (o.mismatch.this, o.mismatch.other)}
            want = {r: plan_key(w) for r, w in self.predicted[fault].items()}
            said.append(f"DETAIL saw {seen}, predicted {want}: {'agree' if seen == want else 'DISAGREE'}")
        if fault == "hang":
            said.append(f"root cause rank {o.rank} (the victim, whose wait expired), hung {o.hung}, "
                        f"predicted hung [1]: {'agree' if o.hung == [1] else 'DISAGREE'}")
        if o.detect_s is None:
            said.append(f"no rank raised (they were killed); reported {o.report_s:.1f} s after the "
                        "bug (measured)")
        elif "timeout" in o.ended_by or "barrier" in o.ended_by:
            # a timeout cannot fire before it expires (5% allowed for the clocks of two processes)
            said.append(f"first error {o.detect_s:.1f} s after the bug (measured), timeout {pg_s:g} s: "
                        + ("as predicted" if o.detect_s >= 0.95 * pg_s else "SOONER than the timeout: read why"))
        else:
            said.append(f"first error {o.detect_s:.2f} s after the bug (measured): "
                        f"{'before' if o.detect_s < pg_s else 'not before'} the {pg_s:g} s timeout "
                        "would have expired")
        return f"{o.trial.label}: " + "; ".join(said)

    def describe(self) -> str:
        return "\n".join(self.line(o) for o in self.outcomes)


def reconcile(outcomes: Sequence[Outcome], predicted: Divergences, pg_timeout_s: float) -> Reconciliation:
    """The trials of ``run_trials`` against ``predict_divergences``' prediction."""
    return Reconciliation(tuple(outcomes), predicted, pg_timeout_s)


def describe_nccl_expected(gpus: int, nccl_timeout_s: float) -> str:
    """What the NCCL trials show on two or more GPUs, said where they cannot run (expected,
    not measured)."""
    return (f"{gpus} GPU(s) here: NCCL needs one GPU per rank, so its run is not shown. Expected on "
            "two or more GPUs, not measured here: the desync's INFO lines share an opCount but name "
            "AllReduce on rank 0 and AllGather on rank 1, the watchdog ends both jobs after "
            f"{nccl_timeout_s} s, and fr_trace names the first collective the ranks disagree on.")
