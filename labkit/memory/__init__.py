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

The folder, one concern a module (``labkit.memory`` re-exports the names notebooks and tests
use, so ``memory.anatomy`` and the rest are called from here):

    accounting    what a step measures: the four parts, saved activations, live bytes per phase
    prediction    a training step's peak predicted tensor by tensor; the CUDA allocator's blocks
    report        notebook 01's anatomy, peak check and activation sweep, printed and drawn
"""

from labkit.formulas.activations import (  # the predictions this module measures against
    predicted_activations as predicted_activations,
)
from labkit.formulas.activations import predicted_stage_activations as predicted_stage_activations
from labkit.memory.accounting import PhaseBytes as PhaseBytes
from labkit.memory.accounting import live_bytes_over_steps as live_bytes_over_steps
from labkit.memory.accounting import measure_training_memory as measure_training_memory
from labkit.memory.accounting import optimizer_state_tensors as optimizer_state_tensors
from labkit.memory.accounting import saved_activation_bytes as saved_activation_bytes
from labkit.memory.accounting import storage_bytes as storage_bytes
from labkit.memory.prediction import StepPeak as StepPeak
from labkit.memory.prediction import cuda_block_bytes as cuda_block_bytes
from labkit.memory.prediction import predicted_step_peak as predicted_step_peak
from labkit.memory.report import PeakCheck as PeakCheck
from labkit.memory.report import activation_sweep as activation_sweep
from labkit.memory.report import anatomy as anatomy
from labkit.memory.report import describe_live_bytes as describe_live_bytes
from labkit.memory.report import plot_anatomy as plot_anatomy
