"""labkit.dtypes: the one table of format names, checked against torch, and the modules that
take a dtype by name agreeing with it."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from labkit import dtypes, formulas, precision, roofline, train

ROWS = {f.name: f for f in dtypes.FORMATS}
SPELLINGS = [(s, f) for f in dtypes.FORMATS for s in f.spellings]


@pytest.mark.parametrize(("spelling", "fmt"), SPELLINGS, ids=[s for s, _ in SPELLINGS])
def test_every_spelling_resolves_in_any_case_and_with_the_torch_prefix(spelling, fmt):
    for given in (spelling, spelling.upper(), f"torch.{spelling}"):
        assert dtypes.find(given) is fmt
        assert dtypes.lookup(given) is fmt


@pytest.mark.parametrize("fmt", [f for f in dtypes.FORMATS if f.storage], ids=lambda f: f.name)
def test_bytes_agree_with_torch_and_a_dtype_object_resolves(fmt):
    dtype = getattr(torch, fmt.torch_name, None)
    if dtype is None:
        pytest.skip(f"torch {torch.__version__} has no torch.{fmt.torch_name}")
    assert torch.empty(0, dtype=dtype).element_size() == fmt.bytes
    assert dtypes.find(dtype) is fmt and dtypes.torch_dtype(fmt.short) is dtype
    assert (fmt.stored_as, fmt.floating) == (fmt.torch_name, dtype.is_floating_point)


def test_tf32_is_a_row_but_no_storage_dtype():
    tf32 = dtypes.lookup("TF32")
    assert (tf32.name, tf32.storage, tf32.torch_name) == ("tf32", False, None)
    assert not hasattr(torch, "tf32")
    # its values live in float32 tensors: 4 bytes, as torch says for float32
    assert tf32.stored_as == "float32"
    assert tf32.bytes == torch.empty(0, dtype=torch.float32).element_size()
    with pytest.raises(ValueError, match=r"not a dtype.*set_float32_matmul_precision\('high'\)"):
        dtypes.torch_dtype("tf32")


def test_no_spelling_names_two_formats():
    all_spellings = [s for s, _ in SPELLINGS]
    assert len(all_spellings) == len(set(all_spellings))
    assert all(s == s.lower() for s in all_spellings)


@pytest.mark.parametrize(
    ("given", "says"),
    [
        ("fp12", r"dtype='fp12' is not allowed; allowed: 'float64', 'float32', 'tf32'"),
        ("fp8", r"fp8 names two formats; say 'fp8_e4m3' .* or 'fp8_e5m2'"),
        (torch.int32, r"dtype=torch\.int32 is not allowed; allowed: .*'bool'"),
        (None, r"dtype=None is not allowed"),
    ],
)
def test_unknown_names_are_refused_naming_what_is_allowed(given, says):
    assert dtypes.find(given) is None
    with pytest.raises(ValueError, match=says):
        dtypes.lookup(given)


def test_lookup_among_some_rows_names_those_and_their_spellings():
    with pytest.raises(ValueError) as e:
        dtypes.lookup("int8", ["float32", "bf16"], what="precision")
    assert str(e.value).startswith(
        "precision='int8' is not allowed; allowed: 'float32', 'bfloat16'"
    )
    assert "also spelled 'fp32', 'float', 'bf16'" in str(e.value)
    with pytest.raises(ValueError, match=r"tf32 is a tensor-core mode .* pass 'float32'"):
        dtypes.lookup("tf32", ["float32", "bf16"])  # only storage dtypes allowed: say why
    with pytest.raises(ValueError, match=r"not a row of labkit\.dtypes\.FORMATS"):
        dtypes.lookup("fp32", ["fp12"])


def test_a_format_missing_from_the_torch_build_is_refused(monkeypatch):
    monkeypatch.delattr(torch, "float8_e5m2")
    with pytest.raises(ValueError, match=r"has no torch\.float8_e5m2; install a torch"):
        dtypes.torch_dtype("fp8_e5m2")


# --- the modules that take names agree with the table -----------------------------------------


def test_formulas_names_and_bytes_come_from_the_table():
    assert formulas.DTYPE_BYTES == {f.name: f.bytes for f in dtypes.FORMATS if f.storage}
    for spelling, fmt in SPELLINGS:
        if fmt.storage:
            assert formulas.dtype_name(spelling) == fmt.name
            assert formulas.dtype_bytes(spelling) == fmt.bytes
    with pytest.raises(ValueError, match=r"got 'tf32': tf32 is a tensor-core mode"):
        formulas.dtype_name("tf32")
    with pytest.raises(ValueError, match="fp8 names two formats"):
        formulas.dtype_bytes("fp8")


def test_precision_names_come_from_the_table():
    for short in precision.FORMAT_NAMES:
        fmt = dtypes.lookup(short)
        assert precision.TORCH_DTYPE_NAMES.get(short) == fmt.torch_name
        assert all(precision.format_name(s) == short for s in fmt.spellings)
        assert precision.FORMATS[short].storage_bytes == fmt.bytes
    assert set(precision.ALIASES) == {s for n in precision.FORMAT_NAMES
                                      for s in dtypes.lookup(n).spellings}  # fmt: skip
    with pytest.raises(ValueError, match=r"not a format labkit\.precision knows"):
        precision.format_name("float64")  # in the table, but no mixed-precision format


def test_roofline_and_train_names_come_from_the_table():
    for name in roofline.PRECISIONS:
        assert all(roofline.precision_name(s) == name for s in dtypes.lookup(name).spellings)
    assert roofline.matmul_traffic(1, 1, 1, "tf32")[1] == 3 * dtypes.lookup("float32").bytes
    assert train.DTYPES == {n: dtypes.torch_dtype(n) for n in ("float32", "bfloat16", "float16")}


def test_importing_the_table_imports_no_torch():
    code = "import sys, labkit.dtypes, labkit.formulas; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
