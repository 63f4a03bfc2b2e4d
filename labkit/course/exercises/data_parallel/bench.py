"""Naive vs overlapped vs bucketed data parallelism, timed side by side in real ranks, with the
α–β model's prediction of each: the learner's classes from notebook 02 or the references.

    from labkit.course.exercises.data_parallel import bench as dp_bench
    res = dp_bench.run(size="smoke", rounds=3)                      # the reference classes
    res = dp_bench.run(files={"OverlapDDP": ex_dir / "dp_overlap.py",
                              "BucketedDDP": ex_dir / "dp_buckets.py"})  # the learner's
    res["sweep"]    # one row per variant: buckets, measured and predicted step, ÷ naive

One 2-rank job (gloo on the CPU, or NCCL with ``device="cuda"`` on 2+ GPUs) times one training
step (forward, backward, gradient sync; no optimizer: it is the same for all) of each variant,
each on its own copy of one ``labkit.model.GPT``:

* ``naive``     ``NaiveDDP``: after backward, one blocking all-reduce per gradient;
* ``overlap``   ``OverlapDDP``: one asynchronous all-reduce per gradient, from its hook;
* ``bucketed``  ``BucketedDDP`` at each cap of a sweep (a fraction of the gradient bytes, up to
  all of them in one bucket).

The variants run alternately within each round (A B C, C B A, ...: ``timing.alternate``) with
a barrier before each step; the comparison is a ratio of medians. The same job times
all-reduces of a small and a large message (α and β of the α–β line,
``formulas.alpha_beta_fit``) and the backward pass without communication, and
``formulas.dp_exposed_comm_s`` predicts each variant's step as forward + backward + the
communication left exposed after backward. The sweep's *shape* is the prediction to compare
where communication is not small next to backward: tiny buckets pay α per message, one bucket
hides nothing, the best lies between. Where all the gradients' all-reduce takes a few percent
of backward (a small model on loopback), every cap is predicted within noise of the others:
:func:`sweep_verdict` says which case a run is in, and then what the measurement found. On the
CPU tier gloo's threads and the backward pass share the same cores, so "overlap" can slow the
compute it hides behind: the measured ratios say how much.

``micro_batch`` (sequences per rank; default the size's ``train.micro_batch``) sets the
backward pass the communication can hide behind: fewer sequences, shorter backward, the same
bytes.

``benchmarks/bench_dp_overlap.py`` runs this job on the reference classes and records it.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as tdist

from labkit import formulas, validate, verdict
from labkit.config import SIZES
from labkit.jobs import runtime
from labkit.jobs.spec import WorkerConfig

MODULE = "labkit.course.exercises.data_parallel.bench"
CAP_FRACTIONS = (1 / 64, 1 / 16, 1 / 4, 1.0)  # bucket cap as a fraction of the gradient bytes
CLASSES = ("OverlapDDP", "BucketedDDP")  # what a learner's files may replace


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchConfig(WorkerConfig):
    """The 2-rank timing job (the module docstring says what it times)."""

    WORKER: ClassVar[str] = MODULE
    size: str = "lab"
    """The preset (``labkit.config.SIZES``) whose model is timed."""
    rounds: int = 8
    """Timed rounds, every variant once per round."""
    warmup: int = 2
    """Untimed rounds first."""
    files: dict[str, str] = dataclasses.field(default_factory=dict)
    """Class name (one of ``CLASSES``) -> the learner's file that defines it; a class not given
    is labkit's reference answer."""
    micro_batch: int | None = None
    """Sequences per rank in the timed step (None: the size's ``train.micro_batch``)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        validate.one_of("size", self.size, SIZES)
        validate.whole("rounds", self.rounds, low=1)
        validate.whole("warmup", self.warmup, low=0)
        unknown = sorted(set(self.files) - set(CLASSES))
        if unknown:
            raise validate.refuse("files", unknown, f"the classes are {list(CLASSES)}")
        if self.micro_batch is not None:
            validate.whole("micro_batch", self.micro_batch, low=1,
                           why="sequences per rank, or None for the size's own")  # fmt: skip


def _time_allreduce(numel: int, device: torch.device, repeats: int) -> float:
    t = torch.ones(numel, device=device)
    times = []
    for _ in range(repeats + 2):
        tdist.barrier()
        t0 = time.perf_counter()
        tdist.all_reduce(t)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return min(times[2:])  # the fastest: what the link does when nothing else interferes


def _alpha_beta(device: torch.device, small: int, large: int) -> tuple[float, float, float,
                                                                        float, str]:  # fmt: skip
    """(intercept, slope, t_small, t_large, note) of the α–β line through a small and a large
    all-reduce, each the fastest of its repeats. A busy moment can still make the large one
    look no slower than the small one, which no line fits: time both again, twice at most,
    then fall back to the small message's time as the latency and the large one's bytes over
    its time as the bandwidth, and say so (a notebook cell must not stop for a neighbour's
    load). The slope is in bytes/s either way, as ``formulas.alpha_beta_fit`` returns it."""
    for _ in range(3):
        t_small = _time_allreduce(small, device, 10)
        t_large = _time_allreduce(large, device, 5)
        try:
            a, slope = formulas.alpha_beta_fit(4 * small, t_small, 4 * large, t_large)
            return a, slope, t_small, t_large, ""
        except ValueError:
            continue
    note = ("no α–β line fitted: the large all-reduce was never slower than the small one "
            "(a busy machine); the small one's time is taken as α, and the large one's bytes "
            "over its time as β")
    return t_small, 4 * large / t_large, t_small, t_large, note


@contextlib.contextmanager
def _counting_all_reduce(sizes: list[int]) -> Iterator[None]:
    """Append the bytes of every ``torch.distributed.all_reduce`` called inside."""
    real = tdist.all_reduce

    def spy(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        sizes.append(tensor.numel() * tensor.element_size())
        return real(tensor, *args, **kwargs)

    tdist.all_reduce = spy
    try:
        yield
    finally:
        tdist.all_reduce = real


@runtime.entrypoint
def worker(ctx: runtime.Context) -> dict[str, Any]:
    from labkit import config
    from labkit.course.exercises.data_parallel import reference as exdp
    from labkit.course.exercises.model_parallel import load_file
    from labkit.model import GPT
    from labkit.timing import alternate

    cfg = BenchConfig.from_dict(ctx.config)
    preset = config.preset(cfg.size)
    rounds, warmup, files = cfg.rounds, cfg.warmup, cfg.files
    # the learner's file where given (load_file: the module the exercise checks imported)
    overlap_cls = load_file(files["OverlapDDP"]).OverlapDDP if "OverlapDDP" in files \
        else exdp.OverlapDDP  # fmt: skip
    bucketed_cls = load_file(files["BucketedDDP"]).BucketedDDP if "BucketedDDP" in files \
        else exdp.BucketedDDP  # fmt: skip
    n, device = ctx.world_size, ctx.device
    torch.manual_seed(0)
    base = GPT(preset.model).to(device)
    params = [p for p in base.parameters() if p.requires_grad]
    grad_bytes = sum(p.numel() * p.element_size() for p in params)
    g = torch.Generator().manual_seed(1 + ctx.rank)  # each rank its own slice of the batch
    b, s = cfg.micro_batch or preset.train.micro_batch, preset.model.seq_len
    tokens = torch.randint(0, preset.model.vocab_size, (b, s + 1), generator=g).to(device)
    x, y = tokens[:, :-1], tokens[:, 1:]

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    # 1. α and β of this link: a 1 KiB and a large all-reduce (t = 2(n−1)α + 2(n−1)/n · S/β)
    small, large = 256, max(2**20, grad_bytes // 4)
    a, slope, t_small, t_large, fit_note = _alpha_beta(device, small, large)
    alpha_s = a / (2 * (n - 1))  # per ring step
    beta = slope * 2 * (n - 1) / n  # bytes/s per link, as formulas.ring_allreduce_time wants

    # 2. forward and backward with no communication at all
    plain = copy.deepcopy(base)

    def compute_only() -> tuple[float, float]:
        plain.zero_grad(set_to_none=True)
        sync()
        t0 = time.perf_counter()
        _, loss = plain(x, y)
        sync()
        t1 = time.perf_counter()
        loss.backward()
        sync()
        return t1 - t0, time.perf_counter() - t1

    for _ in range(warmup):
        compute_only()
    fb = [compute_only() for _ in range(rounds)]
    forward_s = statistics.median(f for f, _ in fb)
    backward_s = statistics.median(bw for _, bw in fb)

    # 3. the variants, each on its own copy (hooks stay on the parameters they were put on)
    caps_mb = [grad_bytes * f / 2**20 for f in CAP_FRACTIONS]
    variants: dict[str, tuple[torch.nn.Module, Any]] = {}
    for name, make in [("naive", lambda m: exdp.NaiveDDP(m, n)),
                       ("overlap", lambda m: overlap_cls(m, n)),
                       *[(f"bucketed_{f:g}", lambda m, c=c: bucketed_cls(m, n, c))
                         for f, c in zip(CAP_FRACTIONS, caps_mb, strict=True)]]:  # fmt: skip
        model = copy.deepcopy(base)
        variants[name] = (model, make(model))

    def step_of(name: str):
        model, ddp = variants[name]

        def run() -> float:
            model.zero_grad(set_to_none=True)
            tdist.barrier()  # both ranks start together; not timed
            sync()
            t0 = time.perf_counter()
            _, loss = model(x, y)
            loss.backward()
            ddp.finish_gradient_sync()
            sync()
            return time.perf_counter() - t0

        return run

    # The messages each variant really sends, in order: one step each under a spy on
    # all_reduce (the learner's classes call dist.all_reduce; nothing else is assumed).
    messages: dict[str, list[int]] = {}
    for name in variants:
        with _counting_all_reduce(messages.setdefault(name, [])):
            step_of(name)()
    silent = [name for name, sizes in messages.items() if not sizes]
    if silent:
        raise RuntimeError(f"{silent} sent no message through torch.distributed.all_reduce in a "
                           "step, so nothing can be counted or predicted: call it as "
                           "dist.all_reduce(...) (with `import torch.distributed as dist`), not "
                           "an all_reduce imported by name")  # fmt: skip
    samples = alternate({name: step_of(name) for name in variants}, rounds=rounds, warmup=warmup)

    # 4. the α–β prediction for each variant's step, from the messages it sent
    predicted = {
        # naive: every gradient after backward, one at a time (no overlap: backward_s = 0)
        name: formulas.dp_exposed_comm_s(sizes, 0.0 if name == "naive" else backward_s, n,
                                         alpha_s, beta)
        for name, sizes in messages.items()
    }
    buckets = {name: sizes for name, sizes in messages.items() if name.startswith("bucketed_")}
    return {
        "samples_s": samples,
        "forward_s": forward_s,
        "backward_s": backward_s,
        "alpha_s": alpha_s,
        "beta_bytes_per_s": beta,
        "allreduce_s": {"small_bytes": 4 * small, "small": t_small, "large_bytes": 4 * large,
                        "large": t_large},
        "grad_bytes": grad_bytes,
        "n_params": len(params),
        "micro_batch": b,
        "caps_mb": dict(zip([f"bucketed_{f:g}" for f in CAP_FRACTIONS], caps_mb, strict=True)),
        "buckets_bytes": buckets,
        "messages_bytes": messages,
        "predicted_exposed_s": predicted,
        "predicted_step_s": {k: forward_s + backward_s + v for k, v in predicted.items()},
        "fit_note": fit_note,
        "classes": {"OverlapDDP": files.get("OverlapDDP", "reference"),
                    "BucketedDDP": files.get("BucketedDDP", "reference")},
    }


def run(*, size: str = "lab", rounds: int = 8, warmup: int = 2, device: str = "cpu",
        timeout_s: float = 300.0, files: dict[str, str | Path] | None = None,
        stream: bool = False, micro_batch: int | None = None) -> dict[str, Any]:  # fmt: skip
    """Run the 2-rank job and return rank 0's measurements plus ``sweep``: one row per
    variant with its buckets, measured median step, predicted step, and both ÷ naive.

    ``files``: class name (``"OverlapDDP"``, ``"BucketedDDP"``) -> the learner's file that
    defines it; a class not given is labkit's reference answer. ``micro_batch``: sequences
    per rank in the timed step (None: the size's ``train.micro_batch``)."""
    from labkit.jobs import launch

    job = BenchConfig(size=size, rounds=rounds, warmup=warmup, micro_batch=micro_batch,
                      files={k: str(v) for k, v in (files or {}).items()})  # fmt: skip
    res = launch.run(job, nproc=2, device=device, stream=stream, timeout_s=timeout_s,
                     env={"OMP_NUM_THREADS": "1"} if device == "cpu" else None)  # fmt: skip
    r0 = dict(res.rank(0))
    median = {k: statistics.median(v) for k, v in r0["samples_s"].items()}
    r0["median_s"] = median
    r0["sweep"] = [
        {"variant": k, "cap_mb": r0["caps_mb"].get(k),
         "buckets": len(r0["messages_bytes"][k]),
         "measured_s": median[k], "predicted_s": r0["predicted_step_s"][k],
         "measured_vs_naive": median[k] / median["naive"],
         "predicted_vs_naive": r0["predicted_step_s"][k] / r0["predicted_step_s"]["naive"]}
        for k in r0["samples_s"]
    ]  # fmt: skip
    return r0


def report(res: dict[str, Any], device: str = "cpu") -> str:
    """The measurements as a table, each number labelled."""
    lines = [
        f"2 ranks on {device}, {res['n_params']} gradient tensors, "
        f"{res['grad_bytes'] / 2**20:.2f} MiB; measured: forward {res['forward_s'] * 1e3:.1f} ms, "
        f"backward {res['backward_s'] * 1e3:.1f} ms, α {res['alpha_s'] * 1e6:.0f} µs per ring "
        f"step, β {res['beta_bytes_per_s'] / 1e9:.2f} GB/s",
        f"{'variant':<18}{'buckets':>8}{'measured ms':>13}{'predicted ms':>14}"
        f"{'meas/naive':>12}{'pred/naive':>12}",
    ]
    if res.get("fit_note"):
        lines.insert(1, f"note: {res['fit_note']}")
    for row in res["sweep"]:
        lines.append(f"{row['variant']:<18}{row['buckets']:>8}{row['measured_s'] * 1e3:>13.1f}"
                     f"{row['predicted_s'] * 1e3:>14.1f}{row['measured_vs_naive']:>12.2f}"
                     f"{row['predicted_vs_naive']:>12.2f}")  # fmt: skip
    return "\n".join(lines)


def sweep_verdict(res: dict[str, Any], tolerance: float = verdict.DEFAULT_TOLERANCE) -> str:
    """What the bucket-size sweep predicted and what it measured, each sentence chosen by
    comparing numbers (``res``: what :func:`run` returns).

    Predicted: the caps' predicted steps are said to differ only when their spread exceeds
    both ``tolerance`` of the best predicted step and the measured medians' own uncertainty
    (the widest notch half-width, ``verdict.Summary.interval``); otherwise the model predicts
    no difference at this size, and the sentence says what its shape would need (the
    gradients' all-reduce against the backward pass, both in ms). Measured: the fastest and
    the slowest cap compared with ``verdict.compare_times``. The last sentence sets the two
    side by side."""
    swept = [r for r in res["sweep"] if r["variant"].startswith("bucketed_")]
    if len(swept) < 2:
        raise ValueError(f"the sweep has {len(swept)} bucketed variant(s): it needs two or more")

    def label(row: dict[str, Any]) -> str:
        k = row["buckets"]
        return f"{k} bucket{'s' if k != 1 else ''}"

    summaries = {r["variant"]: verdict.summarize(res["samples_s"][r["variant"]]) for r in swept}
    noise = max((s.interval[1] - s.interval[0]) / 2 for s in summaries.values())
    best_p = min(swept, key=lambda r: r["predicted_s"])
    worst_p = max(swept, key=lambda r: r["predicted_s"])
    spread = worst_p["predicted_s"] - best_p["predicted_s"]
    threshold = max(tolerance * best_p["predicted_s"], noise)
    ms = 1e3
    lines = []
    tie = spread <= threshold
    if tie:
        whole = formulas.ring_allreduce_time(res["grad_bytes"], 2, res["alpha_s"],
                                             res["beta_bytes_per_s"])  # fmt: skip
        lines.append(
            f"predicted (α–β): the caps' steps lie within {spread * ms:.1f} ms of each other "
            f"({best_p['predicted_s'] * ms:.1f} to {worst_p['predicted_s'] * ms:.1f} ms), less "
            f"than {threshold * ms:.1f} ms (the larger of {100 * tolerance:g}% of a step and the "
            "measured medians' uncertainty): the model predicts no difference between the caps "
            f"at this size. Its shape (tiny buckets pay α per message, one bucket hides "
            f"nothing) needs an all-reduce that is not small next to backward; here all the "
            f"gradients in one all-reduce take {whole * ms:.1f} ms (predicted), backward "
            f"{res['backward_s'] * ms:.1f} ms (measured)")  # fmt: skip
    else:
        lines.append(
            f"predicted (α–β): {label(best_p)} is best, {spread * ms:.1f} ms faster than "
            f"{label(worst_p)}, more than the {threshold * ms:.1f} ms the measurement can "
            "resolve")  # fmt: skip
    best_m = min(swept, key=lambda r: r["measured_s"])
    worst_m = max(swept, key=lambda r: r["measured_s"])
    cmp = verdict.compare_times(res["samples_s"][best_m["variant"]],
                                res["samples_s"][worst_m["variant"]],
                                names=(f"fastest cap, {label(best_m)}",
                                       f"slowest cap, {label(worst_m)}"),
                                tolerance=tolerance)  # fmt: skip
    lines.append(f"measured ({cmp.a.n} rounds each):")
    lines.append(str(cmp))
    found = cmp.outcome == "faster"
    if tie and not found:
        lines.append("Prediction and measurement agree: no cap stands out at this size.")
    elif tie:
        lines.append(
            f"The measurement found a difference the α–β model does not predict ({label(best_m)} "
            "fastest): a cost the model leaves out, such as the hooks, the copies into the "
            "buckets, or gloo's threads taking cores from backward (not measured here).")  # fmt: skip
    elif not found:
        lines.append(
            f"The model's {spread * ms:.1f} ms between the caps did not show beyond the "
            "measurement's noise.")  # fmt: skip
    elif best_m["variant"] == best_p["variant"]:
        lines.append(f"Prediction and measurement agree: {label(best_m)} is best.")
    else:
        lines.append(
            f"They disagree: the model predicted {label(best_p)} best, the measurement found "
            f"{label(best_m)}.")  # fmt: skip
    return "\n".join(lines)



def plot_bench(res: dict[str, Any], device: str = "cpu", ax: Any = None) -> None:
    """One step against messages per step: the bucket-cap sweep measured and predicted
    (α–β), and naive and overlapped measured (``res``: what :func:`run` returns)."""
    import matplotlib.pyplot as plt

    show = ax is None  # a figure of its own: shown here; on the caller's axes: drawn only
    if ax is None:
        _, ax = plt.subplots(figsize=(6.5, 3.2))
    rows = {r["variant"]: r for r in res["sweep"]}
    swept = [r for r in res["sweep"] if r["variant"].startswith("bucketed_")]
    ax.plot([r["buckets"] for r in swept], [r["measured_s"] * 1e3 for r in swept], "o-",
            label="bucketed (measured)")
    ax.plot([r["buckets"] for r in swept], [r["predicted_s"] * 1e3 for r in swept], "s--",
            label="bucketed (predicted, α–β)")
    for name, marker in (("naive", "x"), ("overlap", "^")):
        ax.plot(rows[name]["buckets"], rows[name]["measured_s"] * 1e3, marker, ms=9,
                label=f"{name} (measured)")
    ax.set(xscale="log", xlabel="messages per step (buckets)", ylabel="step (ms)",
           title=f"one step, 2 ranks on {device}")
    ax.legend(fontsize=8)
    if show:
        plt.tight_layout()
        plt.show()


def describe_timed(res: dict[str, Any]) -> str:
    """What the timed classes showed (``res``: what :func:`run` returns): the overlapped step
    against the naive one (``verdict.compare_times``), the bucket-size sweep
    (:func:`sweep_verdict`), and naive's cost per message beyond forward and backward against
    the α–β model's, with the sentence that difference chooses (within 20% of the model, above
    it, or below it)."""
    overlap = verdict.compare_times(res["samples_s"]["overlap"], res["samples_s"]["naive"],
                                    names=("overlapped step", "naive step"))
    lines = [f"measured ({overlap.a.n} rounds):", str(overlap), "\nThe bucket-size sweep:",
             sweep_verdict(res)]
    # Reconcile: what naive's messages cost beyond forward and backward, against the model.
    naive = next(r for r in res["sweep"] if r["variant"] == "naive")
    per_msg = (naive["measured_s"] - res["forward_s"] - res["backward_s"]) / naive["buckets"]
    per_msg_pred = res["predicted_exposed_s"]["naive"] / naive["buckets"]
    lines.append(f"naive: {per_msg * 1e6:.0f} µs per message measured beyond forward and "
                 f"backward, {per_msg_pred * 1e6:.0f} µs predicted from the bare all-reduces' "
                 "α and β")
    if per_msg > 1.2 * per_msg_pred:
        lines.append("The model prices only the all-reduce itself. Possible causes of the rest, "
                     "not measured here: a gradient hook and Python per message and, on gloo, "
                     "hand-offs to its threads, which run on the cores the backward pass uses.")
    elif per_msg < 0.8 * per_msg_pred:
        lines.append("Below the model: α and β were fitted on two timed all-reduces, and a busy "
                     "moment during that fit makes every prediction too high; rerun to see it "
                     "move.")
    else:
        lines.append("Within 20% of the model: here the messages cost what the bare all-reduces "
                     "did.")
    return "\n".join(lines)

if __name__ == "__main__":
    worker()
