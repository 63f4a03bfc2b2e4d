"""labkit.validate: each check accepts what it says, refuses the rest in one message style."""

from __future__ import annotations

import re
from fractions import Fraction

import numpy as np
import pytest

from labkit.errors import LabkitError
from labkit.validate import InvalidValue, flag, number, one_of, positive, refuse, whole

NAN, INF = float("nan"), float("inf")


def message(name: str, value: object, allowed: str) -> str:
    return "^" + re.escape(f"{name}={value!r} is not allowed: {allowed}") + "$"


# --- whole -------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [1, 7, np.int64(3), 2**70])
def test_whole_accepts_integers_and_returns_a_python_int(value):
    got = whole("n", value, low=1)
    assert got == value and type(got) is int


@pytest.mark.parametrize("value", [True, False, 2.0, 1.5, "3", None, NAN, Fraction(2, 1)])
def test_whole_refuses_bools_floats_and_other_types(value):
    with pytest.raises(InvalidValue, match=message("n", value, "an integer")):
        whole("n", value)


def test_whole_bounds_are_inclusive_and_named():
    assert whole("n", 0, low=0) == 0 and whole("n", 3, high=3) == 3
    assert whole("n", -5, low=-5, high=-5) == -5
    with pytest.raises(InvalidValue, match=message("n", 0, "a positive integer")):
        whole("n", 0, low=1)
    with pytest.raises(InvalidValue, match=message("n", -1, "an integer >= 0")):
        whole("n", -1, low=0)
    with pytest.raises(InvalidValue, match=message("n", 4, "an integer <= 3")):
        whole("n", 4, high=3)
    with pytest.raises(InvalidValue, match=message("rank", 4, "an integer from 0 to 3")):
        whole("rank", 4, low=0, high=3)


def test_whole_refuses_true_even_where_1_is_allowed():
    with pytest.raises(InvalidValue, match=message("n_layer", True, "a positive integer")):
        whole("n_layer", True, low=1)


# --- number ------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, -3, 0.5, np.float32(2.5), Fraction(1, 3)])
def test_number_accepts_reals_and_returns_them_as_given(value):
    assert number("x", value) is value


@pytest.mark.parametrize("value", [True, "1", None, 1j, NAN, INF, -INF])
def test_number_refuses_bools_non_reals_nan_and_infinity(value):
    with pytest.raises(InvalidValue, match=message("x", value, "a finite number")):
        number("x", value)


def test_number_with_finite_false_admits_infinity_but_never_nan():
    assert number("t", INF, finite=False) == INF
    assert number("t", -INF, finite=False, high=0) == -INF
    with pytest.raises(InvalidValue, match=message("t", NAN, "a number >= 0")):
        number("t", NAN, low=0, finite=False)
    with pytest.raises(InvalidValue, match=message("t", -INF, "a number >= 0")):
        number("t", -INF, low=0, finite=False)


def test_number_bounds_are_inclusive_and_named():
    assert number("p", 0, low=0, high=1) == 0 and number("p", 1.0, low=0, high=1) == 1.0
    with pytest.raises(InvalidValue, match=message("p", 1.5, "a finite number from 0 to 1")):
        number("p", 1.5, low=0, high=1)
    with pytest.raises(InvalidValue, match=message("p", -0.1, "a finite number >= 0")):
        number("p", -0.1, low=0)
    with pytest.raises(InvalidValue, match=message("p", 2, "a finite number <= 1")):
        number("p", 2, high=1)


# --- positive ----------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [1, 1e-300, 2.5, np.float64(3.0)])
def test_positive_accepts_finite_numbers_above_zero_as_given(value):
    assert positive("lr", value) is value


@pytest.mark.parametrize("value", [0, 0.0, -1, True, NAN, INF, -INF, "1", None])
def test_positive_refuses_zero_negatives_bools_nan_and_infinity(value):
    with pytest.raises(InvalidValue, match=message("lr", value, "a positive finite number")):
        positive("lr", value)


# --- one_of and flag ---------------------------------------------------------------------------


def test_one_of_returns_the_choice_and_lists_the_choices_in_order():
    assert one_of("kind", "b", ("a", "b")) == "b"
    with pytest.raises(InvalidValue, match=message("kind", "c", "one of 'a', 'b'")):
        one_of("kind", "c", ("a", "b"))


def test_one_of_refuses_a_bool_among_numbers_and_unhashable_values():
    assert one_of("stage", 1, (0, 1, 2)) == 1
    with pytest.raises(InvalidValue, match=message("stage", True, "one of 0, 1, 2")):
        one_of("stage", True, (0, 1, 2))
    with pytest.raises(InvalidValue, match=r"^stage=\[1\] is not allowed: one of "):
        one_of("stage", [1], {0, 1})
    assert one_of("strict", True, (True, False)) is True  # bools are fine among bools


def test_flag_takes_only_true_or_false():
    assert flag("bias", True) is True and flag("bias", False) is False
    for value in (1, 0, "yes", None, np.bool_(True)):
        with pytest.raises(InvalidValue, match=message("bias", value, "True or False")):
            flag("bias", value)


# --- the shared parts: why, error=, the class --------------------------------------------------


def test_why_follows_what_is_allowed_in_parentheses():
    with pytest.raises(InvalidValue, match=message("nproc", 0, "a positive integer (processes to start)")):
        whole("nproc", 0, low=1, why="processes to start")


def test_a_caller_can_name_its_own_error_class():
    class ExamLike(ValueError):
        pass

    for check in (lambda: whole("n", 0, low=1, error=ExamLike),
                  lambda: number("m", NAN, error=ExamLike),
                  lambda: positive("m", 0, error=ExamLike),
                  lambda: one_of("k", "z", ("a",), error=ExamLike),
                  lambda: flag("f", 1, error=ExamLike)):  # fmt: skip
        with pytest.raises(ExamLike, match="is not allowed"):
            check()


def test_invalid_value_is_a_value_error_and_a_labkit_error():
    with pytest.raises(ValueError) as e:
        whole("n", -1, low=0)
    assert isinstance(e.value, LabkitError) and type(e.value) is InvalidValue


def test_refuse_builds_the_same_message_for_a_caller_s_own_check():
    e = refuse("seq_len", 100, "a multiple of 64", why="the kernel's tile")
    assert isinstance(e, InvalidValue)
    assert str(e) == "seq_len=100 is not allowed: a multiple of 64 (the kernel's tile)"


@pytest.mark.parametrize("check", [positive, number])
def test_an_int_too_large_for_a_float_is_refused_not_overflowed(check):
    with pytest.raises(InvalidValue, match=r"t=an int of about 5001 digits"):
        check("t", 10**5000)
