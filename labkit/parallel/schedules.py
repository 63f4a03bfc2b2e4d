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

from typing import Any

Action = tuple[str, int]  # ("F" or "B", micro-batch index)

ORDERS = ("naive", "gpipe", "1f1b")


def _check(p: int, m: int, stage: int) -> None:
    for name, value in (("p", p), ("m", m)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: need a positive integer")
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
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{arg}={value!r}: need a positive integer")
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
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{arg}={value!r}: need a positive integer")
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
    if isinstance(p, bool) or not isinstance(p, int) or p < 1:
        raise ValueError(f"p={p!r}: need a positive integer")
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
