"""Profiler traces recorded on a real GPU, shipped so that a learner without one can read them.

Notebook 06 profiles the course's own training step. On the CPU tier that trace holds CPU
operators only: no kernel, no stream, no overlap of a kernel with another. So labkit ships the
same step profiled on a GPU, and notebook 06 reads it with exactly the code a learner runs on
their own trace (``labkit.profiling``), labelled "recorded on <hardware>, <date>, torch <v>".

A profile recording is a folder in ``labkit/recordings/profiles/`` holding ``recording.json``
and, in ``traces/``, the trace files of one job (``rank<N>.json.gz``, as ``torch.profiler``
exported them, gzipped; a folder of traces alone, so HTA can read it as it is)::

    {"format": "labkit-gpu-profile", "version": 1,
     "hardware": "1× NVIDIA H200", "date": "2026-12-06", "torch": "2.11.0+cu130",
     "cuda": "13.0", "what": "notebook 06's training step (labkit.profiling.bottlenecks.
     annotated_step), preset gpu, bfloat16, micro-batch 32 × 512 tokens",
     "conditions": "...", "recorded_by": "python -m labkit record-profile ...",
     "steps": {"wait": 2, "warmup": 2, "active": 3}}

``hardware``, ``date`` and ``torch`` are required, and every trace must hold GPU work: a
folder that is not a recording of real GPU work is refused, naming the file and the reason.
``python -m labkit record-profile --out DIR`` makes one on a machine with an NVIDIA GPU.
Nothing here runs at import.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from labkit.errors import LabkitError
from labkit.profiling.trace import Trace, TraceError, load_traces

FORMAT = "labkit-gpu-profile"
VERSION = 1
HEADER = "recording.json"
TRACES = "traces"  # the sub-folder holding the job's traces
REQUIRED = ("hardware", "date", "torch")
OPTIONAL = ("cuda", "what", "conditions", "recorded_by", "steps", "gpus")
SHIPPED_DIR = Path(__file__).parent / "profiles"
MAX_BYTES = 2 * 2**20  # a shipped recording stays small: profile a few steps, no shapes


NONE_SHIPPED = (
    "No GPU profile ships with this version of labkit yet: a recording is made on a machine "
    "with an NVIDIA GPU by `python -m labkit record-profile --out "
    "labkit/recordings/profiles/<gpu>-nb06-<date>` (scripts/gpu_check.sh runs it), and nothing "
    "stands in for it: labkit never makes up a GPU's trace. What a GPU did record of this "
    "step is its time (labkit.recordings), below."
)


class ProfileRecordingError(ValueError, LabkitError):
    """A folder that is not a valid profile recording; the message names it and the reason."""


@dataclass(frozen=True)
class ProfileRecording:
    """A job's GPU traces and what they are a recording of."""

    folder: Path
    header: dict[str, Any]
    traces: list[Trace]

    def label(self) -> str:
        """``recorded on 1× NVIDIA H200, 2026-12-06, torch 2.11.0+cu130, CUDA 13.0``."""
        h = self.header
        cuda = f", CUDA {h['cuda']}" if h.get("cuda") else ""
        return f"recorded on {h['hardware']}, {h['date']}, torch {h['torch']}{cuda}"

    def describe(self) -> str:
        h = self.header
        lines = [f"{self.label()} (measured on that GPU, not on this machine)"]
        if h.get("what"):
            lines.append(f"  what ran: {h['what']}")
        if h.get("conditions"):
            lines.append(f"  conditions: {h['conditions']}")
        ranks = [t.rank for t in self.traces]
        lines.append(f"  {len(self.traces)} trace(s), rank(s) {ranks}, "
                     f"{len(self.traces[0].steps)} recorded step(s) each")  # fmt: skip
        return "\n".join(lines)


