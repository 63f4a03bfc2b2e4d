"""Notebook 03b's reading of the mesh job in the kernel: the prediction, then what the job's
ranks measured held against it, each a frozen result with ``describe()``.

Apart from :mod:`labkit.workers.mesh_train`, which every rank of the job runs: this module
runs in the notebook's kernel, on the ``JobResult`` those ranks returned. The sentences are
chosen by the measurements (``labkit.verdict`` where two measured samples are compared), never
written in advance. Notebook 03b (``from labkit import workers``) writes::

    pred = workers.mesh_report.predict(model_dict, {"fsdp_tp": tp_mesh, "hsdp": hsdp_mesh}, batch_size)
    job = workers.mesh_train.run(workers.mesh_train.MeshTrainConfig(...), nproc=4)
    groups = workers.mesh_report.check_groups(job, {"fsdp_tp": tp_mesh, "hsdp": hsdp_mesh})
    counted = workers.mesh_report.check_bytes(job, pred)
    parity = workers.mesh_report.check_parity(job)
    memory = workers.mesh_report.check_memory(job, pred)
    print(workers.mesh_report.reconcile(groups, counted, memory, parity).describe())
    print(workers.mesh_report.compare_steps(job).describe())
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from labkit import verdict
from labkit.config import ModelConfig
from labkit.jobs.launch import JobResult
from labkit.parallel import mesh

MIB = 2**20
PARTS = ("fsdp_tp", "hsdp")
STATE_KEYS = ("parameters", "gradients", "optimizer_state")


def _data_degree(spec: mesh.MeshLike, part: str) -> int:
    """The data-parallel degree of ``part`` on ``spec``: how many shards the batch is cut in."""
    from labkit.workers.mesh_train import data_index  # here: the worker imports torch

    return data_index(spec, part, 0)[1]


def _count_params(model: Mapping[str, Any]) -> int:
    from labkit.model import GPT

    return sum(p.numel() for p in GPT(ModelConfig(**model)).parameters())


# --- before the job: the prediction ------------------------------------------------------------


@dataclass(frozen=True)
class MeshPrediction:
    """``mesh.predict_comm`` and ``mesh.predict_memory`` for each composition, at the rows each
    data shard computes (the global batch over the data-parallel degree), and the learner's
    guess of each composition's share of one process's model state."""

    model: dict[str, Any]
    """ModelConfig fields, as the job's config takes them."""
    batch_size: int
    rows: dict[str, int]
    """{part: rows per data shard}."""
    comm: dict[str, dict[str, dict[str, Any]]]
    """{part: predict_comm's result}."""
    memory: dict[str, dict[str, float]]
    """{part: predict_memory's result}."""
    n_params: int
    guess: dict[str, float | None] = field(default_factory=dict)

    @property
    def single_bytes(self) -> int:
        """fp32 parameters + gradients + AdamW state of one process: 16 bytes a parameter."""
        return 16 * self.n_params

    def share(self, part: str) -> float:
        """``part``'s predicted model state per rank as a share of one process's."""
        return self.memory[part]["total"] * 2**-20 / (self.single_bytes / MIB)

    def describe(self) -> str:
        lines = [f"GPT {self.model}: {self.n_params:,} parameters; one process holds "
                 f"{self.single_bytes / MIB:.2f} MiB of parameters + gradients + AdamW state (fp32)"]  # fmt: skip
        for part, comm_ in self.comm.items():
            lines += ["", f"{part} (global batch {self.batch_size}, {self.rows[part]} rows per data "
                          "shard), predicted per step:"]  # fmt: skip
            for dim, d in comm_.items():
                kinds = ", ".join(f"{d['calls'][k]} {k} of {d['message_bytes'][k] / MIB:.2f} MiB in all"
                                  for k in d["calls"])  # fmt: skip
                lines.append(f"  {dim:>9} (n={d['size']}): {kinds}; sent per rank "
                             f"{d['sent_per_rank'] / MIB:.2f} MiB")  # fmt: skip
            lines.append(f"  memory per rank predicted: {self.memory[part]['total'] / MIB:.2f} MiB "
                         f"({self.share(part):.0%} of one process's)")  # fmt: skip
        for part, guess in self.guess.items():
            if guess is not None:
                got = self.share(part)
                lines.append(f"your prediction for {part}: {guess:.0%} of one process's state; the "
                             f"formula says {got:.0%}" + (" (agrees)" if abs(guess - got) < 0.05 else ""))  # fmt: skip
        return "\n".join(lines)


