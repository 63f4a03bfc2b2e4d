"""Record notebook 01's training run on a GPU, so learners without one can replay it.

    python -m labkit record-trace --out h200-nb01.jsonl        # on a machine with a GPU

runs the same training as notebook 01's section 2 (same preset, model, data, optimizer and
dtype rule) under a ``Monitor`` that reads NVML and writes every sample and step event to a
trace (format: ``labkit.metrics.replay``), with the hardware, driver, torch version and date
in its header. A figure of the run is saved beside it (``.png``) for the reviewer. A recording
that is checked in under ``labkit/metrics/traces/`` is shown, labelled as a recording, in
notebook 01 on every tier.

It refuses to run without NVML: a recording is of real GPU readings or it is nothing.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from labkit.metrics.base import Backend
from labkit.metrics.nvml import NvmlBackend

DEFAULT_PERIOD_S = 0.5  # notebook 01's Monitor samples every 0.5 s


def record_training_run(
    out: str | Path,
    *,
    size: str = "gpu",
    steps: int | None = None,
    period_s: float = DEFAULT_PERIOD_S,
    backend: Backend | None = None,
) -> Path:
    """Train as notebook 01 does at ``size`` and record the GPU's metrics to ``out``.

    Args:
        out: the trace file (.jsonl) to write; its parent folder is created. The figure is
            written to the same path with the suffix ``.png``.
        size: the notebook's ``size`` parameter (a ``labkit.config`` preset).
        steps: the notebook's ``steps`` parameter (None: the preset's).
        period_s: seconds between samples.
        backend: the NVML backend to read (a test passes one built on a test double);
            default: an ``NvmlBackend`` over the GPUs this process sees.

    Returns the trace's path. Raises ``BackendUnavailable`` (with the reason) where NVML
    cannot run, before any training starts, and RuntimeError when the run was recorded
    without a single GPU reading (the sampler failed): an empty recording is no recording.
    """
    import torch  # lazy: `python -m labkit --help` needs no torch

    from labkit import config, data, train
    from labkit.model import GPT
    from labkit.monitor import Monitor

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # This process is the one training: its GPU memory shows as "gpu0/rank0".
    backend = NvmlBackend(lambda: {0: os.getpid()}) if backend is None else backend
    backend.open()  # fail now, naming the reason, rather than after loading the data

    # Notebook 01, parameters and set-up cells.
    cfg = config.preset(size)
    device = train.resolve_device(cfg.train.device)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    cfg = cfg.replace(dtype=dtype, **({"steps": steps} if steps is not None else {}))
    splits = data.load_splits()
    # Notebook 01, section 2: the training run.
    torch.manual_seed(cfg.train.seed)
    model = GPT(cfg.model)
    cfg = cfg.replace(eval_every=max(1, cfg.train.steps // 5))
    n_params = sum(p.numel() for p in model.parameters())
    notes = (f"notebook 01 section 2 training run: preset {size!r}, {cfg.train.steps} steps, "
             f"{n_params:,} parameters, micro_batch {cfg.train.micro_batch} x seq_len "
             f"{cfg.model.seq_len}, {dtype} on {device}, evaluation every "
             f"{cfg.train.eval_every} steps; recorded with `python -m labkit record-trace`")  # fmt: skip
    monitor = Monitor(period_s=period_s, backend=backend, live=False, record_to=out,
                      record_notes=notes, total_steps=cfg.train.steps,
                      title="notebook 01 training run")  # fmt: skip
    with monitor:
        train.train(model, cfg, splits.train, val_data=splits.val, device=device,
                    on_step=monitor.chain(train.Progress(cfg.train.steps, lines=6)))  # fmt: skip
    monitor.figure().savefig(out.with_suffix(".png"), dpi=90)
    sampler = monitor.sampler
    if sampler is not None and sampler.state == "failed":
        raise RuntimeError(f"sampling failed during the run: {sampler.error!r}")
    if not any(s.values.get("gpu_util_pct") is not None for s in monitor.samples):
        raise RuntimeError(f"no GPU utilisation was read during the run ({monitor.describe()})")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="labkit record-trace",
        description="Record notebook 01's training run with NVML (needs an NVIDIA GPU).",
    )
    parser.add_argument("--out", required=True, type=Path, help="trace file to write (.jsonl)")
    parser.add_argument("--size", default="gpu", help="preset, as notebook 01's `size` (gpu)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps (preset's)")
    parser.add_argument("--period-s", type=float, default=DEFAULT_PERIOD_S,
                        help=f"seconds between samples ({DEFAULT_PERIOD_S})")  # fmt: skip
    args = parser.parse_args(argv)
    from labkit.metrics import BackendUnavailable, load_trace

    try:
        path = record_training_run(args.out, size=args.size, steps=args.steps,
                                   period_s=args.period_s)  # fmt: skip
    except BackendUnavailable as e:
        print(f"labkit record-trace: {e}; a recording needs an NVIDIA GPU and its driver")
        return 2
    except (RuntimeError, ValueError) as e:  # ValueError: e.g. no driver version to record
        print(f"labkit record-trace: no usable recording in {args.out}: {e}")
        return 1
    trace = load_trace(path)  # read back: what was written is a valid recording
    size_kib = path.stat().st_size / 1024
    print(f"wrote {path} ({size_kib:.0f} KiB): {trace.label}, {len(trace.samples)} samples and "
          f"{len(trace.steps)} step events over {trace.duration_s:.1f} s; figure "
          f"{path.with_suffix('.png')}")  # fmt: skip
    return 0
