"""NVML plumbing, once: loading the bindings, a session, decoding, "field or N/A", and what a
failed ``nvmlInit`` means.

Three parts of labkit talk to the NVIDIA driver through NVML: GPU detection
(:mod:`labkit.hardware.gpus`), the live metric collector (:mod:`labkit.metrics.nvml`) and the
doctor. They all load the bindings, start and end a session, decode strings and treat a failed
optional query as N/A in the same way, so that happens here and nowhere else:

    load_nvml()          the ``pynvml`` module (from nvidia-ml-py), or None when not installed
    nvml_session(nvml)   ``nvmlInit`` … ``nvmlShutdown``, the shutdown best effort
    shutdown_nvml(nvml)  a best-effort ``nvmlShutdown`` (nvmlInit is reference-counted)
    nvml_text(value)     a string NVML returned (bytes from older bindings)
    field_or_na(query)   one optional query: any failure is N/A (None), never a made-up 0
    cuda_driver_text(v)  the CUDA version a driver supports, 12080 → "12.8"
    init_error_hint(e)   what an NVML error from ``nvmlInit`` means, in words a learner can act on
    nvml_status()        does NVML work here, and why not when it does not

Importing this module loads nothing: ``pynvml`` is imported by :func:`load_nvml`, on call.
nvitop's ``libnvml`` is the model: every NVML query maps failure to N/A, never to 0.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple


def load_nvml() -> Any | None:
    """The ``pynvml`` module from nvidia-ml-py, or None when it is not installed."""
    try:
        import pynvml  # lazy: importing labkit loads no library
    except ImportError:
        return None
    return pynvml


def shutdown_nvml(nvml: Any) -> None:
    """``nvmlShutdown``, best effort: the queries' results are what matter, and nvmlInit is
    reference-counted, so each successful init gets one shutdown."""
    with contextlib.suppress(Exception):
        nvml.nvmlShutdown()


@contextlib.contextmanager
def nvml_session(nvml: Any) -> Iterator[Any]:
    """``nvmlInit`` … ``nvmlShutdown``: an init error propagates, the shutdown is best effort."""
    nvml.nvmlInit()
    try:
        yield nvml
    finally:
        shutdown_nvml(nvml)


def nvml_text(value: Any) -> str:
    """A string NVML returned: older nvidia-ml-py versions return bytes."""
    return value.decode() if isinstance(value, bytes) else str(value)


def field_or_na(query: Callable[[], Any]) -> Any | None:
    """One optional NVML (or torch) query: any failure is N/A (None), never a made-up value."""
    try:
        return query()
    except Exception:
        return None


def cuda_driver_text(version: int) -> str:
    """``nvmlSystemGetCudaDriverVersion``'s (and cudaDriverGetVersion's) encoding, read:
    12080 → "12.8"."""
    return f"{version // 1000}.{version % 1000 // 10}"


# What each NVML error usually means for a learner, and what to do about it. nvidia-ml-py
# raises one subclass of NVMLError per error code, named after it (NVMLError_LibraryNotFound).
_ERROR_HINTS = {
    "NVMLError_LibraryNotFound": "NVML library not found: no NVIDIA driver on this machine "
    "(libnvidia-ml.so is missing), so there is no GPU to measure",
    "NVMLError_DriverNotLoaded": "NVIDIA driver not loaded: the kernel module is not running "
    "(check `nvidia-smi`; a reboot or `modprobe nvidia` may be needed)",
    "NVMLError_LibRmVersionMismatch": "NVML library and kernel driver versions differ: the "
    "driver was upgraded without a reboot; reboot or reload the nvidia module",
    "NVMLError_NoPermission": "no permission to talk to the NVIDIA driver (check the "
    "permissions of /dev/nvidia*)",
    "NVMLError_FunctionNotFound": "this NVML library lacks a function labkit needs: the "
    "driver is older than nvidia-ml-py expects",
}


def init_error_hint(err: BaseException) -> str | None:
    """What an error ``nvmlInit`` raised means, in words a learner can act on; None for an
    error without a known meaning (the caller then shows the error itself)."""
    return _ERROR_HINTS.get(type(err).__name__)


class NvmlStatus(NamedTuple):
    """Whether NVML (GPU telemetry) works here, and why not when it does not."""

    ok: bool
    message: str


def nvml_status(nvml: Any | None = None) -> NvmlStatus:
    """Try ``nvmlInit()`` and say what happened, in words a learner can act on.

    Args:
        nvml: an NVML module for tests; default ``pynvml`` from nvidia-ml-py.
    """
    nvml = load_nvml() if nvml is None else nvml
    if nvml is None:
        return NvmlStatus(
            False, "nvidia-ml-py is not installed (pip install nvidia-ml-py): no GPU telemetry"
        )
    try:
        nvml.nvmlInit()
    except Exception as e:  # NVML raises one subclass of NVMLError per error code
        return NvmlStatus(False, init_error_hint(e) or f"nvmlInit failed: {type(e).__name__}: {e}")
    try:
        count = nvml.nvmlDeviceGetCount()
        driver = nvml_text(nvml.nvmlSystemGetDriverVersion())
        return NvmlStatus(True, f"NVML works: driver {driver}, {count} GPU(s) visible to NVML")
    except Exception as e:
        return NvmlStatus(False, f"NVML initialised but a query failed: {type(e).__name__}: {e}")
    finally:
        shutdown_nvml(nvml)