def predict(
    model: Mapping[str, Any],
    layouts: Mapping[str, mesh.MeshLike],
    batch_size: int,
    *,
    guess: Mapping[str, float | None] | None = None,
) -> MeshPrediction:
    """The :class:`MeshPrediction` for the GPT of ``model`` (ModelConfig fields) on
    ``layouts`` ({part: mesh}) at a global batch of ``batch_size`` rows; ``guess``: {part: the
    learner's share of one process's state, or None}."""
    cfg = ModelConfig(**model)
    rows = {part: batch_size // _data_degree(spec, part) for part, spec in layouts.items()}
    return MeshPrediction(
        model=dict(model), batch_size=batch_size, rows=rows,
        comm={p: mesh.predict_comm(cfg, spec, p, rows[p]) for p, spec in layouts.items()},
        memory={p: mesh.predict_memory(cfg, spec, p) for p, spec in layouts.items()},
        n_params=_count_params(model), guess=dict(guess or {}),
    )  # fmt: skip


# --- after the job: groups and bytes -----------------------------------------------------------


@dataclass(frozen=True)
class GroupCheck:
    """Each rank's groups read from torch's DeviceMesh, against ``mesh.group_ranks``."""

    rows: tuple[tuple[int, str, str, list[int], list[int]], ...]
    """(rank, part, dim, measured group, predicted group), every rank."""
    shown: tuple[int, ...]
    """The ranks whose rows ``describe`` prints (the first and the last)."""

    @property
    def agree(self) -> bool:
        return all(got == want for _, _, _, got, want in self.rows)

    def describe(self) -> str:
        lines = ["groups read from torch's DeviceMesh (measured) against group_ranks (predicted):"]
        for r, part, dim, got, want in self.rows:
            if r in self.shown:
                lines.append(f"  rank {r} {part:>7} {dim:>9}: {got} "
                             f"({'as predicted' if got == want else 'PREDICTED ' + str(want)})")  # fmt: skip
        lines.append("every rank's groups agree with the prediction" if self.agree
                     else "SOME GROUPS DIFFER")  # fmt: skip
        return "\n".join(lines)


def check_groups(job: JobResult, layouts: Mapping[str, mesh.MeshLike]) -> GroupCheck:
    """The groups each rank of ``job`` read (its "groups" part) against ``layouts``."""
    rows = []
    for r in range(job.world_size):
        got = job.rank(r)["groups"]
        for part, spec in layouts.items():
            for dim in mesh.as_spec(spec).names:
                rows.append((r, part, dim, got[part][dim], mesh.group_ranks(spec, dim, r)))
    return GroupCheck(rows=tuple(rows), shown=(0, job.world_size - 1))


@dataclass(frozen=True)
class BytesCheck:
    """Rank 0's collectives of the first step, filed per mesh dimension by ``mesh.MeshSpy``,
    against ``mesh.predict_comm``."""

    rows: tuple[tuple[str, str, int, int, int, float], ...]
    """(part, dim, calls counted, message bytes counted, predicted, sent per rank counted)."""
    unknown: dict[str, list[str]]
    """{part: collectives the spy could not file}."""
    exact: bool
    """Every dimension's calls and message bytes, kind by kind, equal the prediction."""

    def describe(self) -> str:
        lines = ["bytes per step on each dimension, rank 0 (counted in the first step, against "
                 "predicted):",
                 f"{'':>8}{'dim':>10}{'calls':>8}{'counted MiB':>13}{'predicted MiB':>15}"
                 f"{'sent/rank MiB':>15}"]  # fmt: skip
        parts = list(dict.fromkeys(row[0] for row in self.rows))
        for part in parts:
            for p, dim, calls, counted, want, sent in self.rows:
                if p == part:
                    lines.append(f"{part:>8}{dim:>10}{calls:>8}{counted / MIB:>13.3f}"
                                 f"{want / MIB:>15.3f}{sent / MIB:>15.3f}")  # fmt: skip
            if self.unknown.get(part):
                lines.append(f"  collectives the spy could not file: {self.unknown[part]}")
        lines.append("counted == predicted, call for call and byte for byte" if self.exact
                     else "counted and predicted DIFFER: see the rows above")  # fmt: skip
        return "\n".join(lines)


def check_bytes(job: JobResult, pred: MeshPrediction) -> BytesCheck:
    """Rank 0's counted bytes on every dimension ``pred`` predicts, part by part."""
    rows, unknown, exact = [], {}, True
    for part, comm_ in pred.comm.items():
        res = job.rank(0)[part]
        for dim, want in comm_.items():
            got = res["bytes"].get(dim, {"message_bytes": {}, "calls": {}, "sent_per_rank": 0})
            exact &= got["message_bytes"] == want["message_bytes"] and got["calls"] == want["calls"]
            rows.append((part, dim, sum(got["calls"].values()), sum(got["message_bytes"].values()),
                         sum(want["message_bytes"].values()), got["sent_per_rank"]))  # fmt: skip
        unknown[part] = list(res["bytes_unknown_ops"])
    return BytesCheck(rows=tuple(rows), unknown=unknown, exact=exact)


# --- after the job: parity and memory ----------------------------------------------------------


@dataclass(frozen=True)
class Parity:
    """Each composition against one process trained on the same batches: the largest
    difference of the losses, of the first step's gradients, and of the final parameters."""

    reference_losses: list[float]
    losses: dict[str, list[float]]
    errors: dict[str, dict[str, float]]
    """{part: {"loss", "grad", "param": max |difference|}}."""
    steps: int

    @property
    def ok(self) -> bool:
        return all(e["loss"] < 1e-4 and e["grad"] < 1e-5 and e["param"] < 1e-3
                   for e in self.errors.values())  # fmt: skip

    def describe(self) -> str:
        lines = [f"single process: losses {[round(v, 4) for v in self.reference_losses]}"]
        for part, e in self.errors.items():
            lines.append(f"{part:>14}: losses {[round(v, 4) for v in self.losses[part]]}; max "
                         f"|difference| from one process (measured): loss {e['loss']:.1e}, "
                         f"first-step gradient {e['grad']:.1e}, parameters after {self.steps} "
                         f"AdamW steps {e['param']:.1e}")  # fmt: skip
        lines.append("both compositions train the same model as one process (differences at fp32 "
                     "rounding: the collectives add in another order)" if self.ok
                     else "PARITY FAILED: a composition trains another model")  # fmt: skip
        return "\n".join(lines)


def reference_run(config: Any) -> tuple[list[float], dict[str, Any], dict[str, Any]]:
    """One process trains the job's GPT on the job's batches (``config``: a MeshTrainConfig):
    (losses, the first step's gradients, the final parameters)."""
    import torch

    from labkit import data
    from labkit.model import GPT
    from labkit.train import make_optimizer

    cfg, tcfg = config.model, config.train_config()
    threads = torch.get_num_threads()
    # One thread, as each rank had: on a busy machine two spinning threads of this small model
    # run slower than one.
    torch.set_num_threads(1)
    try:
        torch.manual_seed(tcfg.seed)
        model = GPT(cfg)
        opt = make_optimizer(model, tcfg)
        losses, grads = [], {}
        for x, y in data.fixed_batches(cfg.seq_len, tcfg.micro_batch, tcfg.steps, tcfg.seed):
            _, loss = model(x, y)
            loss.backward()
            grads = grads or {n: p.grad.clone() for n, p in model.named_parameters()}
            if tcfg.grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), tcfg.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
    finally:
        torch.set_num_threads(threads)
    return losses, grads, dict(model.named_parameters())


