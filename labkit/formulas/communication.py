"""Communication: bytes a collective moves, α–β times, DDP's buckets and their overlap.

NCCL-tests' bandwidth conventions, the ring formulas for what each rank sends, the α–β
(latency–bandwidth) model of a collective's time, flat and hierarchical multi-node all-reduce,
DDP's gradient buckets, and whether data-parallel communication hides behind the backward.
Separate from the memory and FLOP formulas: these predict time and bytes on the wire.
"""

from __future__ import annotations

from collections.abc import Sequence

from labkit.validate import number, one_of, positive, whole

# ----------------------------------------------------------------------------------------------
# Collective communication (NCCL-tests conventions: S = message size in bytes).

# busbw = algbw × factor; the factor makes a measurement comparable with the link's bandwidth
# whatever the number of ranks (NCCL-tests doc/PERFORMANCE.md, "Summary").
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce")


def bus_bandwidth_factor(collective: str, n_ranks: int) -> float:
    """NCCL-tests' algbw → busbw correction factor.

    all_reduce 2(n−1)/n; all_gather, reduce_scatter, all_to_all (n−1)/n; broadcast, reduce 1.
    For all_gather and reduce_scatter, S is the size of the *full* array (n × the per-rank
    piece), as in NCCL-tests.
    """
    one_of("collective", collective, COLLECTIVES)
    n = whole("n_ranks", n_ranks, low=1)
    if collective == "all_reduce":
        return 2 * (n - 1) / n
    if collective in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0


def algbw(message_bytes: float, seconds: float) -> float:
    """Algorithm bandwidth in bytes/s: S / t (NCCL-tests)."""
    return number("message_bytes", message_bytes, low=0) / positive(
        "seconds", seconds
    )


def busbw(message_bytes: float, seconds: float, collective: str, n_ranks: int) -> float:
    """Bus bandwidth in bytes/s: algbw × ``bus_bandwidth_factor(collective, n_ranks)``."""
    return algbw(message_bytes, seconds) * bus_bandwidth_factor(collective, n_ranks)


def ring_allreduce_bytes_per_rank(message_bytes: float, n_ranks: int) -> float:
    """Bytes each rank sends (and receives) in a ring all-reduce of S bytes: 2(n−1)/n × S.

    A reduce-scatter ((n−1)/n × S) followed by an all-gather ((n−1)/n × S). NCCL-tests
    PERFORMANCE.md derives the same 2(n−1)/n for any point-to-point algorithm. 0 when n = 1.
    """
    S = number("message_bytes", message_bytes, low=0)
    n = whole("n_ranks", n_ranks, low=1)
    return 2 * (n - 1) / n * S


# The α–β (latency–bandwidth, "Hockney") model: sending m bytes as one message takes α + m/β,
# with α the fixed cost of a message and β the bandwidth. A ring all-reduce of S bytes over p
# ranks takes 2(p−1) steps, each sending one S/p chunk, so T = 2(p−1)·α + 2(p−1)/p · S/β
# (Thakur, Rabenseifner and Gropp, "Optimization of Collective Communication Operations in
# MPICH", IJHPCA 19(1), 2005: https://doi.org/10.1177/1094342005051521). The model leaves
# out the time to add the received chunk into one's own (their γ term) and any overlap of the
# steps; notebook 00 measures how far that goes on the machine at hand.


def alpha_beta_time(message_bytes: float, latency_s: float, bandwidth_bytes_per_s: float,
                    messages: int = 1) -> float:  # fmt: skip
    """Seconds to send ``message_bytes`` in total as ``messages`` messages, one after another:
    ``messages`` × α + bytes / β (the α–β model; α = ``latency_s``, β in bytes/s)."""
    S = number("message_bytes", message_bytes, low=0)
    alpha = number("latency_s", latency_s, low=0)
    beta = positive("bandwidth_bytes_per_s", bandwidth_bytes_per_s)
    k = whole("messages", messages, low=1)
    return k * alpha + S / beta


