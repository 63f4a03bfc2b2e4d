"""The sentences and tables that put recorded GPU figures beside this machine's.

Every display of a recording goes through here, so every one carries the same label
(``Recording.label()``: hardware, date, torch and CUDA) and the same reminder that a recorded
figure was measured on that hardware, on that day, not here. This machine's measurement is
summarised with the same function as the recording's (``labkit.recordings.summary``) and
printed in the same words (``Figure.describe``), so the two lines can be read side by side.
Pure functions: nothing here measures or loads anything.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from labkit import verdict
from labkit.recordings import Figure, Recording, summary
from labkit.timing import format_seconds

NOT_HERE = "a recorded figure was measured on that hardware, on that day, not here and not now"
NONE_SHIPS = ("No recording of GPU figures ships with this labkit (labkit/recordings/ holds "
              "none), so no GPU figure is shown here, and none is made up in its place.")  # fmt: skip
HOW_TO_RECORD = ("A recording is made on a machine with an NVIDIA GPU: run the benchmarks there "
                 "(`bash scripts/gpu_check.sh`), then `python -m labkit recordings build "
                 "benchmarks/results/*-nvidia-*.json --out labkit/recordings/`.")  # fmt: skip


def measured_here(samples_s: Sequence[float], *, preset: str, dtype: str, device: str,
                  tokens_per_step: int | None = None, what: str = "") -> Figure:
    """This machine's step times as a Figure, to be printed in the recording's own words."""
    return Figure(name=f"here/{preset}/{dtype}", benchmark="here", preset=preset, dtype=dtype,
                  what=what or "seconds per optimizer step, labkit.train.train_step",
                  unit="s per optimizer step", timed=f"this machine's {device}, now",
                  source="this notebook", samples=tuple(float(s) for s in samples_s),
                  tokens_per_step=tokens_per_step, **summary(samples_s))  # fmt: skip


def step_ratio(a: Figure, b: Figure) -> float:
    """Median step time of ``a`` ÷ that of ``b`` (the benchmarks' ratio of medians): below 1,
    ``a`` takes less time per step."""
    return a.median / b.median


def throughput_beside(recordings: Sequence[Recording], here: Figure, *,
                      benchmarks: Sequence[str] = ("gpu_throughput", "train_step"),
                      presets: Sequence[str] = ("gpu",)) -> str:  # fmt: skip
    """This machine's training step and, under it, the recorded GPU steps of ``benchmarks``
    at ``presets`` and at the preset run here (where one was recorded), each labelled."""
    lines = [f"measured on {here.timed}: {here.describe()}"]
    wanted = list(dict.fromkeys([*presets, here.preset]))
    shown = 0
    for r in recordings:
        for f in r.figures:
            if f.benchmark in benchmarks and f.preset in wanted and f.tokens_per_step:
                same = " (the preset run here)" if f.preset == here.preset else ""
                lines.append(f"{r.label()} ({f.benchmark}){same}: {f.describe()}")
                shown += 1
        _runs_apart(lines, [f for f in r.figures if f.benchmark in benchmarks
                            and f.preset in wanted and f.tokens_per_step])  # fmt: skip
        if shown and r.conditions:
            lines.append(f"  conditions of that recording: {r.conditions}")
    if not shown:
        return "\n".join([*lines, NONE_SHIPS if not recordings else
                          "No shipped recording holds this training step.", HOW_TO_RECORD])  # fmt: skip
    return "\n".join([*lines, f"({NOT_HERE}.)"])


def _runs_apart(lines: list[str], figures: Sequence[Figure]) -> None:
    """Where one recording timed the same step twice (two benchmarks), say how far apart the
    two medians are: the run-to-run spread of that day, which no single figure shows."""
    by_step: dict[tuple[str, str], list[Figure]] = {}
    for f in figures:
        by_step.setdefault((f.preset, f.dtype), []).append(f)
    for (preset, dtype), same in by_step.items():
        if len(same) > 1:
            lo, hi = min(f.median for f in same), max(f.median for f in same)
            lines.append(f"  the same step (preset {preset!r}, {dtype}) timed by "
                         f"{' and '.join(f.benchmark for f in same)}: medians "
                         f"{format_seconds(lo)} and {format_seconds(hi)}, {hi / lo - 1:.0%} "
                         "apart: two runs on one GPU on one day, under the load described below")  # fmt: skip


def _ratio_sentence(low: Figure, fp32: Figure, *, recorded: bool) -> str:
    """The verdict's rule (labkit.verdict) applied to the samples, worded for where they
    were measured: a recording's noise is that day's, not this machine's."""
    c = verdict.compare_times(low.samples, fp32.samples, names=(low.dtype, "float32"))
    if c.outcome == "faster":
        return f"{c.faster.name} is faster per step (the medians' notches do not overlap)"
    if c.outcome == "agree":
        return f"{low.dtype} and float32 agree within {100 * c.tolerance:g}%"
    return ("too noisy to tell from the recorded samples" if recorded
            else "too noisy to tell on this machine right now: rerun, or run it alone")


def precision_beside(recordings: Sequence[Recording], here: Mapping[str, Figure]) -> str:
    """Step time per precision, here and recorded, with each side's ratio to float32.

    ``here`` maps a dtype ("float32", "bfloat16", "float16") to this machine's Figure (from
    ``measured_here``). The recording shown is the first holding ``precision`` figures.
    """
    found = [(r, {f.dtype: f for f in r.figures if f.benchmark == "precision"})
             for r in recordings]
    found = [(r, figs) for r, figs in found if figs]
    first = next(iter(here.values()))
    head = f"measured on {first.timed} (preset {first.preset!r})"
    if not found:
        return "\n".join([NONE_SHIPS if not recordings else
                          "No shipped recording holds step times per precision.", HOW_TO_RECORD])  # fmt: skip
    r, figs = found[0]
    any_rec = next(iter(figs.values()))
    lines = [f"training step per precision, {head} and {r.label()} (preset {any_rec.preset!r}, "
             f"{any_rec.tokens_per_step:,} tokens per step):",
             f"  {'':<20}{'here':>30}{r.hardware:>30}"]  # fmt: skip

    def cell(f: Figure | None) -> str:
        if f is None:
            return "not measured"
        return f"{format_seconds(f.median)}, {f.tokens_per_s:,.0f} tokens/s"

    for dtype in dict.fromkeys([*here, *figs]):
        lines.append(f"  {dtype + ' step':<20}{cell(here.get(dtype)):>30}{cell(figs.get(dtype)):>30}")
    for low in ("bfloat16", "float16"):
        pair = [(side, f[low], f["float32"]) for side, f in (("here", here), ("recorded", figs))
                if low in f and "float32" in f]  # fmt: skip
        if not pair:
            continue
        cells = {side: f"{step_ratio(a, b):.2f}" for side, a, b in pair}
        lines.append(f"  {low + '/fp32 step':<20}{cells.get('here', 'not measured'):>30}"
                     f"{cells.get('recorded', 'not recorded'):>30}")
        for side, a, b in pair:
            lines.append(f"    {side}: {_ratio_sentence(a, b, recorded=side == 'recorded')}")
    lines.append("  (a ratio below 1 means the 16-bit step takes less time than float32's)")
    if r.conditions:
        lines.append(f"conditions of that recording: {r.conditions}")
    lines.append(f"({NOT_HERE}.)")
    return "\n".join(lines)


def no_trace_note(recordings: Sequence[Recording]) -> str:
    """What notebook 01 says where no NVML trace ships: what a learner can see instead, and
    how a trace is made."""
    instead = (f"What you can see instead: the key figures {recordings[0].label()} (section 4 "
               "prints them beside this machine's step, and `python -m labkit recordings show` "
               "lists them all): step times, tokens/s and MFU, not utilisation or power."
               if recordings else NONE_SHIPS)  # fmt: skip
    return ("No NVML trace of this training run ships with this version of labkit, so there is "
            "no GPU utilisation, memory or power over time to replay here.\n" + instead + "\n"
            "A trace is made on a machine with an NVIDIA GPU with `python -m labkit record-trace "
            "--out run.jsonl` (it trains as section 2 does and writes every NVML reading), and "
            "ships once it is checked in under labkit/metrics/traces/.")  # fmt: skip


def markdown_table(recording: Recording) -> str:
    """Every figure of ``recording`` as a Markdown table, under its label: the README quotes
    this table verbatim, and a test holds it to the shipped file."""
    rows = [f"| {recording.label()} | median | middle half | samples | tokens/s at the median "
            "| MFU |", "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for f in recording.figures:
        tokens = "" if f.tokens_per_s is None else f"{f.tokens_per_s:,.0f}"
        mfu = "" if f.mfu is None else f"{f.mfu:.1%}"
        rows.append(f"| `{f.benchmark}`, preset `{f.preset}`, {f.kind} | {format_seconds(f.median)} "
                    f"{f.unit.removeprefix('s ')} | {format_seconds(f.q1)} to "
                    f"{format_seconds(f.q3)} | {f.n} | {tokens} | {mfu} |")  # fmt: skip
    return "\n".join(rows)


def step_times_beside(times: Mapping[str, Sequence[float]], *, preset: str, device: str,
                      tokens_per_step: int, dtypes: Sequence[str] | None = None,
                      recordings: Sequence[Recording] | None = None) -> str:
    """:func:`precision_beside` for step times measured here (dtype → seconds per step, as
    ``labkit.precision.step_times`` returns them; only ``dtypes`` if given), against the shipped
    recordings unless ``recordings`` is given."""
    from labkit.recordings import load_shipped

    here = {dtype: measured_here(seconds, preset=preset, dtype=dtype, device=device,
                                 tokens_per_step=tokens_per_step)
            for dtype, seconds in times.items() if dtypes is None or dtype in dtypes}
    return precision_beside(load_shipped() if recordings is None else recordings, here)