def check_parity(job: JobResult) -> Parity:
    """The job's losses (rank 0), and the first-step gradients and final parameters rank 0
    saved (``mesh_<part>_params.pt``), against :func:`reference_run` of the job's config."""
    import torch

    from labkit.workers.mesh_train import MeshTrainConfig

    config = MeshTrainConfig.from_dict(job.config)
    ref_losses, ref_grads, ref_params = reference_run(config)
    parts = [p for p in PARTS if p in config.parts]
    losses, errors = {}, {}
    for part in parts:
        saved = torch.load(job.log_dir / f"mesh_{part}_params.pt")
        losses[part] = job.rank(0)[part]["losses"]
        errors[part] = {
            "loss": max(abs(a - b) for a, b in zip(losses[part], ref_losses, strict=True)),
            "grad": max((saved["first_grads"][n] - ref_grads[n]).abs().max().item() for n in ref_grads),
            "param": max((saved["params"][n] - p.detach()).abs().max().item()
                         for n, p in ref_params.items()),
        }  # fmt: skip
    return Parity(reference_losses=ref_losses, losses=losses, errors=errors, steps=config.steps)


@dataclass(frozen=True)
class MemoryCheck:
    """The model state each rank measured (local shards, after the last step) against
    ``mesh.predict_memory``, beside one process's."""

    model: dict[str, Any]
    n_params: int
    measured: dict[str, dict[str, int]]
    """{part: rank 0's bytes by kind and "total"}."""
    predicted: dict[str, dict[str, float]]
    totals: dict[str, list[int]]
    """{part: every rank's total}."""
    match: bool
    """Every rank's bytes of every kind equal the prediction."""

    def describe(self) -> str:
        one = {"parameters": 4 * self.n_params, "gradients": 4 * self.n_params,
               "optimizer_state": 8 * self.n_params}  # fmt: skip
        lines = [f"{'':>10}{'':>10}" + "".join(f"{k:>17}" for k in STATE_KEYS) + f"{'total':>12}"
                 "   (MiB per rank)",
                 f"{'one process':>20}" + "".join(f"{one[k] / MIB:>17.3f}" for k in STATE_KEYS)
                 + f"{16 * self.n_params / MIB:>12.3f}"]  # fmt: skip
        for part in self.measured:
            for label, row in (("measured", self.measured[part]), ("predicted", self.predicted[part])):
                lines.append(f"{part:>10}{label:>10}" + "".join(f"{row[k] / MIB:>17.3f}" for k in STATE_KEYS)
                             + f"{row['total'] / MIB:>12.3f}")  # fmt: skip
        same = all(len(set(v)) == 1 for v in self.totals.values())
        lines.append(("every rank holds the same bytes, " if same else f"ranks differ: {self.totals}; ")
                     + ("equal to the prediction to the byte" if self.match
                        else "and they DIFFER from the prediction"))  # fmt: skip
        return "\n".join(lines)


