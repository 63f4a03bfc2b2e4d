"""The peak of a whole training step, predicted tensor by tensor, and the CUDA allocator's
rounding of each tensor.

Apart from :mod:`labkit.memory.accounting` (what a step measures) because this is a model of
this code's own tensors at the step's peak, read from ``labkit.train`` and ``labkit.model``, not a
measurement. Import it as ``labkit.memory``, which re-exports what notebooks call.
"""

from __future__ import annotations

from dataclasses import dataclass

from labkit import formulas
from labkit.config import ModelConfig
from labkit.validate import one_of, whole

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


def predicted_step_peak(
    cfg: ModelConfig, micro_batch: int, *, dtype: str = "float32", attention: str = "flash",
    seq_len: int | None = None,
) -> StepPeak:
    """The tensors alive at the peak of one steady-state ``labkit.train.train_step``.

    Not in :mod:`labkit.formulas`: it models this code's own tensors (``train_step``'s, AdamW's,
    the CUDA allocator's rounding in :class:`StepPeak`), not a closed form of sizes.

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
    params = tuple(4 * n for n in formulas.gpt_parameter_counts(cfg))
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
