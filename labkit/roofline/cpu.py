"""What a CPU's feature flags say about its bf16 and fp16 arithmetic.

A bf16 or fp16 matmul on a CPU without instructions for that format converts to fp32 to
compute, so it runs *slower* than fp32. :func:`cpu_precision_support` reads the flags
(``labkit.hardware.cpu_info``) so that a ratio measured on a CPU is read as what it is: a
property of that CPU, not a GPU speedup. Reads flags only; measures nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from labkit import hardware


@dataclass(frozen=True)
class CpuPrecisionSupport:
    """What a CPU's feature flags say about bf16 and fp16 arithmetic.

    ``bfloat16``/``float16`` are True when the CPU has instructions that compute in that
    format, False when it has none (there is then no fast matrix kernel for the format: each
    value is widened to fp32 inside a generic loop, far slower than the tuned fp32 GEMM), None
    when labkit does not interpret this architecture's flags.
    """

    cpu: str
    architecture: str
    flags: tuple[str, ...]
    bfloat16: bool | None
    float16: bool | None
    notes: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.cpu} ({self.architecture}): " + "; ".join(self.notes)


_X86 = ("x86_64", "amd64", "i386", "i686")

# Flag names as Linux prints them in /proc/cpuinfo (arch/x86/include/asm/cpufeatures.h);
# the instructions from Intel's Architecture Instruction Set Extensions Programming Reference.
_BF16_FLAGS = {
    "avx512_bf16": "AVX512-BF16 (VDPBF16PS: bf16 pairs multiplied, summed in fp32)",
    "amx_bf16": "AMX-BF16 (TDPBF16PS: bf16 tile matrix multiplies)",
}
_FP16_FLAGS = {
    "avx512_fp16": "AVX512-FP16 (fp16 vector arithmetic)",
    "amx_fp16": "AMX-FP16 (TDPFP16PS: fp16 tile matrix multiplies)",
}


def cpu_precision_support(cpu: hardware.CpuInfo | None = None) -> CpuPrecisionSupport:
    """Read bf16 and fp16 support from the CPU's flags (``labkit.hardware.cpu_info``)."""
    cpu = hardware.cpu_info() if cpu is None else cpu
    if cpu.architecture.lower() not in _X86:
        note = (
            f"labkit does not interpret {cpu.architecture} feature flags: bf16 and fp16 "
            "support N/A (on Arm, look for bf16 among the Features in /proc/cpuinfo)"
        )
        return CpuPrecisionSupport(cpu.model_name, cpu.architecture, cpu.flags, None, None,
                                   (note,))  # fmt: skip
    notes = []
    support = {}
    for fmt, table in (("bf16", _BF16_FLAGS), ("fp16", _FP16_FLAGS)):
        have = [desc for flag, desc in table.items() if cpu.has(flag)]
        support[fmt] = bool(have)
        if have:
            notes.append(f"{fmt} arithmetic in hardware: {', '.join(have)}")
        else:
            notes.append(f"no {fmt} arithmetic instructions (none of {', '.join(table)}): "
                         f"no fast {fmt} matrix kernel, so {fmt} matmuls are expected to run "
                         "slower than fp32's tuned one here")  # fmt: skip
    return CpuPrecisionSupport(cpu.model_name, cpu.architecture, cpu.flags, support["bf16"],
                               support["fp16"], tuple(notes))  # fmt: skip