def alpha_beta_fit(small_bytes: float, small_s: float, big_bytes: float,
                   big_s: float) -> tuple[float, float]:  # fmt: skip
    """(α seconds, β bytes/s) of the α–β line through two timed messages, a small and a big one.

    β is the slope's inverse, (big − small bytes) / (big − small seconds); α is what is left of
    the small message's time, at least 0. Raises ValueError when the big message did not take
    longer than the small one (the times were disturbed, or the sizes are too close to tell).
    """
    m0 = number("small_bytes", small_bytes, low=0)
    t0 = number("small_s", small_s, low=0)
    m1 = positive("big_bytes", big_bytes)
    t1 = positive("big_s", big_s)
    if m1 <= m0 or t1 <= t0:
        raise ValueError(
            f"big_bytes={big_bytes!r} in big_s={big_s!r} vs small_bytes={small_bytes!r} in "
            f"small_s={small_s!r}: the big message must be larger and take longer to fit a line; "
            "time a bigger message, or time both again on a quieter machine"
        )
    beta = (m1 - m0) / (t1 - t0)
    return max(t0 - m0 / beta, 0.0), beta


def ring_allreduce_time(message_bytes: float, n_ranks: int, latency_s: float,
                        bandwidth_bytes_per_s: float) -> float:  # fmt: skip
    """α–β time of a ring all-reduce of S bytes over n ranks: 2(n−1)·α + 2(n−1)/n · S/β.

    The data term is :func:`ring_allreduce_bytes_per_rank` / β: each rank sends and receives
    at once, so a step costs one chunk's time, not two. 0 when n = 1.
    """
    n = whole("n_ranks", n_ranks, low=1)
    if n == 1:
        return 0.0
    return alpha_beta_time(ring_allreduce_bytes_per_rank(message_bytes, n), latency_s,
                           bandwidth_bytes_per_s, messages=2 * (n - 1))  # fmt: skip


def multinode_allreduce_time(message_bytes: float, nodes: int, gpus_per_node: int, *,
                             intra_bytes_per_s: float, inter_bytes_per_s: float,
                             hierarchical: bool = False) -> float:  # fmt: skip
    """Bandwidth time of an all-reduce over ``nodes`` × ``gpus_per_node`` GPUs (latency left out).

    inter_bytes_per_s is what one GPU can send off its node at once (its share of the network
    cards: 50 GB/s for one 400 Gb/s NIC per GPU, as on a DGX H100).

    - flat ring (``hierarchical=False``): one ring through all n = N·G GPUs, node after node.
      Every step moves a chunk on every hop at once, so the step lasts as long as the slowest
      hop: the ring runs at min(intra, inter): 2(n−1)/n · S / min(...).
    - hierarchical (two-level: the 2D-torus all-reduce of Mikami et al. 2018, "Massively
      Distributed SGD: ImageNet/ResNet-50 Training in a Flash", arXiv 1811.05233; Horovod's
      hierarchical all-reduce does the same): reduce-scatter
      inside each node (each GPU ends with S/G summed over its node), all-reduce those S/G
      across the N nodes, one ring per GPU position on its own NIC, then all-gather inside the
      node: 2(G−1)/G · S/intra + 2(N−1)/N · (S/G)/inter. Only 1/G of the bytes cross the
      network per GPU, close to what NCCL's topology-aware rings and trees achieve.
    """
    s = number("message_bytes", message_bytes, low=0)
    n_nodes, g = whole("nodes", nodes, low=1), whole("gpus_per_node", gpus_per_node, low=1)
    intra = positive("intra_bytes_per_s", intra_bytes_per_s)
    inter = positive("inter_bytes_per_s", inter_bytes_per_s)
    if not hierarchical:
        n = n_nodes * g
        link = intra if n_nodes == 1 else inter if g == 1 else min(intra, inter)
        return ring_allreduce_bytes_per_rank(s, n) / link
    inside = 2 * (g - 1) / g * s / intra  # reduce-scatter + all-gather on NVLink
    across = ring_allreduce_bytes_per_rank(s / g, n_nodes) / inter
    return inside + across