def load_profile(folder: str | Path) -> ProfileRecording:
    """Load and check one profile recording (a folder with ``recording.json`` and traces)."""
    folder = Path(folder)
    path = folder / HEADER
    if not path.is_file():
        raise ProfileRecordingError(
            f"{folder}: no {HEADER}, so nothing says what hardware recorded these traces; a "
            "profile recording is made by `python -m labkit record-profile`"
        )
    try:
        header = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ProfileRecordingError(f"{path}: not JSON ({e})") from e
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise ProfileRecordingError(f"{path}: not a profile recording (format must be {FORMAT!r})")
    if header.get("version") != VERSION:
        raise ProfileRecordingError(f"{path}: version {header.get('version')!r}; this labkit "
                                    f"reads version {VERSION}")  # fmt: skip
    missing = [k for k in REQUIRED if not header.get(k)]
    if missing:
        raise ProfileRecordingError(f"{path}: missing {', '.join(missing)}: without them a "
                                    "trace cannot be told apart from a made-up one")  # fmt: skip
    unknown = sorted(set(header) - {"format", "version", *REQUIRED, *OPTIONAL})
    if unknown:
        raise ProfileRecordingError(f"{path}: unknown field(s) {unknown}")
    try:
        dt.date.fromisoformat(str(header["date"])[:10])
    except ValueError as e:
        raise ProfileRecordingError(f"{path}: date {header['date']!r} is not ISO 8601") from e
    try:
        traces = load_traces(folder / TRACES)
    except TraceError as e:
        raise ProfileRecordingError(f"{folder}: {e}") from e
    for t in traces:
        if not t.on_gpu:
            raise ProfileRecordingError(f"{t.path}: no GPU kernels: not a recording of a GPU")
    return ProfileRecording(folder, header, traces)


def summarize(rec: ProfileRecording, phases: tuple[str, ...] = ()) -> str:
    """What the recording shows, read with the learner's own tools (``labkit.profiling``):
    per rank, the step and its GPU time by kind of kernel, and the CPU thread's phases."""
    import statistics

    from labkit.hardware import peak_flops
    from labkit.profiling.overlap import gpu_split, gpu_work, rank_times

    lines = [rec.describe()]
    for t in rec.traces:
        for name in dict.fromkeys(t.gpu_names):  # each GPU once, in device order
            peak = peak_flops(name, "bf16")
            lines.append(f"  GPU {name!r} ({t.path.name}): {peak}" if peak.known else
                         f"  GPU {name!r} ({t.path.name}) is not one labkit's hardware table "
                         f"can place ({peak.reason}); no figure below depends on it")  # fmt: skip
        r, g = rank_times(t), gpu_split(t)
        work, _ = gpu_work(t)
        cpu_ms = statistics.median(s.dur_us for s in t.steps) / 1e3
        lines.append(f"rank {t.rank}: {len(work) / r.steps:,.0f} kernels, copies and memsets a "
                     f"step; a step takes {r.step_s * 1e3:.2f} ms on the GPU (median CPU-side "
                     f"ProfilerStep range: {cpu_ms:.2f} ms)")  # fmt: skip
        lines.append("  " + g.describe())
        if r.comm_s:
            lines.append("  " + r.describe())
        if phases:
            per = t.phase_seconds(phases)
            shown = ", ".join(f"{p} {statistics.median(v) * 1e3:.2f}" for p, v in per.items())
            lines.append(f"  phases on the training thread (CPU time, median ms a step): {shown}")
    return "\n".join(lines)


def shipped_profiles(root: Path = SHIPPED_DIR) -> list[Path]:
    """The profile recordings that ship with labkit (folders holding ``recording.json``)."""
    return sorted(p.parent for p in root.glob(f"*/{HEADER}")) if root.is_dir() else []


