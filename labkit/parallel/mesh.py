"""Device meshes: ranks laid out in a named grid, one process group per row of each dimension.

``torch.distributed.device_mesh.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))``
arranges ranks 0..3 in a 2 × 2 grid, row-major (the last dimension varies fastest):

             tp=0  tp=1
    dp=0  [   0,    1  ]
    dp=1  [   2,    3  ]

and creates one process group per row and per column: along "tp" the groups are {0, 1} and
{2, 3}, along "dp" {0, 2} and {1, 3}. A strategy takes its group from a named dimension
(``mesh["tp"]``), so tensor parallelism all-reduces within a row while data parallelism
reduces gradients within a column. The innermost dimension holds neighbouring ranks, which a
launcher places on one node: that is where the most frequent, latency-bound traffic (TP's
activation all-reduces, several per layer) belongs, on NVLink rather than the network
(Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", section 3.3; torchtitan's ``ParallelDims`` puts "tp" last for the same reason).

Everything but ``build`` and ``MeshSpy`` is pure: a spec is validated, and each rank's groups
worked out, before any process group exists. ``MeshSpy`` counts, inside a job, the bytes each
collective carries, filed under the mesh dimension whose process group carried it.

    spec = validate_mesh({"dp": 2, "tp": 2}, world_size=4, model_cfg=cfg)
    group_ranks(spec, "dp", 3)          # [1, 3]
    all_groups(spec, "tp")              # [[0, 1], [2, 3]]
    mesh = build(spec, "cpu")           # init_device_mesh, inside a worker
    predict_comm(cfg, spec, "fsdp_tp", micro_batch=4)   # bytes per rank per step, per dim

Counting conventions are those of ``labkit.parallel.comm`` (NCCL-tests' message size S) and
``labkit.parallel.tensor`` (4 activation all-reduces per layer per micro-batch).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as tdist
from torch.utils._python_dispatch import TorchDispatchMode

from labkit.config import ModelConfig
from labkit.parallel import comm
from labkit.validate import whole

COMPOSITIONS = ("fsdp_tp", "hsdp")


@dataclass(frozen=True)
class MeshSpec:
    """Named mesh dimensions and their sizes, outermost first (row-major, as torch lays them).

    Attributes:
        dims: ((name, size), ...), e.g. (("dp", 2), ("tp", 2)).
    """

    dims: tuple[tuple[str, int], ...]

    def __post_init__(self) -> None:
        if not self.dims:
            raise ValueError("mesh has no dimensions: give at least one, e.g. {'dp': 4}")
        names = []
        for item in self.dims:
            if not (isinstance(item, tuple) and len(item) == 2):
                raise ValueError(f"mesh dimension {item!r}: need a (name, size) pair")
            name, size = item
            if not isinstance(name, str) or not name.strip():
                raise ValueError(
                    f"mesh dimension name {name!r}: need a non-empty string such as 'dp' or 'tp'"
                )
            whole("size", size, low=1, why=f"of mesh dimension {name!r}")
            names.append(name)
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(
                f"mesh dimension name(s) {dup} appear more than once: every dimension needs its "
                "own name, since strategies look their process group up by it"
            )

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.dims)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(s for _, s in self.dims)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def __getitem__(self, name: str) -> int:
        for n, s in self.dims:
            if n == name:
                return s
        raise ValueError(f"mesh has no dimension {name!r}: its dimensions are {list(self.names)}")

    def as_dict(self) -> dict[str, int]:
        return dict(self.dims)

    def __str__(self) -> str:
        return " × ".join(f"{n}={s}" for n, s in self.dims)

    def describe(self) -> str:
        """Each rank's group along every dimension (``group_ranks``), one row per rank, then
        every group of each dimension (``all_groups``): the layout predicted before any
        process group exists."""
        lines = [f"mesh {self}: each rank's groups, predicted by group_ranks (row-major layout)",
                 f"{'rank':>6}" + "".join(f"{n + ' group':>12}" for n in self.names)]  # fmt: skip
        for r in range(self.size):
            lines.append(f"{r:>6}" + "".join(f"{group_ranks(self, n, r)!s:>12}" for n in self.names))
        lines.append("all groups " + ", ".join(f"along {n!r}: {all_groups(self, n)}"
                                               for n in self.names))  # fmt: skip
        return "\n".join(lines)


MeshLike = MeshSpec | Mapping[str, int] | Sequence[tuple[str, int]]


def as_spec(spec: MeshLike) -> MeshSpec:
    """A ``MeshSpec`` from a spec, a dict {name: size} (insertion order = outermost first) or
    a list of (name, size) pairs (JSON gives lists: [["dp", 2], ["tp", 2]])."""
    if isinstance(spec, MeshSpec):
        return spec
    if isinstance(spec, Mapping):
        return MeshSpec(tuple(spec.items()))
    if isinstance(spec, Sequence) and not isinstance(spec, str):
        return MeshSpec(tuple(tuple(d) if isinstance(d, list) else d for d in spec))
    raise ValueError(f"mesh={spec!r}: give a dict of named dimensions such as {{'dp': 2, 'tp': 2}}")


def validate_mesh(
    spec: MeshLike,
    world_size: int,
    *,
    model_cfg: ModelConfig | None = None,
    tp_dim: str = "tp",
) -> MeshSpec:
    """Check a mesh before any process group exists; return it as a ``MeshSpec``.

    Raises ValueError naming the constraint and the fix when the sizes do not multiply to
    ``world_size`` (every rank must sit in exactly one cell), or, given ``model_cfg``, when
    the ``tp_dim`` size does not divide the heads (attention splits by whole heads).
    """
    s = as_spec(spec)
    world_size = whole("world_size", world_size, low=1, why="ranks started")
    if s.size != world_size:
        raise ValueError(
            f"mesh {s} has {' × '.join(map(str, s.shape))} = {s.size} cells but the job has "
            f"world_size={world_size} ranks: the sizes must multiply to the world size, one "
            f"rank per cell; change a size or launch {s.size} ranks"
        )
    if model_cfg is not None and tp_dim in s.names:
        from labkit.parallel.tensor import validate_tensor_parallel

        try:
            validate_tensor_parallel(model_cfg, s[tp_dim])
        except ValueError as e:
            raise ValueError(f"mesh dimension {tp_dim!r}: {e}") from None
    return s


def _coords(shape: tuple[int, ...], rank: int) -> list[int]:
    """Row-major coordinates of ``rank`` in a grid of ``shape`` (last dimension fastest)."""
    out = []
    for size in reversed(shape):
        out.append(rank % size)
        rank //= size
    return out[::-1]


def group_ranks(spec: MeshLike, dim: str, rank: int) -> list[int]:
    """The ranks in ``rank``'s process group along ``dim``, in ``init_device_mesh``'s layout.

    Row-major: rank = Σ coordinate_i × stride_i with stride_i the product of the sizes after
    dimension i. The group holds the ranks that share every coordinate but ``dim``'s.
    """
    s = as_spec(spec)
    rank = whole("rank", rank, low=0, high=s.size - 1, why=f"a rank of mesh {s}")
    i = s.names.index(dim) if dim in s.names else None
    if i is None:
        raise ValueError(f"mesh has no dimension {dim!r}: its dimensions are {list(s.names)}")
    stride = math.prod(s.shape[i + 1 :])
    base = rank - _coords(s.shape, rank)[i] * stride
    return [base + c * stride for c in range(s.shape[i])]


def all_groups(spec: MeshLike, dim: str) -> list[list[int]]:
    """Every process group along ``dim``, each sorted, in order of its lowest rank."""
    s = as_spec(spec)
    groups = {tuple(group_ranks(s, dim, r)) for r in range(s.size)}
    return [list(g) for g in sorted(groups)]


def describe_refusals(
    cases: Sequence[tuple[MeshLike, ModelConfig | None]], world_size: int, *, tp_dim: str = "tp"
) -> str:
    """``validate_mesh`` tried on each (mesh, model) of ``cases``: the message each refusal
    gives, or that the mesh was accepted."""
    lines = ["Meshes refused before anything starts:"]
    for spec, model_cfg in cases:
        try:
            validate_mesh(spec, world_size, model_cfg=model_cfg, tp_dim=tp_dim)
        except ValueError as e:
            lines.append(f"  {spec}: {e}")
        else:
            lines.append(f"  {spec}: accepted (a mesh of {world_size} cells)")
    return "\n".join(lines)


def describe_link_times(comm_: dict[str, dict[str, Any]], links: Sequence[Any]) -> str:
    """An "fsdp_tp" ``predict_comm`` result's bytes per rank on "tp" and "dp", and the time
    each takes on each link (``hardware.link_bandwidth``'s: bytes over the published
    bandwidth, no latency, no overlap: modelled), with the links' sources."""
    lines = ["bytes sent per GPU per micro-batch (predicted), and the time on each link (modelled):"]
    for dim, what in (("tp", "TP all-reduces"), ("dp", "FSDP gathers + reduce-scatter")):
        sent = comm_[dim]["sent_per_rank"]
        times = ", ".join(f"{sent / link.bytes_per_s * 1e3:,.0f} ms on {link.name}" for link in links)
        lines.append(f"  {what:<30} {sent / 1e9:6.2f} GB: {times}")
    lines.append(f"TP's {comm_['tp']['calls']['all_reduce']} all-reduces sit on the critical path, "
                 "FSDP's gathers overlap computation: section 1's reason for TP on the innermost "
                 "dimension.")  # fmt: skip
    lines.append("Bandwidths (per GPU, each way): "
                 + "; ".join(f"{link.name}: {link.source}" for link in links))  # fmt: skip
    return "\n".join(lines)


