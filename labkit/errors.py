"""The one base of every error labkit raises on purpose: :class:`LabkitError`.

Each labkit exception class derives from :class:`LabkitError` *and* from the builtin it has
always been (``ValueError``, ``RuntimeError``, ``AssertionError``, ...), so that ``except
ValueError`` keeps catching a bad argument, and ``except LabkitError`` catches every refusal
labkit makes, wherever it comes from. ``tests/test_errors.py`` holds every public exception
class of the package to this.

This module imports nothing from labkit: it sits below everything that raises.
"""

from __future__ import annotations

__all__ = ["LabkitError"]


class LabkitError(Exception):
    """An error labkit raised on purpose, with a message a learner can act on.

    What a labkit error promises: its message names what happened (the value, file, rank or
    step that was wrong), where (the argument, path or line), and the fix (what to pass, run or
    change instead), in one or two plain sentences. Nothing it started is left running.

    It is an ``Exception``, never a bare ``BaseException``: a notebook's ``except Exception``
    catches it, and the kernel goes on. Catch it to handle every labkit refusal at once; catch
    a concrete class (``CheckpointMismatch``, ``JobFailed``, ...) or its builtin base to handle
    one kind.
    """