def record_profile(out: str | Path, *, size: str = "gpu", wait: int = 2, warmup: int = 2,
                   active: int = 3, conditions: str = "",
                   device: str = "cuda") -> ProfileRecording:
    """Profile notebook 06's training step on this machine's GPU and write a recording to ``out``.

    The step is ``labkit.profiling.bottlenecks.annotated_step`` (data, forward, backward,
    optimizer, each a named range) at preset ``size`` in that preset's precision, as notebook 06 profiles it.
    Raises RuntimeError without a CUDA GPU: a recording is of a real GPU or it is nothing.
    ``device="cpu"`` runs every step of it on the CPU (a dry run of the script), and the
    result is refused on loading (ProfileRecordingError: no GPU kernels)."""
    import gzip
    import shutil
    import tempfile

    import torch

    from labkit import config, data, train
    from labkit.model import GPT
    from labkit.profiling.bottlenecks import annotated_step
    from labkit.profiling.capture import profile_steps

    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("record-profile needs an NVIDIA GPU that torch can use "
                           f"(torch {torch.__version__}, torch.cuda.is_available() is False)")  # fmt: skip
    cfg = config.preset(size)
    device = torch.device(device)
    torch.manual_seed(cfg.train.seed)
    model = GPT(cfg.model).to(device)
    optimizer = train.make_optimizer(model, cfg.train)
    shard, _ = data.load_splits()
    gen = torch.Generator().manual_seed(0)
    micro, seq = cfg.train.micro_batch, cfg.model.seq_len

    def next_batch() -> tuple[torch.Tensor, torch.Tensor]:
        return data.get_batch(shard, micro, seq, gen, device)

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        run = profile_steps(lambda i: annotated_step(model, optimizer, next_batch,
                                                     dtype=cfg.train.dtype),
                            wait=wait, warmup=warmup, active=active, trace_dir=tmp,
                            device=device, record_shapes=False)  # fmt: skip
        (out / TRACES).mkdir(exist_ok=True)
        with open(run.traces[0], "rb") as src, \
                gzip.open(out / TRACES / "rank0.json.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "CPU (a dry run)"
    header = {
        "format": FORMAT, "version": VERSION, "hardware": f"1× {name}",
        "date": dt.datetime.now(dt.timezone.utc).date().isoformat(),
        "torch": torch.__version__, "cuda": torch.version.cuda if device.type == "cuda" else "",
        "what": (f"notebook 06's training step (labkit.profiling.bottlenecks."
                 f"annotated_step), preset {size}, {cfg.train.dtype}, micro-batch "
                 f"{micro} × {seq} tokens, {sum(p.numel() for p in model.parameters()):,} "
                 "parameters"),
        "conditions": conditions or f"one process on {platform.node() or 'this machine'}",
        "recorded_by": f"python -m labkit record-profile --size {size}",
        "steps": {"wait": wait, "warmup": warmup, "active": active},
    }  # fmt: skip
    (out / HEADER).write_text(json.dumps(header, indent=1) + "\n", encoding="utf-8")
    size_b = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    if size_b > MAX_BYTES:
        raise RuntimeError(f"{out}: {size_b:,} B, over the {MAX_BYTES:,} B a shipped recording "
                           "may take: record fewer active steps")  # fmt: skip
    return load_profile(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="labkit record-profile",
        description="Profile notebook 06's training step on this GPU and write a profile "
                    "recording (traces + recording.json) for learners without a GPU.")  # fmt: skip
    parser.add_argument("--out", required=True, help="folder to write (e.g. "
                        "labkit/recordings/profiles/h200-nb06-2026-12-06)")  # fmt: skip
    parser.add_argument("--size", default=None, help="labkit.config preset (default gpu; smoke "
                        "with --device cpu)")  # fmt: skip
    parser.add_argument("--active", type=int, default=3, help="steps recorded (default 3)")
    parser.add_argument("--conditions", default="", help="what else ran on the machine")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda (default): make a recording. cpu: a dry run of the whole "
                        "path on the CPU at smoke size, which must end in the loader's refusal "
                        "(no GPU kernels): exit 0 when it does, 1 otherwise")  # fmt: skip
    args = parser.parse_args(argv)
    dry = args.device == "cpu"
    size = args.size or ("smoke" if dry else "gpu")
    try:
        rec = record_profile(args.out, size=size, active=args.active,
                             conditions=args.conditions, device=args.device)  # fmt: skip
    except ProfileRecordingError as e:
        if dry and "no GPU kernels" in str(e):
            print(f"labkit record-profile: dry run on the CPU, size {size}: notebook 06's step "
                  f"was profiled and written to {args.out}, and the loader refused it as "
                  f"expected ({e}): the recorder's whole path ran; a CPU trace is never a "
                  "recording")  # fmt: skip
            return 0
        print(f"labkit record-profile: {e}")
        return 1
    except RuntimeError as e:
        print(f"labkit record-profile: {e}")
        return 1
    if dry:
        print(f"labkit record-profile: dry run on the CPU, but {args.out} was accepted as a GPU "
              "recording: the loader's check for GPU kernels failed")  # fmt: skip
        return 1
    print(rec.describe())
    return 0
