"""Gradient-boosted trees across workers: what ``tree_method="hist"`` all-reduces each round, and
what its two data matrices hold.

The histogram method (XGBoost's ``hist``, LightGBM's) first quantises every feature into at most
``max_bin`` bins, once. Each round then grows one tree level by level; to choose the splits of a
node it sums the gradient and the hessian of the node's rows into one histogram per feature. With
the rows split over workers, each worker builds histograms of its own rows and the workers
all-reduce (sum) them, so that every worker evaluates the same splits on the whole data set. That
all-reduce is the round's communication: no rows and no model move, only histograms.

What XGBoost 3.2 (CPU, rows split over workers) all-reduces, read from its source
(https://github.com/dmlc/xgboost, tag v3.2.0):

* **one histogram entry** is a ``GradientPairPrecise``, a gradient and a hessian in double
  precision: 2 × 8 = 16 bytes per bin (``src/tree/hist/histogram.h``, ``SyncHistogram``: the
  all-reduce covers ``n_total_bins * nodes_to_build.size() * 2`` doubles);
* **the bins** are every feature's cut points: the distributed sketch keeps
  ``min(distinct values, max_bin)`` per numeric feature (``src/common/quantile.cc``,
  ``MakeCuts`` and ``AddCutPoint``);
* **the nodes per level**: the root's histogram, then, for every node split at a depth whose
  children may still split (``depth + 1 < max_depth``, ``src/tree/driver.h``,
  ``IsChildValid``), the histogram of one child only, the one with the smaller hessian sum; its
  sibling is the parent's minus it, computed locally ("the subtraction trick",
  ``src/tree/hist/histogram.cc``, ``AssignNodes``). A full tree of depth d therefore
  all-reduces 1 + 1 + 2 + … + 2^(d-2) = 2^(d-1) node histograms per round;
* **the wire, on CPUs**: XGBoost's own ring all-reduce over TCP (``src/collective/allreduce.cc``,
  ``RingAllreduce``): a reduce-scatter, in which each of the w workers sends w - 1 segments of
  S/w bytes, then an all-gather (``src/collective/allgather.cc``, ``RingAllgather``) whose loop
  runs w steps, not the textbook's w - 1, so each worker sends the whole message there. On the
  wire that is (w-1)·S + w·S = (2w-1)·S bytes for a message of S bytes, against the textbook
  ring's 2(w-1)·S (NVIDIA/nccl-tests, doc/PERFORMANCE.md). One worker sends nothing. This
  (2w-1) is a property of XGBoost's CPU collective (v3.2), not of ring all-reduce in general.

**On GPUs** (``device="cuda"``) the histograms hold gradients quantised to 64-bit integers
(``GradientPairInt64``, also 16 bytes per bin: ``src/tree/gpu_hist/histogram.cuh``), and the
all-reduce is NCCL's (``src/tree/updater_gpu_hist.cu``, ``ReduceHist`` -> ``AllReduceHist``;
``src/collective/coll.cu``, ``NCCLColl``), whose ring sends the textbook 2(w-1)/w·S per GPU,
2(w-1)·S in all (``ring_wire_bytes(..., xgboost_allgather=False)``); NCCL may also choose a tree
or NVLS algorithm, and its bytes go over NVLink, PCIe or the network, where no socket counter
sees them.

**On the wire of one machine** (``lo``): every TCP segment carries 52 bytes of IPv4 and TCP
headers (20 + 20 + 12 of timestamps) besides its payload, and a segment holds at most the
loopback MSS of payload (65,483 bytes: MTU 65,536 less the headers); the receiver's ACKs are
52-byte segments too, one per data segment at most and often fewer (delayed or carried on data
going the other way). :func:`tcp_header_bytes` counts the data segments' headers.

The matrices on CPUs (``src/data/``): a ``DMatrix`` keeps the rows as compressed sparse rows, an
``Entry`` of a 4-byte feature index and a 4-byte value per stored value plus an 8-byte offset
per row (``SparsePage``), and ``hist`` builds its quantised copy, the ``GHistIndexMatrix``, from
it the first time it trains. A ``QuantileDMatrix`` builds the quantised copy straight from the
input and never stores the values. The CPU's quantised copy holds one bin index per value (1
byte when every feature has at most 256 bins and the data are dense, 2 bytes up to 65,536,
``gradient_index.cc``, ``ResizeIndex``), the same again in the column layout ``hist`` partitions
rows with (``ColumnMatrix``), and an 8-byte row offset per row. **On GPUs** the quantised copy is
one ELLPACK page in device memory, each bin index packed into the fewest bits that hold the
largest bin count of a feature (dense data: ``src/data/ellpack_page.cu``, ``CalcNumSymbols``;
``src/common/compressed_iterator.h``, ``SymbolBits``), one layout only
(:func:`ellpack_bytes`; ``doc/gpu/index.rst``, "Memory usage").
"""