def bucket_count(tensor_bytes: Sequence[float], cap_bytes: float) -> int:
    """Buckets a gradient-bucketing scheme like DDP's makes of tensors taken in order.

    Greedy, as ``compute_bucket_assignment_by_size`` in torch's ``reducer.cpp``: a tensor is
    never split, each goes into the open bucket, and the bucket closes as soon as it holds
    ``cap_bytes`` or more. So a tensor larger than the cap fills a bucket alone, and the count
    is at most ceil(total / cap) + (tensors larger than the cap). Pass the tensors in the
    order their gradients become ready (about the reverse of ``model.parameters()``).
    """
    cap = number("cap_bytes", cap_bytes, low=0)
    if cap <= 0:
        raise ValueError(f"cap_bytes={cap_bytes!r} is not allowed: a size in bytes > 0")
    count, open_bytes = 0, 0.0
    for size in tensor_bytes:
        open_bytes += number("tensor_bytes", size, low=0)
        if open_bytes >= cap:
            count, open_bytes = count + 1, 0.0
    return count + (1 if open_bytes > 0 else 0)


def dp_exposed_comm_s(bucket_bytes: Sequence[float], backward_s: float, n_ranks: int,
                      latency_s: float, bandwidth_bytes_per_s: float) -> float:  # fmt: skip
    """Seconds of gradient all-reduce still running after backward ends, when each bucket's
    ring all-reduce starts as soon as the bucket is full (DDP's overlap), in the α–β model.

    ``bucket_bytes``: the buckets in the order they fill (the reverse of the parameters).
    Two assumptions make it a closed form: backward produces gradient bytes at a constant
    rate (its FLOPs are 4N per token, proportional to the parameters of the matmul layers
    behind them), so bucket k is full at ``backward_s`` × (bytes up to and including k) /
    (all bytes); and one all-reduce runs at a time, in the order issued (a process group's
    collectives run in order on one stream or thread), each taking
    :func:`ring_allreduce_time`. Bucket k then ends at max(full_k, end_{k−1}) + T(bucket k)
    and the result is end_last − backward_s.

    Its shape in the bucket size is what a bucket-size sweep measures: one bucket sends
    everything after backward (exposed = T(S) whole); tiny buckets pay the 2(n−1)·α of each
    all-reduce so many times that communication outlasts backward; in between, only about
    the last bucket's time is left exposed (Li et al., "PyTorch Distributed", VLDB 2020,
    section 3.2 and Figure 2: https://arxiv.org/abs/2006.15704). 0 for one rank.
    """
    sizes = [number("bucket_bytes", b, low=0) for b in bucket_bytes]
    backward = number("backward_s", backward_s, low=0)
    n = whole("n_ranks", n_ranks, low=1)
    if not sizes or n == 1:
        return 0.0
    total = sum(sizes)
    end, filled = 0.0, 0.0
    for size in sizes:
        filled += size
        full_at = backward * filled / total if total > 0 else backward
        end = max(full_at, end) + ring_allreduce_time(size, n, latency_s, bandwidth_bytes_per_s)
    return end - backward


def allgather_bytes_per_rank(total_bytes: float, n_ranks: int) -> float:
    """Bytes each rank receives in an all-gather whose *gathered* result is S bytes: (n−1)/n × S."""
    S = number("total_bytes", total_bytes, low=0)
    n = whole("n_ranks", n_ranks, low=1)
    return (n - 1) / n * S


def reduce_scatter_bytes_per_rank(total_bytes: float, n_ranks: int) -> float:
    """Bytes each rank sends in a reduce-scatter of an S-byte input: (n−1)/n × S."""
    S = number("total_bytes", total_bytes, low=0)
    n = whole("n_ranks", n_ranks, low=1)
    return (n - 1) / n * S


# ----------------------------------------------------------------------------------------------
# Can data-parallel communication hide behind the backward pass?