def build(spec: MeshLike, device_type: str) -> Any:
    """``init_device_mesh(device_type, shape, mesh_dim_names=names)``: one process group per
    row of every dimension. Call inside a job (a default process group must exist)."""
    from torch.distributed.device_mesh import init_device_mesh

    s = as_spec(spec)
    return init_device_mesh(device_type, s.shape, mesh_dim_names=s.names)


# --- predictions: bytes per rank per step on each dimension, and memory per rank ---------------


def _block_params_per_tp_rank(cfg: ModelConfig, tp: int) -> int:
    """One block's parameters on a TP rank (``tensor.apply_dtensor_parallel``'s split):
    12h² + 7h split over tp, 6h (two LayerNorms, two row-parallel biases) replicated."""
    h = cfg.d_model
    return (12 * h * h + 7 * h) // tp + 6 * h


def _root_params(cfg: ModelConfig) -> int:
    """Parameters outside the blocks (the FSDP root unit): wte, wpe, ln_f, an untied head."""
    h, V = cfg.d_model, cfg.vocab_size
    return V * h + cfg.seq_len * h + 2 * h + (0 if cfg.tie_weights else V * h)


def predict_comm(
    cfg: ModelConfig,
    spec: MeshLike,
    composition: str,
    micro_batch: int,
    *,
    bytes_per_element: int = 4,
    reshard_after_forward: bool = True,
) -> dict[str, dict[str, Any]]:
    """Bytes each rank sends per training step on each mesh dimension (formula).

    Not in :mod:`labkit.formulas`: it counts the parameters as this package's plans shard them
    (the TP plan's per-rank blocks), so it lives beside those plans.

    ``composition``:

    * "fsdp_tp" on a ("dp", "tp") mesh: "tp" carries TP's 4·L activation all-reduces of
      (b, s, h) per step (b = ``micro_batch``, the rows this rank's TP group computes); "dp"
      carries FSDP2's all-gathers of each rank's TP-local parameters (the root once, every
      block twice with ``reshard_after_forward``: forward and backward) and one
      reduce-scatter of the TP-local gradients.
    * "hsdp" on a ("replicate", "shard") mesh: "shard" carries FSDP2's all-gathers and
      reduce-scatter of the whole model; "replicate" one all-reduce of this rank's gradient
      shard (P / shard elements).

    Message sizes S follow NCCL-tests (``comm``); sent per rank is the ring formula of each
    collective over that dimension's size. Returns {dim: {"size": n, "message_bytes":
    {kind: S}, "calls": {kind: count}, "sent_per_rank": bytes}}.
    """
    s = as_spec(spec)
    if composition not in COMPOSITIONS:
        raise ValueError(f"composition={composition!r}: use one of {COMPOSITIONS}")
    e, L = bytes_per_element, cfg.n_layer
    gathers = 2 if reshard_after_forward else 1
    out: dict[str, dict[str, Any]] = {}
    if composition == "fsdp_tp":
        tp = s["tp"]
        block, root = _block_params_per_tp_rank(cfg, tp), _root_params(cfg)
        act = micro_batch * cfg.seq_len * cfg.d_model * e
        out["tp"] = {
            "message_bytes": {"all_reduce": 4 * L * act},
            "calls": {"all_reduce": 4 * L},
        }
        out["dp"] = {
            "message_bytes": {
                "all_gather": e * (root + gathers * L * block),
                "reduce_scatter": e * (root + L * block),
            },
            "calls": {"all_gather": 1 + gathers * L, "reduce_scatter": 1 + L},
        }
    else:
        shard = s["shard"]
        block = _block_params_per_tp_rank(cfg, 1)
        root = _root_params(cfg)
        total = root + L * block
        out["shard"] = {
            "message_bytes": {
                "all_gather": e * (root + gathers * L * block),
                "reduce_scatter": e * total,
            },
            "calls": {"all_gather": 1 + gathers * L, "reduce_scatter": 1 + L},
        }
        # Each unit's gradient shard is all-reduced across replicas after its reduce-scatter.
        out["replicate"] = {
            "message_bytes": {"all_reduce": e * total // shard},
            "calls": {"all_reduce": 1 + L},
        }
    for dim, d in out.items():
        d["size"] = s[dim]
        d["sent_per_rank"] = sum(
            comm.sent_per_rank(k, v, s[dim]) for k, v in d["message_bytes"].items()
        )
    return out


def predict_memory(
    cfg: ModelConfig, spec: MeshLike, composition: str, *, optimizer_bytes: int = 8
) -> dict[str, float]:
    """Bytes of parameters, gradients and optimizer state one rank holds (fp32; AdamW's m and
    v: ``optimizer_bytes`` = 8 per parameter), all sharded alike.

    Not in :mod:`labkit.formulas`: it counts the parameters as this package's TP plan shards
    them (``tensor.tp_params_per_rank``).

    fsdp_tp: the TP-local parameters (``tensor.tp_params_per_rank``) divided over "dp";
    hsdp: the whole model divided over "shard" (replicas each hold a full copy of the shards).
    """
    from labkit.parallel.tensor import tp_params_per_rank

    s = as_spec(spec)
    if composition == "fsdp_tp":
        local = tp_params_per_rank(cfg, s["tp"]) / s["dp"]
    elif composition == "hsdp":
        local = tp_params_per_rank(cfg, 1) / s["shard"]
    else:
        raise ValueError(f"composition={composition!r}: use one of {COMPOSITIONS}")
    return {
        "parameters": 4 * local,
        "gradients": 4 * local,
        "optimizer_state": optimizer_bytes * local,
        "total": (8 + optimizer_bytes) * local,
    }


# --- counting bytes per mesh dimension --------------------------------------------------------

# op name -> (kind, how S is found): c10d ops (FSDP2's, torch.distributed's) carry tensors and a
# ProcessGroup object; _c10d_functional ops (DTensor's) a tensor and the group's name.
# The (kind, S argument) of each c10d op is comm.C10D_OPS's; MeshSpy counts the one-tensor
# collectives a mesh's strategies issue, and leaves the rest (a broadcast) in ``unknown``.
_C10D = {
    name: comm.C10D_OPS[name]
    for name in ("allreduce_", "_allgather_base_", "allgather_into_tensor_coalesced_",
                 "_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_")
}  # fmt: skip
# Functional op names (DTensor's), a table of their own: a functional op carries one tensor and
# the group's name, and an all-gather's S is its input times the group size (args[1]).
_FUNCTIONAL = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather",
               "reduce_scatter_tensor": "reduce_scatter"}  # fmt: skip


