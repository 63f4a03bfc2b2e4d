"""Measured training memory, split into the four parts the formulas predict.

Where the bytes of a training step go (ZeRO paper, section 3): the parameters, their
gradients, the optimiser state, and the activations autograd keeps for the backward pass.
:mod:`labkit.formulas` predicts each part; this module measures them on a real step.

Two methods, each named in the result:

* **tensor accounting** (every device): add up the bytes of the tensors that really exist
  (``p``, ``p.grad``, ``optimizer.state``) and of every tensor autograd *saves for backward*
  during the forward pass, caught with ``torch.autograd.graph.saved_tensors_hooks``. Each
  storage is counted once, and saved tensors that are parameters are not counted twice.
  This is exact for what autograd keeps, and works on a CPU where no allocator statistics
  exist.
* **CUDA allocator** (GPU only): ``torch.cuda.memory_allocated`` before and after each phase,
  and ``max_memory_allocated`` for the peak. This also sees temporaries, workspace and
  fragmentation-free rounding that tensor accounting cannot (PyTorch "CUDA memory management").

And the predictions to hold them against: :func:`predicted_activations` (every term of a
``labkit.model.GPT``'s saved activations, from :mod:`labkit.formulas`),
:func:`predicted_step_peak` (every tensor alive at the peak of a whole training step, with
:func:`cuda_block_bytes` for the CUDA allocator's 512-byte blocks) and
:func:`live_bytes_over_steps` (what is alive at each phase of the first steps, which shows the
optimiser state arriving at the first ``optimizer.step()``)::

    predicted = memory.predicted_activations(cfg.model, micro_batch=8, dtype="float32")
    measured = memory.measure_training_memory(model, optimizer, batch, device=device)
    assert sum(predicted.values()) == measured.activations    # on a CPU, to the byte
"""

from __future__ import annotations

import html
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from labkit import formulas
from labkit.config import ModelConfig
from labkit.train import Batch, autocast
from labkit.validate import one_of, whole


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views share one storage)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        s = t.untyped_storage()
        seen.setdefault(s.data_ptr(), s.nbytes())
    return sum(seen.values())


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0]  # skip scalar step counters


def _cuda_allocated(device: torch.device) -> int | None:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


@dataclass(frozen=True)
class MemoryMeasurement:
    """Bytes of each part of training memory, measured on one training step."""

    parameters: int
    gradients: int
    optimizer_state: int
    optimizer_state_before_first_step: int
    activations: int
    """Bytes autograd saved for backward in one forward pass (tensor accounting)."""
    device: str
    method: str
    cuda_activations: int | None = None
    """On CUDA: memory_allocated after forward minus before it (allocator view)."""
    cuda_peak: int | None = None
    """On CUDA: max_memory_allocated over the step."""

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state + self.activations

    def as_dict(self) -> dict[str, int]:
        return {"parameters": self.parameters, "gradients": self.gradients,
                "optimizer state": self.optimizer_state, "activations": self.activations}

    def _repr_html_(self) -> str:
        rows = "".join(f"<tr><td>{k}</td><td>{v / 2**20:,.2f} MiB</td></tr>"
                       for k, v in self.as_dict().items())
        return (f"<table><thead><tr><th>part</th><th>measured</th></tr></thead>"
                f"<tbody>{rows}</tbody></table><p>{html.escape(self.method)} on "
                f"{html.escape(self.device)}</p>")


def measure_training_memory(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    *,
    device: torch.device,
    dtype: str = "float32",
) -> MemoryMeasurement:
    """Run one real forward, backward and optimiser step on ``batch`` and measure each part.

    The model takes a real step: call it on a model you are about to train anyway (or a copy).
    """
    params = [p for p in model.parameters()]
    param_storages = {p.untyped_storage().data_ptr() for p in params}
    state_before = storage_bytes(optimizer_state_tensors(optimizer))

    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in param_storages:
            saved.append(t)
        return t

    x, y = (t.to(device) for t in batch)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    before_forward = _cuda_allocated(device)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast(device, dtype):
        _, loss = model(x, y)
    after_forward = _cuda_allocated(device)
    activations = storage_bytes(saved)
    saved.clear()
    loss.backward()
    gradients = storage_bytes(p.grad for p in params if p.grad is not None)
    optimizer.step()
    optimizer_state = storage_bytes(optimizer_state_tensors(optimizer))
    optimizer.zero_grad(set_to_none=True)
    cuda = device.type == "cuda"
    return MemoryMeasurement(
        parameters=storage_bytes(params),
        gradients=gradients,
        optimizer_state=optimizer_state,
        optimizer_state_before_first_step=state_before,
        activations=activations,
        device=str(device),
        method="tensor accounting (storages of parameters, .grad, optimizer.state, "
               "and tensors saved for backward)" + (" + CUDA allocator" if cuda else ""),
        cuda_activations=(after_forward - before_forward) if cuda else None,
        cuda_peak=torch.cuda.max_memory_allocated(device) if cuda else None,
    )