from __future__ import annotations

import math

from labkit.validate import number, positive, whole

GRADIENT_PAIR_BYTES = 16
"""One histogram bin: gradient and hessian, each a float64 (``GradientPairPrecise``)."""
CSR_ENTRY_BYTES = 8
"""One stored value of a DMatrix: a uint32 feature index and a float32 value (``Entry``)."""
ROW_OFFSET_BYTES = 8
"""One row's offset into the entries (``std::size_t``), in both matrices."""
TCP_HEADER_BYTES = 52
"""IPv4 (20) and TCP (20, and 12 of the timestamp option Linux sends) headers of one segment,
as ``lo``'s byte counter sees it (it counts no link-layer header)."""
LOOPBACK_MSS = 65_483
"""The most payload one TCP segment carries on ``lo`` (MTU 65,536)."""


def bins_per_feature(max_bin: int, distinct: int | None = None) -> int:
    """Bins the distributed sketch keeps for one numeric feature: ``min(distinct, max_bin)``
    (``distinct`` None: a continuous feature with more distinct values than ``max_bin``)."""
    whole("max_bin", max_bin, low=2)
    if distinct is None:
        return max_bin
    whole("distinct", distinct, low=1)
    return min(distinct, max_bin)


def hist_nodes_per_level(max_depth: int, splits_per_level: list[int] | None = None) -> list[int]:
    """Node histograms all-reduced at each depth of one tree: ``[1, s0, s1, …]`` up to depth
    ``max_depth - 1``, where ``s_l`` is the number of nodes split at depth ``l`` (one child each,
    the subtraction trick gives the other). ``splits_per_level`` None: a full tree, ``s_l = 2^l``.

    >>> hist_nodes_per_level(4)
    [1, 1, 2, 4]
    """
    whole("max_depth", max_depth, low=1)
    if splits_per_level is None:
        splits_per_level = [2**level for level in range(max_depth)]
    return [1] + [int(splits_per_level[level]) if level < len(splits_per_level) else 0
                  for level in range(max_depth - 1)]  # fmt: skip


def hist_allreduce_bytes(total_bins: int, nodes_per_level: list[int],
                         bytes_per_value: int = 8) -> list[int]:
    """The message each worker puts into the all-reduce at each depth of one round:
    bins × (gradient + hessian) × bytes per value × nodes at that depth."""
    whole("total_bins", total_bins, low=1)
    whole("bytes_per_value", bytes_per_value, low=1)
    return [total_bins * 2 * bytes_per_value * int(n) for n in nodes_per_level]


def ring_wire_bytes(message_bytes: float, workers: int, *, xgboost_allgather: bool = True) -> float:
    """Bytes all workers together put on the wire for one ring all-reduce of ``message_bytes``:
    ``(2w-1)·S`` as XGBoost's CPU ring runs it (its all-gather sends w segments per worker), or
    the textbook ``2(w-1)·S`` with ``xgboost_allgather=False`` (NCCL's ring, the GPU path);
    0 for one worker."""
    whole("workers", workers, low=1)
    number("message_bytes", message_bytes, low=0)
    if workers == 1:
        return 0.0
    factor = 2 * workers - 1 if xgboost_allgather else 2 * (workers - 1)
    return factor * float(message_bytes)


