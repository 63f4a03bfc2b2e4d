"""Argument checks with one message style: ``name=value is not allowed: what is allowed``.

Every public labkit function that takes a count, a size, a rate or a choice checks it here
before any work starts, so a wrong argument fails at once, naming the argument, the value
given and what to give instead::

    n = whole("n_layer", n_layer, low=1)      # n_layer=0 is not allowed: a positive integer
    lr = positive("lr", lr)                   # lr=nan is not allowed: a positive finite number
    p = number("p", p, low=0, high=1)         # p=1.5 is not allowed: a finite number from 0 to 1
    kind = one_of("kind", kind, KINDS)        # kind='x' is not allowed: one of 'a', 'b'
    flag("dropout", dropout)                  # dropout=1 is not allowed: True or False

Python's ``bool`` is an ``int`` subclass; these checks refuse it wherever a number is asked
for, since ``n_layer=True`` is a mistake, never a layer count of 1. ``numbers.Integral`` and
``numbers.Real`` admit numpy's scalars (a sweep over ``np.arange``); :func:`whole` returns a
Python ``int``. A check raises :class:`InvalidValue` (a ``ValueError`` and a
:class:`~labkit.errors.LabkitError`) unless the caller names its own class with ``error=``
(a module whose refusals are all, say, ``ExamError``). ``why`` adds what the number means,
in parentheses after what is allowed.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from numbers import Integral, Real
from typing import Any, TypeVar

from labkit.errors import LabkitError

__all__ = ["InvalidValue", "flag", "is_finite", "is_integer", "is_real", "number", "one_of",
           "positive", "refuse", "shown", "whole"]

T = TypeVar("T")


class InvalidValue(ValueError, LabkitError):
    """An argument labkit cannot use; the message names it, its value, and what is allowed."""


def shown(value: object, width: int = 60) -> str:
    """``repr(value)`` cut to ``width`` characters: a message names a value, never floods.

    An int past Python's 4,300-digit limit for ``repr`` (``sys.set_int_max_str_digits``) is
    shown by its size, where ``repr`` itself would raise."""
    try:
        text = repr(value)
    except ValueError:
        kind = type(value).__name__
        digits = f" of about {int(value.bit_length() * 0.30103) + 1} digits" if isinstance(value, int) else ""
        return f"{'an' if kind[0] in 'aeiou' else 'a'} {kind}{digits}, too long to show"
    return text if len(text) <= width else f"{text[:width - 5]}…{text[-4:]}"


def refuse(name: str, value: Any, allowed: str, *, why: str = "",
           error: type[Exception] = InvalidValue) -> Exception:
    """The error for ``name=value`` in the house style, for a check of the caller's own.

    Returned, not raised, so that the caller writes ``raise refuse(...)`` and a reader (and a
    type checker) sees the function end there.
    """
    return error(f"{name}={shown(value)} is not allowed: {allowed}" + (f" ({why})" if why else ""))


def is_finite(value: Real) -> bool:
    """``math.isfinite``, false (not an OverflowError) for an int too large for a float."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def is_integer(value: Any) -> bool:
    """Whether ``value`` is an integer (a numpy one too), never a bool: :func:`whole`'s type
    test, for a caller that words its own refusal."""
    return isinstance(value, Integral) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
    """Whether ``value`` is a real number (NaN and infinities included), never a bool:
    :func:`number`'s type test, for a caller that words its own refusal."""
    return isinstance(value, Real) and not isinstance(value, bool)


def _bounds(low: float | None, high: float | None) -> str:
    """The range in words: " >= 1", " <= 9", " from 0 to 1", or nothing."""
    if low is not None and high is not None:
        return f" from {low} to {high}"
    if low is not None:
        return f" >= {low}"
    if high is not None:
        return f" <= {high}"
    return ""


def _inside(value: float, low: float | None, high: float | None) -> bool:
    return (low is None or value >= low) and (high is None or value <= high)


def whole(name: str, value: Any, *, low: int | None = None, high: int | None = None,
          why: str = "", error: type[Exception] = InvalidValue) -> int:
    """``value`` as an ``int``, if it is an integer (not a bool) from ``low`` to ``high``.

    Bounds are inclusive; ``low=1`` reads "a positive integer". A float, even ``2.0``, is
    refused: a float where a count belongs comes from arithmetic that should have been integer.
    """
    if isinstance(value, bool) or not isinstance(value, Integral) or not _inside(value, low, high):
        allowed = "a positive integer" if (low, high) == (1, None) else "an integer" + _bounds(low, high)
        raise refuse(name, value, allowed, why=why, error=error)
    return int(value)


def number(name: str, value: Any, *, low: float | None = None, high: float | None = None,
           finite: bool = True, why: str = "", error: type[Exception] = InvalidValue) -> float:
    """``value``, if it is a real number (not a bool, never NaN) from ``low`` to ``high``.

    Bounds are inclusive. ``finite=False`` admits ±infinity (within the bounds); NaN is refused
    always, since it compares false with every bound. The value is returned as given (an
    ``int`` stays an ``int``), so exact integer arithmetic downstream stays exact.
    """
    ok = (not isinstance(value, bool) and isinstance(value, Real) and value == value  # not NaN
          and (is_finite(value) or not finite) and _inside(value, low, high))  # fmt: skip
    if not ok:
        allowed = ("a finite number" if finite else "a number") + _bounds(low, high)
        raise refuse(name, value, allowed, why=why, error=error)
    return value


def positive(name: str, value: Any, *, why: str = "",
             error: type[Exception] = InvalidValue) -> float:
    """``value``, if it is a finite real number above zero (not a bool); returned as given."""
    ok = (not isinstance(value, bool) and isinstance(value, Real) and is_finite(value)
          and value > 0)  # fmt: skip
    if not ok:
        raise refuse(name, value, "a positive finite number", why=why, error=error)
    return value


def one_of(name: str, value: T, choices: Collection[T], *, why: str = "",
           error: type[Exception] = InvalidValue) -> T:
    """``value``, if it is one of ``choices`` (listed in the message, in their order).

    A bool is refused among numeric choices (``True`` is not the stage 1), as elsewhere here.
    """
    numeric = any(isinstance(c, (int, float)) and not isinstance(c, bool) for c in choices)
    try:
        known = value in choices
    except TypeError:  # an unhashable value asked of a set: not one of them either
        known = False
    if not known or (isinstance(value, bool) and numeric):
        raise refuse(name, value, "one of " + ", ".join(map(repr, choices)), why=why, error=error)
    return value


def flag(name: str, value: Any, *, why: str = "", error: type[Exception] = InvalidValue) -> bool:
    """``value``, if it is ``True`` or ``False`` (not 1, 0, or a string such as "yes")."""
    if not isinstance(value, bool):
        raise refuse(name, value, "True or False", why=why, error=error)
    return value
