"""Which kind of work an ATen operator does, from its name: the one classifier.

    from labkit.op_kinds import MATMUL, kind_of
    kind_of("aten::addmm")        # "matmul"
    kind_of("aten::gelu")         # "other operators"

A profiler event, a FLOP column and a checkpoint policy all name operators (``aten::mm``);
every place in labkit that asks "is this a matmul?" asks :func:`kind_of`, so a name added here
(a fused kernel in a new PyTorch) counts everywhere at once. Plain names, no torch: anything
may import it.

A kind covers every operator whose name *contains* one of its substrings (first kind wins), so
the spellings of one kernel family (``_scaled_dot_product_flash_attention`` and its CPU
variant) need one entry. The matmuls are the ATen ops that run a dense matrix multiply:
``F.linear`` reaches ``addmm`` (with a bias) or ``mm``; ``bmm``/``baddbmm`` batch them;
``addmv`` is a matrix times a vector; ``_addmm_activation`` is ``addmm`` with GELU or ReLU
fused into its epilogue (cuBLASLt). Composite ops (``aten::linear``, ``aten::matmul``) are not
matmuls here: they only call one, and counting both would count the work twice.

Source: the operator names of ATen's native functions,
https://github.com/pytorch/pytorch/blob/main/aten/src/ATen/native/native_functions.yaml.
"""

from __future__ import annotations

MATMUL = "matmul"
ATTENTION = "attention (SDPA)"
OTHER = "other operators"

KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (MATMUL, ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addmv",
              "aten::_addmm_activation")),
    (ATTENTION, ("scaled_dot_product", "flash_attention", "efficient_attention",
                 "cudnn_attention")),
    ("layer norm", ("layer_norm",)),
    ("loss (log-softmax, NLL)", ("log_softmax", "nll_loss", "cross_entropy")),
)  # fmt: skip
"""Kind -> substrings of the operator names it covers (first match wins)."""


def kind_of(name: str) -> str:
    """The kind (:data:`KINDS`) of the operator called ``name``, else :data:`OTHER`."""
    for kind, parts in KINDS:
        if any(part in name for part in parts):
            return kind
    return OTHER


def is_matmul(name: str) -> bool:
    """Whether the operator called ``name`` runs a dense matrix multiply."""
    return kind_of(name) == MATMUL