def ring_sends(workers: int) -> int:
    """Sends of about S/w bytes that all workers together make in one XGBoost CPU ring
    all-reduce: w - 1 each in the reduce-scatter, w each in the all-gather, w(2w-1) in all."""
    whole("workers", workers, low=1)
    return 0 if workers == 1 else workers * (2 * workers - 1)


def tcp_header_bytes(message_bytes: float, workers: int, *, header: int = TCP_HEADER_BYTES,
                     mss: int = LOOPBACK_MSS) -> int:
    """Header bytes of the data segments one XGBoost CPU ring all-reduce of ``message_bytes``
    puts on ``lo``: each of its :func:`ring_sends` of S/w bytes is ``ceil(S/w / mss)`` segments
    of ``header`` bytes each. ACKs are not in it (0 to one per data segment)."""
    number("message_bytes", message_bytes, low=0)
    if not message_bytes or workers == 1:
        return 0
    segment = -(-int(message_bytes) // workers)  # ceil: the last segment takes the remainder
    return ring_sends(workers) * -(-segment // mss) * header


def hist_round_wire_bytes(features: int, max_bin: int, max_depth: int, workers: int, *,
                          distinct: int | None = None,
                          splits_per_level: list[int] | None = None) -> float:
    """All bytes one boosting round puts on the wire: each depth's histogram all-reduce
    (:func:`hist_allreduce_bytes`) through XGBoost's ring (:func:`ring_wire_bytes`), summed.
    Payload only: packet headers and the few small all-reduces of a round (the root's gradient
    sum, 16 bytes) are not in it."""
    whole("features", features, low=1)
    total_bins = features * bins_per_feature(max_bin, distinct)
    levels = hist_allreduce_bytes(total_bins, hist_nodes_per_level(max_depth, splits_per_level))
    return sum(ring_wire_bytes(s, workers) for s in levels if s)


def ellpack_bytes(rows: int, features: int, max_bins_per_feature: int) -> int:
    """The GPU's quantised copy of dense data (one ELLPACK page): ``rows × features`` symbols of
    ``ceil(log2(bins))`` bits each, rounded up to whole 4-byte words after 8 bytes of padding
    (``CompressedBufferWriter::CalculateBufferSize``). No second layout, no row offsets."""
    whole("rows", rows, low=1)
    whole("features", features, low=1)
    whole("max_bins_per_feature", max_bins_per_feature, low=1)
    bits = max(1, math.ceil(math.log2(max_bins_per_feature)))
    packed = math.ceil(bits * rows * features / 8)
    return max(math.ceil((packed + 8) / 4) * 4, 9)


def dmatrix_bytes(rows: int, features: int, density: float = 1.0) -> int:
    """A DMatrix's compressed sparse rows: 8 bytes per stored value, 8 per row offset."""
    whole("rows", rows, low=1)
    whole("features", features, low=1)
    number("density", density, low=0, high=1)
    positive("density", density)
    return int(rows * features * density) * CSR_ENTRY_BYTES + (rows + 1) * ROW_OFFSET_BYTES


def bin_index_bytes(max_bins_per_feature: int) -> int:
    """Bytes of one bin index in a dense quantised matrix: 1, 2 or 4 (``ResizeIndex``)."""
    whole("max_bins_per_feature", max_bins_per_feature, low=1)
    if max_bins_per_feature <= 2**8:
        return 1
    return 2 if max_bins_per_feature <= 2**16 else 4


def quantised_bytes(rows: int, features: int, max_bins_per_feature: int) -> int:
    """The quantised copy the CPU's ``hist`` trains on (dense data): a bin index per value in the row
    layout and again in the column layout, and an 8-byte offset per row. What a
    QuantileDMatrix holds; a DMatrix holds it on top of :func:`dmatrix_bytes` once it trained."""
    whole("rows", rows, low=1)
    whole("features", features, low=1)
    index = rows * features * bin_index_bytes(max_bins_per_feature)
    return 2 * index + (rows + 1) * ROW_OFFSET_BYTES