def predicted_activations(
    cfg: ModelConfig, micro_batch: int, *, dtype: str = "float32", attention: str = "flash",
    seq_len: int | None = None,
) -> dict[str, int]:
    """Bytes ``labkit.model.GPT`` saves for backward in one forward pass, term by term.

    The transformer layers from :func:`labkit.formulas.activation_bytes` (Korthikanti et
    al. 2022, generalised to the element size, autocast and a fused attention kernel), then
    every term that formula leaves out (:func:`labkit.formulas.activation_bytes_omitted`).
    ``dtype`` is the run's dtype: float32, or a 16-bit dtype by autocast over float32
    parameters (how ``labkit.train`` trains in bf16). ``attention``: "flash" for a fused SDPA
    kernel (no s×s matrix stored), "materialized" for the math backend. ``seq_len`` overrides
    the config's for a shorter input. Dropout must be off (the presets' ``dropout=0``): with
    p > 0 the masks' size depends on the backend.
    """
    if cfg.dropout > 0:
        raise ValueError(f"cfg.dropout={cfg.dropout!r}: the prediction is for dropout off; "
                         "use a config with dropout=0.0 (every preset has it)")
    s = seq_len if seq_len is not None else cfg.seq_len
    e = formulas.dtype_bytes(dtype)
    mixed = e < 4
    layers = formulas.activation_bytes(
        cfg.n_layer, s, micro_batch, cfg.d_model, cfg.n_head, bytes_per_element=e,
        dropout=False, attention=attention, autocast=mixed)
    rest = formulas.activation_bytes_omitted(
        cfg.n_layer, s, micro_batch, cfg.d_model, cfg.vocab_size, bytes_per_element=e,
        autocast=mixed)
    terms = {f"transformer layers ({attention} attention)": layers, **rest.as_dict()}
    return {name: int(v) for name, v in terms.items() if v}


def predicted_stage_activations(
    cfg: ModelConfig, micro_batch: int, *, blocks: int, first: bool, last: bool,
    dtype: str = "float32", attention: str = "flash",
) -> dict[str, int]:
    """Bytes one pipeline stage of ``labkit.model.GPT`` saves per micro-batch, term by term.

    A stage runs ``blocks`` transformer blocks, the first stage also the embeddings and the
    last one the final LayerNorm and the output head (``labkit.parallel.pipeline``); the loss
    is computed outside the stage. So from the whole model's terms
    (:func:`labkit.formulas.activation_bytes_omitted`) a stage keeps:

    * every stage: its blocks (``formulas.activation_bytes``) and their LayerNorms' float32
      mean and rstd (2 norms per block, 2·4·s·b bytes each);
    * the first: the int64 token ids its embedding saves (8·s·b) and the position ids (8·s);
    * the last: the final LayerNorm's input, its output (the head's input) and its statistics,
      and under autocast the head weight's 16-bit copy; no log-softmax, no targets.

    Dropout must be off, as for :func:`predicted_activations`.
    """
    if cfg.dropout > 0:
        raise ValueError(f"cfg.dropout={cfg.dropout!r}: the prediction is for dropout off; "
                         "use a config with dropout=0.0 (every preset has it)")
    blocks = whole("blocks", blocks, low=0, high=cfg.n_layer, why="the blocks this stage runs")
    s, b, h = cfg.seq_len, micro_batch, cfg.d_model
    e = formulas.dtype_bytes(dtype)
    mixed = e < 4
    model_terms = formulas.activation_bytes_omitted(
        max(blocks, 1), s, b, h, cfg.vocab_size, bytes_per_element=e, autocast=mixed)
    stats_per_norm = 2 * 4 * s * b  # float32 mean and rstd per token
    terms: dict[str, float] = {}
    if blocks:
        terms[f"transformer layers ({attention} attention)"] = formulas.activation_bytes(
            blocks, s, b, h, cfg.n_head, bytes_per_element=e, dropout=False,
            attention=attention, autocast=mixed)  # fmt: skip
        terms["LayerNorm statistics (blocks)"] = 2 * blocks * stats_per_norm
    if first:
        terms["token and position ids"] = 8 * s * b + 8 * s
    if last:
        terms["final LayerNorm input"] = model_terms.final_norm_input
        terms["output head input (final LayerNorm output)"] = model_terms.head_input
        terms["final LayerNorm statistics"] = stats_per_norm
        terms["head weight copy (autocast)"] = model_terms.head_weight_copy
    return {name: int(v) for name, v in terms.items() if v}


