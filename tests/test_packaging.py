"""The setup promises in README.md hold: pins agree, CI runs the README command, imports are inert."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
CONDA_NAMES = {"pytorch": "torch"}  # conda-forge name -> PyPI name


def pins_from_requirements(path: Path = ROOT / "requirements.txt") -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            pins[name.lower()] = version
    return pins


def pins_from_environment_yml() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "environment.yml").read_text().splitlines():
        m = re.fullmatch(r"\s+- ([A-Za-z0-9_.-]+)==([^\s]+)\s*", line)
        if m:
            pins[CONDA_NAMES.get(m[1], m[1]).lower()] = m[2]
    return pins


def test_conda_and_pip_routes_pin_the_same_packages_and_versions():
    pip_pins = pins_from_requirements()
    assert "torch" in pip_pins and pip_pins["torch"] == "2.13.0"
    assert pins_from_environment_yml() == pip_pins


def pins_from_lock() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            pins[name] = version
    return pins


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_the_lock_holds_every_direct_pin_at_its_version():
    lock = pins_from_lock()
    for name, version in pins_from_requirements().items():
        assert lock.get(_normal(name)) == version, (
            f"requirements.txt pins {name}=={version}, requirements.lock has "
            f"{lock.get(_normal(name))}: run python scripts/lock_requirements.py")


def test_the_lock_agrees_with_the_conda_route():
    lock = pins_from_lock()
    for name, version in pins_from_environment_yml().items():
        assert lock.get(_normal(name)) == version, f"environment.yml: {name}=={version}"


def test_the_lock_is_exact_and_portable():
    text = (ROOT / "requirements.lock").read_text()
    lines = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    names = [line.split("==")[0] for line in lines]
    assert names == sorted(set(names)), "requirements.lock: names out of order or twice"
    for line in lines:
        assert re.fullmatch(r"[a-z0-9-]+==[0-9][0-9A-Za-z.]*", line), line  # no +cpu, no ranges


def test_course_installs_with_the_lock_as_constraints():
    course = (ROOT / "course").read_text()
    assert re.search(r"pip install -q -r \"\$reqs\" -c \"\$lock\"", course)
    assert "lock=requirements.lock" in course
    assert "requirements.lock" in re.search(r"want=\$\((.*)\)", course)[1]  # a new lock reinstalls


def test_the_course_environment_holds_the_locked_versions():
    """In the environment ./course made (CI's), every locked package is at its locked version."""
    from importlib import metadata

    if Path(sys.prefix).resolve() != (ROOT / ".venv").resolve():
        pytest.skip(f"not the course's environment ({sys.prefix}): the lock binds ./course's only")
    wrong = []
    for name, version in pins_from_lock().items():
        try:
            installed = metadata.version(name).split("+")[0]
        except metadata.PackageNotFoundError:
            continue  # a package this Python's resolution does not need (a backport, say)
        if installed != version:
            wrong.append(f"{name} {installed} (locked {version})")
    assert not wrong, "installed versions differ from requirements.lock: " + ", ".join(wrong)


def test_hta_is_an_optional_extra_named_by_its_pin_when_missing(monkeypatch, tmp_path):
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from 3.11")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not any(d.startswith("holistictraceanalysis") for d in project["dependencies"])
    assert project["optional-dependencies"]["traces"] == ["holistictraceanalysis>=0.5"]
    from labkit.profiling import hta

    pin = f"holistictraceanalysis=={pins_from_requirements()['holistictraceanalysis']}"
    assert pin in hta.HTA_MISSING
    monkeypatch.setitem(sys.modules, "hta.trace_analysis", None)  # import fails as if absent
    report = hta.hta_report(tmp_path)
    assert not report.available and pin in report.describe()


def test_tested_pins_satisfy_the_package_ranges():
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from 3.11")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = pins_from_requirements() | pins_from_requirements(ROOT / "requirements-book.txt")
    # the `rapids` extra is the GPU stack (CUDA wheels): never in the tested CPU install, so
    # nothing pins it; notebook 08 names the extra where it is absent
    ranges = project["dependencies"] + [d for name, extra in project["optional-dependencies"].items()
                                        if name != "rapids" for d in extra]  # fmt: skip
    for spec in map(Requirement, ranges):
        name = spec.name.lower()
        assert name in pins, f"{name} is a dependency in pyproject.toml but not pinned"
        assert spec.specifier.contains(pins[name]), f"{name}=={pins[name]} is outside {spec}"


def test_ci_runs_the_readme_test_command_verbatim():
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"^\s*(\./course test)\s*$", readme, flags=re.M)
    assert commands, "README.md must show the test command './course test' on a line of its own"
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert commands[0] in [line.strip() for line in ci]


def test_importing_labkit_starts_nothing():
    """No threads, no CUDA context, no child processes, no files written at import."""
    modules = sorted(
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for p in (ROOT / "labkit").rglob("*.py")
        if p.stem != "__main__"
    )
    code = (
        "import os, sys, threading, psutil, torch\n"
        f"for m in {modules!r}: __import__(m)\n"
        "assert threading.active_count() == 1, threading.enumerate()\n"
        "assert not torch.cuda.is_initialized()\n"
        "assert not psutil.Process().children(), 'a child process was started'\n"
        "print('ok', len(sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok")


def test_a_rank_does_not_import_the_launcher():
    """A worker module is what every rank imports: its ``run()`` (the caller's side) imports
    the launcher when called, so a rank does not pay for the launcher, its CLI and its
    supervisor (0.16 s a rank on 2 busy cores, measured with -X importtime)."""
    workers = sorted(p.stem for p in (ROOT / "labkit" / "workers").glob("*.py")
                     if not p.stem.startswith("_") and not p.stem.endswith(("_report", "_config")))  # fmt: skip
    code = (
        "import sys\n"
        f"for w in {workers!r}: __import__('labkit.workers.' + w)\n"
        "print(sorted(m for m in ('labkit.jobs.launch', 'labkit.jobs.cli', "
        "'labkit.jobs.supervisor') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert len(workers) > 10 and out.stdout.strip() == "[]", out.stdout


def test_ruff_is_clean():
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_pinned_torchao_float8_imports_with_the_installed_torch():
    """torchao is imported lazily (labkit.fp8), so only this test shows that the pinned
    version loads with the pinned torch: its float8 training API, in a fresh interpreter."""
    pins = pins_from_requirements()
    code = (
        "import torch, torchao\n"
        "from torchao.float8 import Float8LinearConfig, convert_to_float8_training\n"
        "from torchao.float8.float8_linear import Float8Linear\n"
        "print(torch.__version__, torchao.__version__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr
    torch_version, torchao_version = out.stdout.split()[-2:]
    assert torchao_version == pins["torchao"], (
        f"installed torchao {torchao_version}, pinned {pins['torchao']}"
    )
    if torch_version.split("+")[0] == pins["torch"]:
        return  # the pair requirements.txt promises
    pytest.skip(f"torchao imported, but with torch {torch_version}, not the pinned {pins['torch']}")


def test_labkit_names_the_pinned_torchao():
    from labkit import fp8

    assert fp8.TORCHAO_VERSION == pins_from_requirements()["torchao"]