class MeshSpy(TorchDispatchMode):
    """Message bytes (NCCL-tests S) and calls of every collective, by mesh dimension.

    Each collective names its process group: a c10d op carries the ProcessGroup, a functional
    op (DTensor's) the group's name; ``dims`` maps group names to mesh dimensions.
    """

    def __init__(self, dims: dict[str, str]) -> None:
        super().__init__()
        self.dims = dims
        self.counts: dict[str, dict[str, dict[str, int]]] = {}
        self.unknown: list[str] = []

    def _add(self, group_name: str, kind: str, nbytes: int) -> None:
        dim = self.dims.get(group_name, f"group {group_name}")
        entry = self.counts.setdefault(dim, {}).setdefault(kind, {"calls": 0, "message_bytes": 0})
        entry["calls"] += 1
        entry["message_bytes"] += int(nbytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._opname
        if func.namespace == "c10d" and name in _C10D:
            kind, i = _C10D[name]
            pg = next(a for a in args if isinstance(a, torch.ScriptObject))
            group = tdist.ProcessGroup.unbox(pg).group_name
            self._add(group, kind, comm.tensor_bytes(args[i]))
        elif func.namespace == "_c10d_functional" and name in _FUNCTIONAL:
            kind = _FUNCTIONAL[name]
            t, group = args[0], args[-1]
            scale = args[1] if kind == "all_gather" else 1  # S is the gathered result
            self._add(group, kind, comm.nbytes(t) * scale)
        elif func.namespace in ("c10d", "_c10d_functional") and name not in (
            "wait_tensor",
            "_wrap_tensor_autograd",
            "barrier",
        ):
            self.unknown.append(f"{func.namespace}.{name}")
        return func(*args, **(kwargs or {}))

    def summary(self, sizes: dict[str, int]) -> dict[str, dict[str, Any]]:
        """{dim: {"message_bytes": {kind: S}, "calls": {kind: n}, "sent_per_rank": bytes}}."""
        out = {}
        for dim, kinds in self.counts.items():
            n = sizes.get(dim, 1)
            out[dim] = {
                "message_bytes": {k: v["message_bytes"] for k, v in kinds.items()},
                "calls": {k: v["calls"] for k, v in kinds.items()},
                "sent_per_rank": sum(
                    comm.sent_per_rank(k, v["message_bytes"], n) for k, v in kinds.items()
                ),
            }
        return out
