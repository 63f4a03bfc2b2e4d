"""Pipeline schedules as plain lists of actions, and an ideal-clock simulator for them.

A schedule tells one stage, in order, which micro-batch to run forward ("F") or backward
("B"). Writing it down as data, apart from the code that executes it, lets a learner read it,
test it without processes, and simulate it:

    >>> gpipe_order(p=2, m=3, stage=0)
    [('F', 0), ('F', 1), ('F', 2), ('B', 0), ('B', 1), ('B', 2)]
    >>> one_f_one_b_order(p=2, m=3, stage=0)
    [('F', 0), ('F', 1), ('B', 0), ('F', 2), ('B', 1), ('B', 2)]

* naive: the whole batch as one micro-batch; only one stage works at any time.
* GPipe (Huang et al. 2019, arXiv 1811.06965): all m forwards, then all m backwards. A stage
  holds the activations of all m micro-batches at the peak.
* 1F1B (PipeDream-Flush: Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN
  Training", ICML 2021, arXiv 2006.09503; used by Megatron-LM, arXiv 2104.04473): stage i runs
  p−1−i warm-up forwards, then alternates one forward and one backward. The bubble is GPipe's, but
  a stage holds activations of at most p−i micro-batches, not m.

``simulate`` plays a schedule on an ideal clock (fixed forward and backward times, optional
link latency) and returns the same event dicts the real pipeline records, so measured and
ideal timelines go through the same analysis (``labkit.parallel.timeline``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from labkit.validate import whole

Action = tuple[str, int]  # ("F" or "B", micro-batch index)

ORDERS = ("naive", "gpipe", "1f1b")


def _check(p: int, m: int, stage: int) -> None:
    for name, value in (("p", p), ("m", m)):
        whole(name, value, low=1)
    if not isinstance(stage, int) or not 0 <= stage < p:
        raise ValueError(f"stage={stage!r}: need 0 <= stage < p={p}")


def naive_order(p: int, stage: int) -> list[Action]:
    """No micro-batches: one forward and one backward of the whole batch."""
    _check(p, 1, stage)
    return [("F", 0), ("B", 0)]


def gpipe_order(p: int, m: int, stage: int) -> list[Action]:
    """GPipe: every forward, then every backward (same order on every stage)."""
    _check(p, m, stage)
    return [("F", j) for j in range(m)] + [("B", j) for j in range(m)]


def one_f_one_b_order(p: int, m: int, stage: int) -> list[Action]:
    """1F1B (PipeDream-Flush): warm-up forwards, alternate F and B, cool-down backwards.

    Stage ``stage`` first runs ``min(p − 1 − stage, m)`` forwards: just enough that the first
    backward can reach it as soon as the last stage has produced it. The last stage has no
    warm-up and alternates from the start.
    """
    _check(p, m, stage)
    warmup = min(p - 1 - stage, m)
    order: list[Action] = [("F", j) for j in range(warmup)]
    for j in range(m - warmup):  # steady state: one forward, then the oldest backward
        order += [("F", warmup + j), ("B", j)]
    order += [("B", j) for j in range(m - warmup, m)]  # cool-down
    return order


def schedule_order(name: str, p: int, m: int, stage: int) -> list[Action]:
    """The action list of schedule ``name`` ("naive", "gpipe" or "1f1b") for one stage."""
    if name == "naive":
        return naive_order(p, stage)
    if name == "gpipe":
        return gpipe_order(p, m, stage)
    if name == "1f1b":
        return one_f_one_b_order(p, m, stage)
    raise ValueError(f"schedule={name!r}: use one of {ORDERS}")


def peak_in_flight(order: list[Action]) -> int:
    """Most micro-batches whose forward has run but whose backward has not: how many sets of
    activations the stage holds at its peak (m for GPipe, p − stage for 1F1B when m ≥ p)."""
    live = peak = 0
    for kind, _ in order:
        live += 1 if kind == "F" else -1
        peak = max(peak, live)
    return peak


def simulate(
    name: str,
    p: int,
    m: int,
    *,
    t_f: float = 1.0,
    t_b: float = 2.0,
    t_comm: float = 0.0,
) -> list[dict[str, Any]]:
    """Play schedule ``name`` on an ideal clock; return its events (times in seconds).

    Each stage takes ``t_f`` per forward and ``t_b`` per backward of one micro-batch (the
    backward costs about twice the forward: two matmuls per weight instead of one), and a
    tensor takes ``t_comm`` to reach the neighbour stage. F(stage s, mb j) needs F(s−1, j);
    B(s, j) needs B(s+1, j); each stage runs its actions in order. The result has one dict
    {rank, mb, kind, start_s, end_s} per action, like the events the real pipeline records.
    Raises RuntimeError if the orders deadlock (an action waits for one that never runs).
    """
    orders = [schedule_order(name, p, m, s) for s in range(p)]
    done: dict[tuple[int, str, int], float] = {}  # (stage, kind, mb) -> end time
    free_at = [0.0] * p  # when each stage finishes its previous action
    nxt = [0] * p
    events: list[dict[str, Any]] = []
    while any(nxt[s] < len(orders[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            if nxt[s] == len(orders[s]):
                continue
            kind, j = orders[s][nxt[s]]
            if kind == "F":
                dep = (s - 1, "F", j) if s > 0 else None
            else:
                dep = (s + 1, "B", j) if s < p - 1 else (s, "F", j)
            if dep is not None and dep not in done:
                continue
            ready = 0.0 if dep is None else done[dep] + (t_comm if dep[0] != s else 0.0)
            start = max(free_at[s], ready)
            end = start + (t_f if kind == "F" else t_b)
            done[(s, kind, j)] = free_at[s] = end
            events.append({"rank": s, "mb": j, "kind": kind, "start_s": start, "end_s": end})
            nxt[s] += 1
            progressed = True
        if not progressed:
            raise RuntimeError(f"schedule {name!r} deadlocks for p={p}, m={m}")
    return sorted(events, key=lambda e: (e["rank"], e["start_s"]))


# --- modern schedules: several stages per rank, backward split in two ----------------------------
#
# torch.distributed.pipelining runs them; this module predicts their bubble, checks the number
# of micro-batches before any process starts, and replays torch's own action lists on an ideal
# clock. An action there is (kind, stage, micro-batch) with kind "F" (forward), "B" (the whole
# backward), or, in the zero-bubble schedules, "I" (backward to the input: what the previous
# stage waits for) and "W" (backward to the weights: nobody waits for it, so it can fill a gap).

# Our names for torch's schedules; v is the number of stages each rank holds.
TORCH_SCHEDULES = {
    "gpipe": ("ScheduleGPipe", 1),
    "1f1b": ("Schedule1F1B", 1),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", 2),
    "interleaved_zb": ("ScheduleInterleavedZeroBubble", 2),
    "zbv": ("ScheduleZBVZeroBubble", 2),
}


def validate_torch_schedule(name: str, p: int, m: int, batch_size: int, n_layer: int) -> int:
    """Raise ValueError for a (schedule, p, m) torch's pipelining would refuse; return v.

    The rules, read from torch 2.13's ``torch/distributed/pipelining/schedules.py``:

    * ``Schedule1F1B``: m >= p (it raises otherwise);
    * ``ScheduleInterleaved1F1B`` and ``ScheduleInterleavedZeroBubble``: micro-batches run in
      r = max(1, m // p) rounds (``number_of_rounds``) of m / r each
      (``microbatches_per_round``); m must be a multiple of r (m = 5 with p = 2 gives r = 2
      and fails, 4 and 6 run). Megatron-LM's original interleaved schedule is stricter: m a
      multiple of p;
    * ``ScheduleZBVZeroBubble``: exactly 2 stages per rank, placed in a V (rank r holds
      stages r and 2p−1−r); its steady state needs m >= 2p−1 to be bubble-free (torch plans
      for max(2p−1, m) and drops the rest);

    and ours: v·p stages need at least that many blocks, and m must divide the batch.
    Call it before ``launch.run``: the error appears in the cell, not from every rank.
    """
    if name not in TORCH_SCHEDULES:
        raise ValueError(f"schedule={name!r}: use one of {tuple(TORCH_SCHEDULES)}")
    for arg, value in (("p", p), ("m", m), ("batch_size", batch_size), ("n_layer", n_layer)):
        whole(arg, value, low=1)
    v = TORCH_SCHEDULES[name][1]
    if v * p > n_layer:
        raise ValueError(
            f"schedule={name!r} puts {v} stages on each of p={p} ranks: {v * p} stages, but the"
            f" model has n_layer={n_layer} blocks; use p <= {n_layer // v} or a deeper model"
        )
    if batch_size % m:
        raise ValueError(
            f"m={m} micro-batches do not divide batch_size={batch_size}: use a divisor of it"
        )
    if name == "1f1b" and m < p:
        raise ValueError(
            f"schedule='1f1b' needs m >= p (torch's Schedule1F1B), got m={m}, p={p}: use m >= {p}"
        )
    if name in ("interleaved_1f1b", "interleaved_zb"):
        rounds = max(1, m // p)
        if m % rounds:
            ok = [k for k in range(1, 4 * p + 1) if k % max(1, k // p) == 0]
            raise ValueError(
                f"schedule={name!r} runs the micro-batches in max(1, m // p) = {rounds}"
                f" rounds, and m={m} is not a multiple of the number of rounds (torch's"
                f" {TORCH_SCHEDULES[name][0]}); use m in {ok} (a multiple of p={p} always works)"
            )
    return v


def stage_placement(name: str, p: int) -> list[list[int]]:
    """Which stages each rank holds: ``[[stages of rank 0], [stages of rank 1], ...]``.

    One stage per rank (GPipe, 1F1B): [[0], [1]]. Interleaved ("loop"): rank r holds r, r+p,
    ... (p = 2: [[0, 2], [1, 3]]), so a micro-batch visits every rank v times. ZB-V ("V"):
    rank r holds r and 2p−1−r (p = 2: [[0, 3], [1, 2]]): the first rank also runs the last
    stage, and the loss's backward starts where the forward ended.
    """
    v = TORCH_SCHEDULES[name][1] if name in TORCH_SCHEDULES else None
    if v is None:
        raise ValueError(f"schedule={name!r}: use one of {tuple(TORCH_SCHEDULES)}")
    if name == "zbv":
        return [[r, 2 * p - 1 - r] for r in range(p)]
    return [[r + k * p for k in range(v)] for r in range(p)]


def interleaved_overhead(p: int, v: int, m: int) -> float:
    """Bubble time over ideal time for interleaved 1F1B: (p−1)/(v·m).

    Narayanan et al. 2021 (arXiv 2104.04473), section 2.2.2: each of the v chunks a rank
    holds is 1/v of its layers, so the warm-up and cool-down, p−1 chunk-steps long, shrink v
    times; the price is v times more point-to-point messages. v = 1 is 1F1B's (p−1)/m.
    """
    for arg, value in (("p", p), ("v", v), ("m", m)):
        whole(arg, value, low=1)
    return (p - 1) / (v * m)


def zero_bubble_time(schedule: str, p: int, t_f: float, t_b: float, t_w: float) -> float:
    """Idle time per rank of one step, from Qi et al. 2023 (arXiv 2401.10241), per schedule.

    ``t_f`` forward, ``t_b`` backward to the input ("B" in the paper, "I" in torch), ``t_w``
    backward to the weights, all per micro-batch per stage:

    * "1f1b": (p−1)(t_f + t_b + t_w): the whole backward waits (paper, section 2);
    * "zb-h1": (p−1)(t_f + t_b − t_w): W is delayed to fill the cool-down, one third of
      1F1B's bubble when the three are equal (section 2.1, Figure 3 top); torch's
      ``ScheduleInterleavedZeroBubble`` is its interleaved form (ZB1P);

    ZB-V (section 6; torch's ``ScheduleZBVZeroBubble``) claims zero bubble when t_f = t_b =
    t_w and m >= 2p−1, and gives no closed form for unequal times: for it, and for the
    interleaved ZB1P, replay torch's own action list with measured times
    (``simulate_actions``): a modelled prediction, not a formula.
    """
    for arg, value in (("t_f", t_f), ("t_b", t_b), ("t_w", t_w)):
        if not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"{arg}={value!r}: need a non-negative number of seconds")
    p = whole("p", p, low=1)
    if schedule == "1f1b":
        return (p - 1) * (t_f + t_b + t_w)
    if schedule == "zb-h1":
        return (p - 1) * max(0.0, t_f + t_b - t_w)
    raise ValueError(f"schedule={schedule!r}: use '1f1b' or 'zb-h1'")


StageAction = tuple[str, int, int]  # (kind "F"/"B"/"I"/"W", stage, micro-batch)


def simulate_actions(
    orders: dict[int, list[StageAction]] | list[list[StageAction]],
    *,
    t_f: float = 1.0,
    t_b: float = 2.0,
    t_w: float | None = None,
    t_comm: float = 0.0,
) -> list[dict[str, Any]]:
    """Play per-rank action lists with several stages per rank on an ideal clock.

    ``orders[rank]`` lists that rank's (kind, stage, micro-batch) in order, e.g. torch's
    ``schedule.pipeline_order`` (None entries, torch's idle slots, are skipped: the clock
    decides idleness here). Durations: F ``t_f``; a whole backward B ``t_b`` (+ ``t_w`` if
    given); I ``t_b``; W ``t_w`` (required when the orders split the backward).
    Dependencies: F(s, j) after F(s−1, j); B or I (s, j) after B or I (s+1, j), the last
    stage's after its own F(s, j); W(s, j) after I(s, j). A hop between ranks costs
    ``t_comm``. Returns events {rank, stage, mb, kind, start_s, end_s}, sorted per rank.
    Raises RuntimeError on a deadlock (an action waits for one that never runs).
    """
    if not isinstance(orders, dict):
        orders = dict(enumerate(orders))
    orders = {r: [a for a in acts if a is not None] for r, acts in orders.items()}
    kinds = {a[0] for acts in orders.values() for a in acts}
    if not kinds <= {"F", "B", "I", "W"}:
        raise ValueError(f"unknown action kinds {sorted(kinds - {'F', 'B', 'I', 'W'})}")
    if kinds & {"I", "W"} and t_w is None:
        raise ValueError("the orders split the backward into I and W: pass t_w")
    dur = {"F": t_f, "B": t_b + (t_w or 0.0), "I": t_b, "W": t_w or 0.0}
    owner = {a[1]: r for r, acts in orders.items() for a in acts}
    last = max(owner)
    done: dict[tuple[str, int, int], float] = {}  # ("F"/"G"/"W", stage, mb) -> end
    free = dict.fromkeys(orders, 0.0)
    nxt = dict.fromkeys(orders, 0)
    events: list[dict[str, Any]] = []
    while any(nxt[r] < len(orders[r]) for r in orders):
        progressed = False
        for r, acts in orders.items():
            while nxt[r] < len(acts):
                kind, s, j = acts[nxt[r]]
                if kind == "F":
                    dep = ("F", s - 1, j) if s > 0 else None
                elif kind in ("B", "I"):
                    dep = ("F", s, j) if s == last else ("G", s + 1, j)
                else:
                    dep = ("G", s, j)
                if dep is not None and dep not in done:
                    break
                ready = 0.0
                if dep is not None:
                    ready = done[dep] + (t_comm if owner[dep[1]] != r else 0.0)
                start = max(free[r], ready)
                end = start + dur[kind]
                key = ("F" if kind == "F" else "W" if kind == "W" else "G", s, j)
                done[key] = free[r] = end
                events.append(
                    {"rank": r, "stage": s, "mb": j, "kind": kind, "start_s": start, "end_s": end}
                )
                nxt[r] += 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"the action lists deadlock: next actions {nxt}")
    return sorted(events, key=lambda e: (e["rank"], e["start_s"]))


def order_from_torch(pipeline_order: dict[int, list[Any]]) -> dict[int, list[StageAction]]:
    """torch's ``schedule.pipeline_order`` ({rank: [_Action or None]}) as plain tuples."""
    return {
        int(r): [
            (str(a.computation_type.value), int(a.stage_index), int(a.microbatch_index))
            for a in acts
            if a is not None
        ]
        for r, acts in pipeline_order.items()
    }


def order_from_events(events: list[dict[str, Any]]) -> dict[int, list[StageAction]]:
    """The action list each rank actually ran, read from its timed events.

    ``events`` are {rank, stage, mb, kind, start_s, ...} dicts, one per F, B, I or W a rank
    executed (what ``labkit.workers.pp_compose`` records by wrapping the stage's methods). A
    rank runs one action at a time, so its actions sorted by start time are the order it ran
    them in: what the schedule did, not what a formula or a plan says it should do. Returns
    {rank: [(kind, stage, micro-batch), ...]}, the form ``simulate_actions`` replays.
    """
    out: dict[int, list[StageAction]] = {}
    for e in sorted(events, key=lambda e: (int(e["rank"]), float(e["start_s"]))):
        if e["kind"] not in ("F", "B", "I", "W"):
            raise ValueError(f"event kind {e['kind']!r}: expected F, B, I or W")
        out.setdefault(int(e["rank"]), []).append((str(e["kind"]), int(e["stage"]), int(e["mb"])))
    if not out:
        raise ValueError("events is empty: record at least one action")
    return out


def replay_overhead(
    orders: dict[int, list[StageAction]] | list[list[StageAction]],
    op_s: dict[str, float],
) -> tuple[list[dict[str, Any]], float]:
    """Replay ``orders`` on an ideal clock with the op times ``op_s`` ({"F", "B"} or {"F", "I",
    "W"}, seconds); return the events and the bubble overhead, idle / busy averaged over ranks
    (idle: the whole step's span minus the rank's busy time, as ``timeline.bubble_from_events``
    counts it). For a correct 1F1B order this is (p−1)/m at any F and B times; another order of
    the same actions can give another value: the replay tests the order, not the formula.
    """
    t_b = op_s.get("B", op_s.get("I"))
    if "F" not in op_s or t_b is None:
        raise ValueError(f"op_s={op_s!r}: need the time of F and of B (or I and W)")
    events = simulate_actions(orders, t_f=op_s["F"], t_b=t_b, t_w=op_s.get("W"))
    start = min(e["start_s"] for e in events)
    span = max(e["end_s"] for e in events) - start
    ranks = sorted({e["rank"] for e in events})
    busy = {r: sum(e["end_s"] - e["start_s"] for e in events if e["rank"] == r) for r in ranks}
    return events, sum((span - busy[r]) / busy[r] for r in ranks) / len(ranks)


# --- an ideal run of one schedule, as notebook 03 shows it ---------------------------------------


@dataclass(frozen=True)
class IdealRun:
    """One schedule played on an ideal clock (``simulate``), with the bubble its timeline
    shows next to the formula and the micro-batches stage 0 holds at its peak."""

    name: str
    p: int
    m: int
    events: list[dict[str, Any]]

    @property
    def bubble(self) -> float:
        """The bubble of the simulated timeline, averaged over ranks."""
        from labkit.parallel.timeline import mean_bubble  # lazy: it imports torch

        return mean_bubble(self.events)

    @property
    def peak_in_flight(self) -> int:
        """Micro-batches stage 0 holds at its peak (``peak_in_flight`` of its order)."""
        return peak_in_flight(schedule_order(self.name, self.p, self.m, 0))

    def describe(self) -> str:
        from labkit import formulas

        return (f"{self.name}: modelled bubble {self.bubble:.4f}; formula (p−1)/(m+p−1) = "
                f"{formulas.bubble_fraction(self.p, self.m):.4f}; peak micro-batches held by "
                f"stage 0: {self.peak_in_flight}")


def ideal_run(name: str, p: int, m: int, *, t_f: float = 1.0, t_b: float = 2.0) -> IdealRun:
    """``simulate(name, p, m, t_f=t_f, t_b=t_b)``, kept with its name, p and m."""
    return IdealRun(name, p, m, simulate(name, p, m, t_f=t_f, t_b=t_b))


def plot_ideal_runs(runs: list[IdealRun], axes: Any = None) -> Any:
    """Each ideal run's timeline, one under the other, on a shared clock counted in forwards;
    returns the Axes."""
    import matplotlib.pyplot as plt  # lazy: importing labkit must stay cheap

    from labkit.parallel.timeline import plot_timeline

    if axes is None:
        _, axes = plt.subplots(len(runs), 1, figsize=(10, 5), sharex=True, squeeze=False)
        axes = axes[:, 0]
    for ax, run in zip(axes, runs, strict=True):
        plot_timeline(run.events, ax=ax, unit="forward",
                      title=f"{run.name}, p = {run.p}, m = {run.m} (modelled, ideal clock)")
    plt.tight_layout()
    return axes


# --- notebook 03d: torch's schedules predicted, run, replayed ------------------------------------


@dataclass(frozen=True)
class BubbleFormulas:
    """Each schedule's bubble overhead (idle / busy) by its formula, for p ranks and m
    micro-batches, equal stages and free communication (``self[name]``; None: no closed form
    at unequal op times, as for interleaved zero bubble)."""

    p: int
    m: int
    n_layer: int
    overhead: dict[str, float | None]

    def __getitem__(self, name: str) -> float | None:
        return self.overhead[name]

    def describe(self) -> str:
        p, o = self.p, self.overhead
        return (f"p = {p} ranks, m = {self.m} micro-batches, {self.n_layer} blocks: "
                f"v = 1 -> {p} stages of {self.n_layer // p} blocks, v = 2 -> {2 * p} stages of "
                f"{self.n_layer // (2 * p)} block{'s' if self.n_layer // (2 * p) != 1 else ''}\n"
                f"predicted bubble overhead (idle / busy; equal stages, free communication): "
                f"1F1B (p-1)/m = {o['1f1b']:.3f}; interleaved (p-1)/(v m) = "
                f"{o['interleaved_1f1b']:.3f}; ZB-V 0 (needs m >= 2p-1 = {2 * p - 1}); ZB-H1 "
                f"(not run) at T_F = T_I = T_W a third of 1F1B, {o['1f1b'] / 3:.3f}")  # fmt: skip


def bubble_formulas(p: int, m: int, *, n_layer: int) -> BubbleFormulas:
    """GPipe's and 1F1B's (p−1)/m, interleaving's (p−1)/(2m) (v = 2), ZB-V's 0."""
    return BubbleFormulas(p, m, n_layer, {
        "gpipe": (p - 1) / m, "1f1b": (p - 1) / m,
        "interleaved_1f1b": interleaved_overhead(p, 2, m), "interleaved_zb": None, "zbv": 0.0})


def _orders(raw: dict[Any, list[Any]]) -> dict[int, list[StageAction]]:
    """A recorded or planned order as JSON brings it back: rank keys to int, actions to tuples."""
    return {int(k): [tuple(a) for a in v] for k, v in raw.items()}


@dataclass(frozen=True)
class ScheduleRuns:
    """The schedules job's rank 0 result (``labkit.workers.pp_compose``, part "schedules"),
    held against the formulas and against the order each rank really ran, replayed on an ideal
    clock with that schedule's measured median op times (``replay_overhead``)."""

    p: int
    repeats: int
    runs: dict[str, dict[str, Any]]
    formula: BubbleFormulas
    order: dict[str, dict[int, list[StageAction]]]
    """The order each rank ran its F, B (or I, W) in, read from the timed wrappers' events."""
    planned: dict[str, dict[int, list[StageAction]]]
    """torch's plan (``pipeline_order``), for the multi-stage schedules."""
    same_every_step: dict[str, bool]
    modelled: dict[str, tuple[list[dict[str, Any]], float]]
    """Per schedule: the replay's events and its overhead."""

    def describe(self) -> str:
        """The table (a blank line first, apart from the job's progress), the op times, the
        replays against the formulas, and the orders run against torch's plan."""
        lines = ["", f"{'schedule':<17} {'stages/rank':<17}{'|loss diff|':>11} {'|grad diff|':>11} "
                 f"{'overhead measured (min..max)':>29} {'formula':>8} {'modelled':>9}  measured vs both"]
        for name, r in self.runs.items():
            f, modelled = self.formula[name], self.modelled[name][1]
            preds = [v for v in (f, modelled) if v is not None]
            lo, hi = min(r["overhead_samples"]), max(r["overhead_samples"])
            where = ("above in every step" if lo > max(preds) else "BELOW in every step (read the "
                     "timeline: a measurement problem)" if hi < min(preds) else "its range holds them")
            lines.append(f"{name:<17} {r['stages']!s:<17}{r['loss_error']:>11.1e} {r['grad_error']:>11.1e} "
                         f"{r['overhead']:>14.2f} ({lo:.2f}..{hi:.2f}) "
                         f"{'n/a' if f is None else f'{f:.3f}':>8} {modelled:>9.3f}  {where}")
        lines.append(f"(measured: median of {self.repeats} steps, mean over ranks)")
        lines.append("median op times measured (ms): " + "; ".join(
            f"{n} " + ", ".join(f"{k} {1e3 * v:.2f}" for k, v in sorted(r["op_s"].items()))
            for n, r in self.runs.items()))
        for name in ("1f1b", "interleaved_1f1b"):  # the order torch ran, replayed, against the formula
            if name in self.modelled:
                got, want = self.modelled[name][1], self.formula[name]
                lands = abs(got - want) <= 0.05 * want  # within 5 %: our threshold
                lines.append(f"{name}: the order torch ran, replayed (modelled) {got:.3f} vs formula "
                             f"{want:.3f}: " + ("it lands on the formula, so torch ran the schedule "
                                                "the formula describes" if lands else "it does NOT "
                                                "land on the formula: torch ran another order than "
                                                "the formula's"))
        same = [n for n in self.planned if self.order[n] == self.planned[n]]
        lines.append(f"order run = torch's plan (pipeline_order): {', '.join(same) or 'none'}"
                     + "".join(f"; {n} ran another order than planned" for n in self.planned if n not in same)
                     + "".join(f"; {n} changed order between steps" for n, ok in self.same_every_step.items()
                               if not ok))
        return "\n".join(lines)

    def interleaving(self) -> InterleavingVerdict:
        """Interleaved 1F1B against 1F1B: step times and bubble overheads, both measured."""
        return InterleavingVerdict(self.runs.get("interleaved_1f1b"), self.runs.get("1f1b"))


def reconcile_runs(result: dict[str, Any], formula: BubbleFormulas, *, repeats: int) -> ScheduleRuns:
    """``result``: rank 0's result of the schedules job (keys "runs", "orders", "recorded")."""
    runs, planned, ran = result["runs"], result["orders"], result["recorded"]
    order = {n: _orders(rec["order"]) for n, rec in ran.items()}
    return ScheduleRuns(
        p=formula.p, repeats=repeats, runs=runs, formula=formula, order=order,
        planned={n: _orders(o) for n, o in planned.items()},
        same_every_step={n: rec["same_every_step"] for n, rec in ran.items()},
        modelled={n: replay_overhead(order[n], r["op_s"]) for n, r in runs.items()})  # fmt: skip


@dataclass(frozen=True)
class InterleavingVerdict:
    """Whether interleaving shortened the step and the bubble here: both schedules' measured
    step times (``verdict.compare_times``) and per-step bubble overheads."""

    interleaved: dict[str, Any] | None
    one_f_one_b: dict[str, Any] | None

    def describe(self) -> str:
        from labkit import verdict  # layer 3

        if self.interleaved is None or self.one_f_one_b is None:
            return "(1F1B and interleaved 1F1B were not both run: nothing to compare)"
        lines = [str(verdict.compare_times(self.interleaved["step_s_samples"],
                                           self.one_f_one_b["step_s_samples"],
                                           names=("interleaved 1F1B step", "1F1B step")))]  # fmt: skip
        o1, oi = self.one_f_one_b["overhead_samples"], self.interleaved["overhead_samples"]
        ranges = (f"1F1B {min(o1):.2f}..{max(o1):.2f}, interleaved {min(oi):.2f}..{max(oi):.2f} "
                  f"over {len(o1)} steps (measured)")
        if max(oi) < min(o1):
            lines.append(f"bubble overhead: interleaved below 1F1B in every step ({ranges}): the "
                         "reduction shows here")
        elif min(oi) > max(o1):
            lines.append(f"bubble overhead: interleaved above 1F1B in every step ({ranges}): its "
                         "extra messages and per-action costs outweighed its shorter fill here")
        else:
            lines.append(f"bubble overhead: the ranges overlap ({ranges}): the reduction "
                         "interleaving predicts is not shown on this tier")
        return "\n".join(lines)


def plot_schedule_runs(runs: ScheduleRuns, names: tuple[str, ...] = ("interleaved_1f1b", "zbv"),
                       axes: Any = None) -> Any:  # fmt: skip
    """For each of ``names`` that ran: the replay (ideal clock, measured op times) beside the
    measured last step, one row per schedule. Returns the Axes."""
    import matplotlib.pyplot as plt  # lazy: importing labkit must stay cheap

    from labkit.parallel.timeline import plot_timeline

    show = [n for n in names if n in runs.runs]
    if axes is None:
        _, axes = plt.subplots(len(show), 2, figsize=(12, 2.2 * len(show)), squeeze=False)
    for row, name in enumerate(show):
        plot_timeline(runs.modelled[name][0], ax=axes[row][0], unit="ms",
                      title=f"{name}: modelled (ideal clock, measured op times)")
        plot_timeline(runs.runs[name]["events"], ax=axes[row][1], unit="ms",
                      title=f"{name}: measured (last step)")
        for ax in axes[row]:
            ax.set_xlabel("time (ms); light F, dark B or I, orange W")
            ax.set_yticks(range(runs.p), [f"rank {k} (stages {runs.runs[name]['stages'][k]})"
                                          for k in range(runs.p)])
    plt.tight_layout()
    return axes