def check_memory(job: JobResult, pred: MeshPrediction) -> MemoryCheck:
    """Every rank's model state, part by part, against ``pred.memory``."""
    parts = list(pred.memory)
    ranks = range(job.world_size)
    return MemoryCheck(
        model=pred.model, n_params=pred.n_params,
        measured={p: dict(job.rank(0)[p]["memory"]) for p in parts},
        predicted=pred.memory,
        totals={p: [job.rank(r)[p]["memory"]["total"] for r in ranks] for p in parts},
        match=all(job.rank(r)[p]["memory"][k] == pred.memory[p][k]
                  for r in ranks for p in parts for k in STATE_KEYS),
    )  # fmt: skip


def plot_memory(memory: MemoryCheck, ax: Any = None) -> Any:
    """Predicted and measured model state per rank, one process beside each composition."""
    import matplotlib.pyplot as plt
    import numpy as np

    if ax is None:
        _, ax = plt.subplots(figsize=(6.4, 3.2))
    names = {"fsdp_tp": "FSDP2 × TP\n(dp 2 × tp 2)", "hsdp": "HSDP\n(replicate 2 × shard 2)"}
    parts = list(memory.measured)
    labels = ["one process"] + [names.get(p, p) for p in parts]
    predicted = [16 * memory.n_params / MIB] + [memory.predicted[p]["total"] / MIB for p in parts]
    measured = [np.nan] + [memory.measured[p]["total"] / MIB for p in parts]
    xs = np.arange(len(labels))
    ax.bar(xs - 0.18, predicted, 0.36, label="predicted", color="lightgrey", edgecolor="black", hatch="//")
    ax.bar(xs + 0.18, measured, 0.36, label="measured (rank 0, local shards)", color="tab:blue")
    ax.set(xticks=xs, xticklabels=labels, ylabel="model state per rank (MiB)",
           title=f"fp32 parameters + gradients + AdamW state, GPT {memory.model['n_layer']} layers "
                 f"× d {memory.model['d_model']}")  # fmt: skip
    ax.legend()
    ax.figure.tight_layout()
    return ax


