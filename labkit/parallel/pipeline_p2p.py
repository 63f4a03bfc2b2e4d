"""Pipeline parallelism's point-to-point plan: which transfers each rank posts before and after
each action of a schedule, in which ``batch_isend_irecv`` batches, and a check that a plan of
every rank cannot deadlock where sends do not buffer (NCCL).

Separate from :mod:`labkit.parallel.pipeline`, which posts the plan: the plan is pure
bookkeeping over a schedule's action list, tested (and explained in notebook 03d) without any
process.
"""


from collections.abc import Sequence

from labkit.parallel.schedules import schedule_order

# --- the point-to-point plan: which transfers each rank posts, and in which groups ------------

# One transfer, as a rank sees it: ("send" or "recv", peer rank, "act" or "grad", micro-batch).
P2P = tuple[str, int, str, int]
Batch = list[P2P]  # posted together with one ``batch_isend_irecv``


def _transfers(kind: str, mb: int, stage: int, p: int) -> tuple[P2P | None, P2P | None]:
    """The receive action (``kind``, ``mb``) needs before it computes, the send it makes after.

    F(mb) receives the activation from stage − 1 and sends its output to stage + 1; B(mb)
    receives the output's gradient from stage + 1 and sends the input's to stage − 1. The
    first stage has no one before it, the last no one after it.
    """
    if kind == "F":
        recv = ("recv", stage - 1, "act", mb) if stage > 0 else None
        send = ("send", stage + 1, "act", mb) if stage < p - 1 else None
    else:
        recv = ("recv", stage + 1, "grad", mb) if stage < p - 1 else None
        send = ("send", stage - 1, "grad", mb) if stage > 0 else None
    return recv, send


def p2p_plan(order: Sequence[tuple[str, int]], stage: int, p: int) -> list[tuple[Batch, Batch]]:
    """For each action of ``order``: the batch this stage posts before computing it, and after.

    Why batches. NCCL runs all point-to-point traffic between two ranks in issue order on one
    stream, and a send of more than NCCL's small internal buffer does not finish until the peer
    has posted the matching receive (NVIDIA/nccl#783; #479 for grouping a send with a receive).
    Posted one at a time, 1F1B's steady state deadlocks for every m >= 2: with p = 2, m = 2,
    stage 0 posts send a0, send a1, recv g0, recv g1 and stage 1 recv a0, send g0, recv a1,
    send g1. Send a1 waits for recv a1, queued behind send g0, which waits for recv g0, queued
    behind send a1: a cycle. gloo buffers sends, so CPU runs never show it.

    The cure is torch's own (``torch.distributed.pipelining.Schedule1F1B`` posts the forward's
    send and the backward's receive as one ``batch_isend_irecv``, "for deadlock avoidance"): a
    send whose very next transfer on this rank is a receive from the *same* peer is held back
    and posted together with that receive, so each side offers both halves at once. That only
    happens when the next action starts with that receive (F then B on the link to stage + 1,
    B then F on the link to stage − 1), so nothing is computed in between: holding the send
    back delays no one. Every other send goes alone right after its action.

    Returns one (before, after) pair per action: ``before`` holds the action's receive, with a
    held-back send of the previous action first; ``after`` holds its send unless it was held
    back. Either may be empty. ``Pipeline._run_order`` executes exactly this plan, and
    ``p2p_deadlock`` checks a plan of every rank without running anything.
    """
    steps = [_transfers(kind, mb, stage, p) for kind, mb in order]
    plan: list[tuple[Batch, Batch]] = []
    held: P2P | None = None  # the previous action's send, waiting for this action's receive
    for i, (recv, send) in enumerate(steps):
        before = ([held] if held else []) + ([recv] if recv else [])
        held = None
        after: Batch = []
        if send is not None:
            next_recv = steps[i + 1][0] if i + 1 < len(steps) else None
            if next_recv is not None and next_recv[1] == send[1]:
                held = send
            else:
                after = [send]
        plan.append((before, after))
    return plan


def p2p_batches(schedule: str, p: int, m: int, stage: int) -> list[Batch]:
    """The batches one stage posts during a step of ``schedule``, in order (empty ones left out)."""
    plan = p2p_plan(schedule_order(schedule, p, m, stage), stage, p)
    return [batch for pair in plan for batch in pair if batch]


def p2p_deadlock(batches: Sequence[Sequence[Batch]]) -> str | None:
    """Play every rank's batches (``batches[rank]``) with rendezvous semantics; None if all end.

    The strictest model of NCCL: a rank posts its batches one after the other and a batch is
    done only when each of its transfers has met its partner (a send finishes when the peer
    has posted the receive, however small the tensor); between two ranks, the k-th send one
    way meets the k-th receive (FIFO, tags are not looked at, as in NCCL). A plan that ends
    here ends on any real transport, which can only buffer more. Returns a description of the
    first problem: a deadlock (every unfinished rank waits), or a send met by a receive of a
    different tensor (NCCL would deliver the wrong data silently).
    """
    n = len(batches)
    pos = [0] * n  # index of the batch each rank is posting
    open_ops = [list(b[0]) if b else [] for b in batches]  # its transfers still unmatched
    while True:
        progressed = False
        for a in range(n):
            for b in range(n):
                # FIFO: a's first unmatched send to b meets b's first unmatched receive from
                # a; earlier batches are done, so these are the first ones of the whole step.
                send = next((o for o in open_ops[a] if o[0] == "send" and o[1] == b), None)
                recv = next((o for o in open_ops[b] if o[0] == "recv" and o[1] == a), None)
                if send is None or recv is None:
                    continue
                if send[2:] != recv[2:]:
                    return (f"rank {a} sends {send[2]} {send[3]} to rank {b}, which receives "
                            f"{recv[2]} {recv[3]} from it in that place")  # fmt: skip
                open_ops[a].remove(send)
                open_ops[b].remove(recv)
                progressed = True
        for r in range(n):  # a rank whose batch is done posts its next one
            while not open_ops[r] and pos[r] < len(batches[r]):
                pos[r] += 1
                progressed = True
                if pos[r] < len(batches[r]):
                    open_ops[r] = list(batches[r][pos[r]])
        if all(pos[r] >= len(batches[r]) for r in range(n)):
            return None
        if not progressed:
            waiting = "; ".join(
                f"rank {r} at batch {pos[r]} waits on {open_ops[r]}"
                for r in range(n)
                if pos[r] < len(batches[r])
            )
            return f"deadlock: {waiting}"