@dataclass(frozen=True)
class PhaseBytes:
    """Bytes alive at the end of one phase of one training step (tensor accounting)."""

    step: int
    phase: str
    """"start", "forward", "backward" or "optimizer step" (before ``zero_grad``)."""
    parameters: int
    gradients: int
    optimizer_state: int
    activations: int
    """Tensors saved for backward and still held: only after the forward."""
    cuda_allocated: int | None = None
    """On CUDA: ``torch.cuda.memory_allocated`` at this point."""
    cuda_step_peak: int | None = None
    """On CUDA, on each step's last phase: ``max_memory_allocated`` over that step."""

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state + self.activations


def live_bytes_over_steps(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterable[Batch],
    *,
    device: torch.device,
    dtype: str = "float32",
) -> list[PhaseBytes]:
    """Train one real step per batch and record what is alive after each phase.

    PyTorch's optimisers create their state lazily, in the first ``step()`` (``torch.optim``'s
    ``_init_group``): the first forward and backward run without it, every later one beside
    it. So step 2's forward holds exactly the optimiser state more than step 1's (same batch
    shape), and an out-of-memory error can first strike at step 2. The model takes real
    steps: use a copy, or a model you are about to train anyway.
    """
    params = list(model.parameters())
    param_storages = {p.untyped_storage().data_ptr() for p in params}
    cuda = device.type == "cuda"
    rows: list[PhaseBytes] = []

    def record(step: int, phase: str, saved: list[torch.Tensor], peak: bool = False) -> None:
        if cuda:
            torch.cuda.synchronize(device)
        rows.append(PhaseBytes(
            step=step, phase=phase, parameters=storage_bytes(params),
            gradients=storage_bytes(p.grad for p in params if p.grad is not None),
            optimizer_state=storage_bytes(optimizer_state_tensors(optimizer)),
            activations=storage_bytes(saved),
            cuda_allocated=_cuda_allocated(device),
            cuda_step_peak=torch.cuda.max_memory_allocated(device) if cuda and peak else None))

    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in param_storages:
            saved.append(t)
        return t

    for step, (x, y) in enumerate(batches, start=1):
        x, y = x.to(device), y.to(device)
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        record(step, "start", [])
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast(device, dtype):
            _, loss = model(x, y)
        record(step, "forward", saved)
        saved.clear()  # our references would otherwise keep the activations alive
        loss.backward()
        del loss
        record(step, "backward", [])
        optimizer.step()
        record(step, "optimizer step", [], peak=True)
        optimizer.zero_grad(set_to_none=True)
    return rows


def saved_activation_bytes(
    model: nn.Module, batch: Batch, *, device: torch.device, dtype: str = "float32",
) -> int:
    """Bytes autograd saves for backward in one forward pass of ``model`` on ``batch``.

    The activation part of :func:`measure_training_memory` alone: no backward, no optimiser
    step, the model left unchanged (the graph is dropped when this returns). Cheap enough
    for a sweep over batch sizes and sequence lengths.
    """
    param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in param_storages:
            saved.append(t)
        return t

    x, y = (t.to(device) for t in batch)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast(device, dtype):
        model(x, y)
    return storage_bytes(saved)


# ----------------------------------------------------------------------------------------------
# The peak of a whole training step, predicted tensor by tensor.

CUDA_MIN_BLOCK_BYTES = 512
"""The CUDA caching allocator's smallest block: every request is rounded up to a multiple of it
(``kMinBlockSize`` in PyTorch's ``c10/cuda/CUDACachingAllocator.cpp``)."""