# --- after the job: the reconcile, and the step times ------------------------------------------


@dataclass(frozen=True)
class MeshChecks:
    """The three predictions (groups, bytes, memory) and parity, each agreeing or not."""

    checks: dict[str, bool]

    def describe(self) -> str:
        lines = [f"{'agrees' if passed else 'DIFFERS'}: {what}" for what, passed in self.checks.items()]
        lines.append("the prediction holds for both compositions" if all(self.checks.values()) else
                     "the prediction FAILS where a line says DIFFERS: that is the part of the "
                     "model to revisit")  # fmt: skip
        return "\n".join(lines)


def reconcile(groups: GroupCheck, counted: BytesCheck, memory: MemoryCheck, parity: Parity) -> MeshChecks:
    """The four checks of the mesh job in one list."""
    return MeshChecks(checks={
        "groups read from the DeviceMesh == group_ranks": groups.agree,
        "bytes counted on every dimension == predict_comm": counted.exact,
        "model state measured on every rank == predict_memory": memory.match,
        "losses, gradients, parameters == one process (fp32 rounding)": parity.ok,
    })  # fmt: skip


@dataclass(frozen=True)
class StepComparison:
    """fsdp_tp's steps against hsdp's, each step's time the slowest rank's (the first step
    left out: it warms up), compared by ``verdict.compare_times``."""

    comparison: verdict.Comparison
    steps: int
    device: str
    nproc: int

    def describe(self) -> str:
        c = self.comparison
        lines = [str(c), f"(measured: {self.steps} steps after the first, the slowest rank's time "
                         "in each)"]  # fmt: skip
        if c.outcome == "faster" and c.faster.name.startswith("hsdp"):
            lines.append("a likely cause, not measured apart here: FSDP x TP adds TP's activation "
                         "all-reduces (counted above), each one waited for, and runs every matmul "
                         "half as wide; on 4 ranks sharing 2 cores, contention can weigh as much")  # fmt: skip
        if self.device == "cpu":
            lines.append(f"on this tier: {self.nproc} CPU ranks on shared cores over gloo; these "
                         "times are not a GPU's")  # fmt: skip
        return "\n".join(lines)


def compare_steps(job: JobResult) -> StepComparison:
    """The slowest rank's time of each step after the first, fsdp_tp against hsdp."""
    slowest = {}
    for part in PARTS:
        steps = [job.rank(r)[part]["step_s"][1:] for r in range(job.world_size)]
        slowest[part] = [max(s) for s in zip(*steps, strict=True)]
    cmp = verdict.compare_times(slowest["fsdp_tp"], slowest["hsdp"],
                                names=("fsdp_tp step, slowest rank", "hsdp step, slowest rank"))  # fmt: skip
    return StepComparison(comparison=cmp, steps=len(slowest["hsdp"]), device=job.device,
                          nproc=job.world_size)  # fmt: skip


# --- exercise 2: the measurements choose_mesh reads, and the chosen mesh run -------------------