def dp_overlap_ratio(
    tokens_per_rank: float,
    n_ranks: int,
    peak_flops_per_s: float,
    bandwidth_bytes_per_s: float,
    *,
    grad_bytes: float = 2,
) -> float:
    """t_comm / t_compute for data parallelism; ≤ 1 means the all-reduce can hide behind compute.

    Backward compute on one rank: 4·N FLOPs per token (the backward share of 6N), so
    ``t_compute = 4·N·tokens_per_rank / C``. Ring all-reduce of the gradients
    (``grad_bytes``·N bytes): ``t_comm = 2·(n−1)/n · grad_bytes·N / W``. N cancels::

        t_comm / t_compute = (grad_bytes / (2·tokens_per_rank)) · ((n−1)/n) · (C/W)

    With bf16 gradients (grad_bytes = 2) the condition is tokens_per_rank ≥ ((n−1)/n)·C/W: the
    scaling-book's "per-GPU token batch > C/W", about 2,200 tokens in an H100 node
    (990e12 / 450e9; gpus.md, "Data Parallelism").

    ``tokens_per_rank`` is the tokens whose backward the all-reduce can hide behind: all of a
    rank's tokens per step without gradient accumulation, but only the *last micro-batch's*
    under ``no_sync`` accumulation (the earlier ones finish before the all-reduce can start),
    which is :func:`dp_exposed_comm_fraction`'s condition.

    The Playbook (appendix A3) prints the ratio as (N / (2·tokens))·((n−1)/n)·(C/W). That
    expression is not dimensionless (N/tokens is a pure number but C/W is FLOPs per byte); its
    own derivation divides one bucket's all-reduce time by the whole model's backward time.
    Counting all N gradients, N cancels as above. Assumes perfect overlap, peak FLOP/s and peak
    bandwidth; real overlap is worse.
    """
    tokens = positive("tokens_per_rank", tokens_per_rank)
    n = whole("n_ranks", n_ranks, low=1)
    C = positive("peak_flops_per_s", peak_flops_per_s)
    W = positive("bandwidth_bytes_per_s", bandwidth_bytes_per_s)
    gb = positive("grad_bytes", grad_bytes)
    return (gb / (2 * tokens)) * ((n - 1) / n) * (C / W)


def dp_min_tokens_per_rank(
    n_ranks: int,
    peak_flops_per_s: float,
    bandwidth_bytes_per_s: float,
    *,
    grad_bytes: float = 2,
) -> float:
    """Smallest tokens per rank whose backward can hide the gradient all-reduce
    (``dp_overlap_ratio`` ≤ 1): per step without accumulation, per *micro-batch* with it, since
    only the last micro-batch's backward overlaps the all-reduce (:func:`dp_exposed_comm_fraction`).

    ``(grad_bytes/2) · ((n−1)/n) · C/W``; 0 for a single rank (nothing to communicate).
    """
    n = whole("n_ranks", n_ranks, low=1)
    C = positive("peak_flops_per_s", peak_flops_per_s)
    W = positive("bandwidth_bytes_per_s", bandwidth_bytes_per_s)
    gb = positive("grad_bytes", grad_bytes)
    return (gb / 2) * ((n - 1) / n) * (C / W)


def dp_exposed_comm_fraction(
    tokens_per_micro_batch: float,
    grad_accum: int,
    n_ranks: int,
    peak_flops_per_s: float,
    bandwidth_bytes_per_s: float,
    *,
    grad_bytes: float = 2,
) -> float:
    """Share of a data-parallel step spent waiting for the gradient all-reduce, with accumulation.

    Under ``no_sync`` the first ``grad_accum − 1`` micro-batches keep their gradients local;
    the single all-reduce runs during the *last* micro-batch's backward (PyTorch DDP's reducer
    fires its buckets as that backward produces them: Li et al. 2020, arXiv 2006.15704), so it
    can hide only behind that backward. The overlap condition is therefore
    ``dp_overlap_ratio(tokens_per_micro_batch, ...)`` ≤ 1: tokens per *micro-batch*, not per
    step. With r that ratio and t_b the last backward (4·N·tokens/C), the step computes
    ``grad_accum`` forward+backward passes, 1.5·grad_accum·t_b (6N of which 4N backward), and
    waits ``max(0, r − 1)·t_b`` for what the backward could not hide::

        exposed share = max(0, r − 1) / (1.5·grad_accum + max(0, r − 1))

    Accumulation amortises the exposed all-reduce over more compute (the share falls like
    1/grad_accum) but does not hide any more of it: the exposed seconds per step stay
    ``(r − 1)·t_b``. Same assumptions as ``dp_overlap_ratio`` (peak rates, perfect overlap,
    attention FLOPs ignored).
    """
    accum = whole("grad_accum", grad_accum, low=1)
    r = dp_overlap_ratio(
        tokens_per_micro_batch,
        n_ranks,
        peak_flops_per_s,
        bandwidth_bytes_per_s,
        grad_bytes=grad_bytes,
    )
    exposed = max(0.0, r - 1.0)
    return exposed / (1.5 * accum + exposed)