def cuda_block_bytes(nbytes: int) -> int:
    """Bytes PyTorch's CUDA caching allocator counts for a tensor storage of ``nbytes``.

    ``round_size`` in ``c10/cuda/CUDACachingAllocator.cpp`` (pytorch/pytorch) rounds every
    request up to a multiple of ``kMinBlockSize`` = 512 bytes, and ``memory_allocated`` /
    ``max_memory_allocated`` add up those rounded block sizes. A zero-byte storage allocates no
    block (``allocate`` calls ``malloc`` only for ``size != 0``). Not modelled: the
    ``roundup_power2_divisions`` option of ``PYTORCH_CUDA_ALLOC_CONF``, off by default, which
    rounds larger requests further; and a cached block larger than the request that is not
    split (``should_split``: in the large pool only when more than 1 MiB would remain), which
    counts at its full size. Small requests, as in the course's models, are split and counted
    as rounded here.
    """
    nbytes = whole("nbytes", nbytes, low=0, why="a number of bytes")
    block = CUDA_MIN_BLOCK_BYTES
    return -(-nbytes // block) * block


@dataclass(frozen=True)
class StepPeak:
    """The tensors alive at the peak of one training step, predicted, grouped into terms.

    ``tensors`` maps each term to the bytes of each of its tensors (one storage each), so the
    CUDA allocator's rounding can be applied tensor by tensor.
    """

    tensors: dict[str, tuple[int, ...]]
    moment: str
    """When in the step the live bytes peak, in words."""

    @property
    def bytes(self) -> int:
        """Predicted peak of live tensor bytes (what :class:`labkit.batching.trials.
        LiveTensorBytes` counts on a CPU)."""
        return sum(sum(sizes) for sizes in self.tensors.values())

    @property
    def cuda_bytes(self) -> int:
        """Predicted ``torch.cuda.max_memory_allocated`` rise over the step: each tensor rounded
        up to the allocator's 512-byte blocks (:func:`cuda_block_bytes`)."""
        return sum(cuda_block_bytes(n) for sizes in self.tensors.values() for n in sizes)

    def as_dict(self, *, cuda: bool = False) -> dict[str, int]:
        """Bytes per term; ``cuda=True`` rounds each tensor as the CUDA allocator does."""
        size = cuda_block_bytes if cuda else int
        return {name: sum(size(n) for n in sizes) for name, sizes in self.tensors.items()}


def _gpt_parameter_shapes(cfg: ModelConfig) -> list[int]:
    """Elements of each parameter tensor of ``labkit.model.GPT(cfg)`` (tied weights once)."""
    h, V = cfg.d_model, cfg.vocab_size
    block = [h, h,  # ln_1
             h * h, h, h * h, h, h * h, h, h * h, h,  # q, k, v, attention proj
             h, h,  # ln_2
             4 * h * h, 4 * h, 4 * h * h, h]  # MLP fc, proj  # fmt: skip
    head = [] if cfg.tie_weights else [V * h]
    return [V * h, cfg.seq_len * h] + block * cfg.n_layer + [h, h] + head


def predicted_step_peak(
    cfg: ModelConfig, micro_batch: int, *, dtype: str = "float32", attention: str = "flash",
    seq_len: int | None = None,
) -> StepPeak:
    """The tensors alive at the peak of one steady-state ``labkit.train.train_step``.

    Steady state: AdamW's moments already exist (from step 2 on; :func:`live_bytes_over_steps`),
    gradients were set to None by the last step, one micro-batch (no accumulation). Reading
    what autograd does in ``labkit.model.GPT`` and ``train_step``, the live bytes peak in the
    loss's backward, at ``log_softmax``'s backward, the first large allocation of the backward
    pass, made while every saved activation is still held:

    * parameters and AdamW's exp_avg and exp_avg_sq (float32, one tensor per parameter tensor;
      the step counters are CPU scalars), no gradients yet;
    * the batch on the device (int64 ids and targets) and the position ids;
    * every tensor autograd saved in the forward (:func:`predicted_activations`), tensor by
      tensor, except the loss's ``total_weight``, which ``nll_loss``'s backward has released;
    * the logits (b·s·V in the autocast dtype): ``train_step`` keeps the forward's first
      result, ``_``, until the step ends, although the loss saved only its log-softmax;
    * the gradient of the log-softmax output that ``nll_loss``'s backward returned, and the
      gradient of the logits being allocated (b·s·V float32 each);
    * the loss (``loss / n``) and the backward's seed gradient, one float32 scalar each.

    Measured (torch 2.13, CPU, :func:`labkit.batching.trials.measure_step_peak`, the finder's
    trial step): this equals the peak of live tensor bytes to the byte for the smoke and lab
    presets at b = 1 to 16 in float32 and under bf16 autocast, flash attention, with one
    exception: the lab preset at b = 1 in float32 peaks later, in the last block's MLP backward
    (the head's and the block's first gradients have arrived), 197,120 B (1.3%) above this.
    The peak moves there, or to the optimizer step (16 bytes per parameter plus the optimizer's
    temporaries), when the batch's activations are small beside 4 bytes a parameter. The math
    kernel (``attention="materialized"``) closes the same way in float32; under bf16 autocast
    it holds more at the peak than this lists (measured: 3.5 to 5 bytes per attention score at
    those presets; not modelled).

    Not predicted: scratch memory inside one op, the CUDA context, cuBLAS workspaces (allocated
    once, before the step), a float16 GradScaler's scalars. :attr:`StepPeak.cuda_bytes` adds the
    CUDA allocator's rounding. ``dtype``: float32, or a 16-bit dtype by autocast over float32
    parameters; ``attention``, ``seq_len`` and the dropout rule as in
    :func:`predicted_activations`.
    """
    if cfg.dropout > 0:
        raise ValueError(f"cfg.dropout={cfg.dropout!r}: the prediction is for dropout off; "
                         "use a config with dropout=0.0 (every preset has it)")
    one_of("attention", attention, formulas.ATTENTION_KINDS)
    b = whole("micro_batch", micro_batch, low=1)
    s = whole("seq_len", seq_len, low=1) if seq_len is not None else cfg.seq_len
    L, h, a, V = cfg.n_layer, cfg.d_model, cfg.n_head, cfg.vocab_size
    e = formulas.dtype_bytes(dtype)
    mixed = e < 4
    r = 4 if mixed else e  # the residual stream, LayerNorm's input: float32 under autocast
    sbh = s * b * h
    params = tuple(4 * n for n in _gpt_parameter_shapes(cfg))
    per_layer = {
        "LayerNorm inputs (residual stream)": (r * sbh,) * 2,
        "q/k/v projections' input": (e * sbh,) * (3 if mixed else 1),  # autocast: one cast each
        "Q, K, V (SDPA's inputs)": (e * sbh,) * 3,
        "attention output (output projection's input)": (e * sbh,),
        "MLP input": (e * sbh,),
        "GELU input and output": (4 * e * sbh,) * 2,
        "LayerNorm mean and rstd": (4 * s * b,) * 4,
    }
    if attention == "flash":
        per_layer["attention log-sum-exp"] = (4 * a * s * b,)
    else:
        per_layer["attention probabilities (s×s)"] = (e * a * s * s * b,)
    if mixed:
        per_layer["16-bit weight copies (autocast)"] = (e * h * h,) * 4 + (e * 4 * h * h,) * 2
    tensors: dict[str, tuple[int, ...]] = {
        "parameters": params,
        "optimizer state (AdamW exp_avg, exp_avg_sq)": params * 2,
        "token ids, targets and position ids": (8 * s * b, 8 * s * b, 8 * s),
    }
    for name, sizes in per_layer.items():
        tensors[f"saved: {name}, {L} layers"] = sizes * L
    tensors["saved: final LayerNorm input, output and statistics"] = (
        r * sbh, e * sbh, 4 * s * b, 4 * s * b)
    if mixed:
        tensors["saved: output head 16-bit weight copy"] = (e * V * h,)
    tensors["saved: log-softmax output (float32)"] = (4 * s * b * V,)
    tensors["logits (kept by train_step's forward result)"] = (e * s * b * V,)
    tensors["gradients of the log-softmax output and of the logits"] = (4 * s * b * V,) * 2
    tensors["loss and its seed gradient"] = (4, 4)
    return StepPeak(tensors=tensors, moment="the loss's backward: log_softmax's backward, "
                    "before any parameter gradient exists")  # fmt: skip