def measured(job: JobResult) -> dict[str, Any]:
    """What ``job`` measured, in the form ``choose_mesh`` receives it: per composition its
    mesh, the model state by kind on the rank holding the most, and rank 0's bytes sent per
    step on each dimension."""
    ranks = range(job.world_size)
    return {
        part: {"mesh": job.rank(0)[part]["mesh"],
               "memory": {k: max(job.rank(r)[part]["memory"][k] for r in ranks) for k in STATE_KEYS},
               "sent": {d: v["sent_per_rank"] for d, v in job.rank(0)[part]["bytes"].items()}}
        for part in PARTS
    }  # fmt: skip


def _sent(m: Mapping[str, Any]) -> str:
    return ", ".join(f"{d} {b / MIB:.2f} MiB" for d, b in m["sent"].items())


def describe_measured(measured: Mapping[str, Any], budget_bytes: float) -> str:
    """The budget, and each composition's model state and bytes sent per rank."""
    lines = [f"budget per GPU: {budget_bytes / MIB:.2f} MiB of model state"]
    for part, m in measured.items():
        lines.append(f"{part:>8} on {m['mesh']}: model state {sum(m['memory'].values()) / MIB:.2f} "
                     f"MiB per rank; sent per rank per step {_sent(m)} (measured)")  # fmt: skip
    return "\n".join(lines)


def composition_of(choice: Mapping[str, int] | None, measured: Mapping[str, Any]) -> str | None:
    """The composition whose mesh has ``choice``'s dimensions (in either order); None: none
    chosen."""
    if choice is None:
        return None
    return next(p for p, m in measured.items() if set(m["mesh"]) == set(choice))


def describe_choice(choice: Mapping[str, int] | None) -> str:
    """The chosen mesh's groups, predicted: the inner dimension's inside a node, the outer's
    across the nodes; or that nothing fits."""
    if choice is None:
        return "nothing to run: neither composition fits the budget"
    outer, inner = list(choice)
    return (f"predicted groups: inner '{inner}' {mesh.all_groups(choice, inner)} (one node "
            f"each), outer '{outer}' {mesh.all_groups(choice, outer)} (across the nodes)")  # fmt: skip


@dataclass(frozen=True)
class ChoiceRun:
    """The chosen composition run on the chosen mesh: its model state against the budget, the
    bytes counted across and inside the nodes, and the other composition as measured before."""

    part: str
    outer: str
    inner: str
    state: int
    """Model state on the fullest rank (bytes)."""
    budget: float
    crossing: float
    """Bytes per rank per step on the outer dimension (counted)."""
    inside: float
    others: dict[str, dict[str, Any]]
    """{part: its entry of ``measured``} for the compositions not chosen."""

    def describe(self) -> str:
        lines = [f"measured: model state {self.state / MIB:.2f} MiB on the fullest rank against a "
                 f"budget of {self.budget / MIB:.2f} MiB: "
                 + ("it fits" if self.state <= self.budget else "it does NOT fit"),
                 f"counted: {self.crossing / MIB:.2f} MiB per rank per step cross the nodes on "
                 f"'{self.outer}', {self.inside / MIB:.2f} MiB stay inside on '{self.inner}'"]  # fmt: skip
        for part, m in self.others.items():
            state = sum(m["memory"].values())
            lines.append(f"the other, {part}: model state {state / MIB:.2f} MiB ("
                         + ("fits" if state <= self.budget else "does not fit")
                         + f"); per rank per step {_sent(m)} (measured above)")  # fmt: skip
        return "\n".join(lines)


def check_choice(
    job: JobResult, choice: Mapping[str, int], measured: Mapping[str, Any], budget_bytes: float
) -> ChoiceRun:
    """``job`` (the chosen composition alone, on ``choice``) against the budget and the
    other composition's measurements."""
    part = composition_of(choice, measured)
    outer, inner = list(choice)
    counted = job.rank(0)[part]["bytes"]
    return ChoiceRun(
        part=part, outer=outer, inner=inner, budget=budget_bytes,
        state=max(job.rank(r)[part]["memory"]["total"] for r in range(job.world_size)),
        crossing=counted[outer]["sent_per_rank"], inside=counted[inner]["sent_per_rank"],
        others={p: dict(m) for p, m in measured.items() if p != part},
    )  # fmt: skip
