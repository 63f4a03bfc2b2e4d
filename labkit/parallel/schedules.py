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
