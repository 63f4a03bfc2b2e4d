"""scripts/gpu_check.sh, the GPU tier's one script, exercised on the CPU.

``--dry-run`` runs every step of the real check at smoke size with CUDA hidden, so the
whole script (step runner, timeouts, environment report, tests, notebooks, benchmarks,
summary) is tested here on every push; only the sizes and the device differ on a GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
# The notebook step runs on two tiny notebooks: every course notebook runs on its own in
# tests/test_notebooks.py, and running two of them again here would test the course twice and
# the script no better.
TINY = ("00_first.ipynb", "01_second.ipynb")
BENCHMARKS = ("bench_gpu_throughput.json", "bench_train_step.json", "bench_sampler.json",
              "bench_launch.json")


def gpu_check(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        cwd=ROOT,
        env=env,
        text=True,
        capture_output=True,
        timeout=timeout,
        check=False,
    )


def tiny_notebooks(folder: Path) -> Path:
    """Two notebooks with a parameters cell, like the course's, that take a second each."""
    import nbformat

    for name in TINY:
        nb = nbformat.v4.new_notebook()
        nb.metadata["kernelspec"] = {"name": "python3", "language": "python",
                                     "display_name": "Python 3"}  # fmt: skip
        params = nbformat.v4.new_code_cell('size = "lab"')
        params.metadata["tags"] = ["parameters"]
        nb.cells = [params, nbformat.v4.new_code_cell(
            f"import time\ntime.sleep(1)\nprint({name!r}, 'ran at size', size)")]
        nbformat.write(nb, folder / name)
    return folder


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """One dry run for the module's tests; two tiny notebooks, run side by side, exercise the
    notebook step."""
    out = tmp_path_factory.mktemp("gpu-check")
    nbs = tiny_notebooks(tmp_path_factory.mktemp("notebooks"))
    proc = gpu_check("--dry-run", "--out", str(out), "--notebook-dir", str(nbs),
                     "--notebooks", "0[01]_*.ipynb", "--parallel", "2")  # fmt: skip
    return proc, out


@pytest.mark.slow
def test_dry_run_passes_every_step(dry_run):
    proc, out = dry_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mode"] == "dry-run (CPU)"
    assert summary["ok"] is True and summary["failed_steps"] == []
    names = [s["name"] for s in summary["steps"]]
    assert names == [
        "env",
        "gpu-tests",
        "record-trace",
        "record-profile",
        "bench-gpu-throughput",
        "bench-train-step",
        "bench-sampler",
        "bench-precision",
        "recordings",
        "notebook:00_first",
        "notebook:01_second",
        "bench-launch",
    ]
    status = {s["name"]: s["status"] for s in summary["steps"]}
    assert status["record-trace"] == "skipped"  # real NVML readings only: never on the CPU
    # The recorders ran their whole path on the CPU, and passed by being refused for it.
    step = {s["name"]: s for s in summary["steps"]}
    assert status["record-profile"] == "ok" and "--device cpu" in step["record-profile"]["command"]
    assert status["recordings"] == "ok" and step["recordings"]["exit_code"] == 1
    assert "refused the CPU results" in step["recordings"]["note"]
    for s in summary["steps"]:
        assert s["status"] in ("ok", "skipped"), s
        assert s["timeout_s"] is None or s["timeout_s"] > 0
    assert "all steps passed" in proc.stdout


@pytest.mark.slow
def test_dry_run_leaves_the_results(dry_run):
    _, out = dry_run
    env = json.loads((out / "env.json").read_text())
    assert env["tier"] == "cpu" and env["mode"] == "dry-run (CPU)"
    assert env["torch"]["version"] == torch.__version__
    nb = json.loads((out / "notebooks" / TINY[0]).read_text())
    assert nb["metadata"]["papermill"]["parameters"] == {"size": "smoke"}
    printed = "".join("".join(o.get("text", "")) for c in nb["cells"] for o in c.get("outputs", []))
    assert "00_first.ipynb ran at size smoke\n" in printed
    for name in BENCHMARKS:
        record = json.loads((out / name).read_text())
        assert record["device"] == "cpu" and record["samples_s"], name
    log = (out / "gpu_check.log").read_text()
    assert "=== bench-launch: ok" in log
    assert "dry run on the CPU, size smoke" in log and "refused it as expected" in log
    assert "a CPU run (device 'cpu'); a recording holds figures measured on a GPU" in log
    assert "=== recordings: ok (refused as expected, exit 1)" in log
    assert not (out / "profiles").exists() and not (out / "recordings").exists()  # nothing to ship
    # --parallel 2: the second notebook started before the first one's output was collected
    started = log.index("=== notebook:01_second started")
    assert started < log.index("=== notebook:00_first output:")
    for name in TINY:
        assert json.loads((out / "notebooks" / name).read_text())["cells"]
    # few files, shallow: what the device machine's file return allows
    files = [p for p in out.rglob("*") if p.is_file()]
    assert all(len(p.relative_to(out).parts) <= 2 for p in files)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_it_refuses_and_points_to_dry_run(tmp_path):
    proc = gpu_check("--out", str(tmp_path / "o"), timeout=60)
    assert proc.returncode == 2
    assert "no NVIDIA GPU found (nvidia-smi / torch.cuda)" in proc.stderr
    assert "--dry-run" in proc.stderr
    assert not (tmp_path / "o").exists()  # nothing started


@pytest.mark.slow
def test_a_spent_budget_fails_the_steps_and_bundle_packs_the_rest(tmp_path):
    """--timeout-s 1: no step gets time, each is listed as not run and the run fails;
    --bundle leaves two files; an empty wheel folder is a failed step, not a crash."""
    out, wheels = tmp_path / "o", tmp_path / "wheels"
    wheels.mkdir()
    proc = gpu_check(
        "--dry-run",
        "--timeout-s",
        "1",
        "--bundle",
        "--wheels",
        str(wheels),
        "--out",
        str(out),
        timeout=60,
    )
    assert proc.returncode == 1
    summary = json.loads((out / "summary.json").read_text())
    status = {s["name"]: s["status"] for s in summary["steps"]}
    assert status.pop("wheels") == "failed"
    assert set(status.values()) <= {"not-run", "skipped"} and "not-run" in status.values()
    assert summary["ok"] is False and "env" in summary["failed_steps"]
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.tar.gz", "summary.json"]
    with tarfile.open(out / "gpu_check.tar.gz") as tar:
        assert "gpu_check.log" in tar.getnames()


@pytest.mark.parametrize(
    "args", [["--bogus"], ["--timeout-s", "soon"], ["--wheels"], ["--parallel", "0"]]
)
def test_bad_arguments_exit_2_naming_them(args, tmp_path):
    proc = gpu_check("--dry-run", "--out", str(tmp_path / "o"), *args, timeout=30)
    assert proc.returncode == 2
    assert args[0] in proc.stderr or (len(args) > 1 and args[1] in proc.stderr)


# --- scripts/install_wheels.py: what the offline GPU machine gets from a wheel folder ----------


def _wheel(folder: Path, name: str, version: str = "0.1", tag: str = "py3-none-any") -> Path:
    """A minimal, valid pure-Python wheel of a package ``name`` (test data)."""
    import base64
    import hashlib
    import zipfile

    info = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": "VALUE = 1\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{info}/WHEEL": f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: {tag}\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        record.append(f"{path},sha256={digest.decode()},{len(text.encode())}")
    files[f"{info}/RECORD"] = "\n".join([*record, f"{info}/RECORD,,"]) + "\n"
    whl = folder / f"{name}-{version}-{tag}.whl"
    with zipfile.ZipFile(whl, "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
    return whl


def test_install_wheels_takes_only_what_the_image_lacks(tmp_path):
    wheels, target = tmp_path / "wheels", tmp_path / "site"
    wheels.mkdir()
    _wheel(wheels, "labkit_test_missing")  # the image lacks it: installed
    _wheel(wheels, "psutil", "0.0.1")  # the image has it: its own copy is kept
    _wheel(wheels, "torch", "9.9")  # the image's torch stack: never from a wheel
    _wheel(wheels, "numpy", "9.9")
    _wheel(wheels, "labkit_test_other_python", tag="cp39-cp39-manylinux_2_17_x86_64")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "install_wheels.py"),
                           str(wheels), str(target)], capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr  # the cp39 wheel failed...
    assert (target / "labkit_test_missing" / "__init__.py").is_file()  # ...and cost only itself
    assert not (target / "psutil").exists() and not (target / "torch").exists()
    assert "kept the image's own: psutil" in proc.stdout
    assert "never from a wheel (the image's torch stack): numpy, torch" in proc.stdout
    assert "FAILED (built for another Python or platform?): labkit_test_other_python" in proc.stdout


@pytest.mark.slow
def test_only_runs_the_named_groups_and_bad_options_are_named(tmp_path):
    """--only splits the steps between two invocations that share one device session: here
    only the environment report and the gpu tests run (skipped on a CPU, which is still a
    step), and no notebook or benchmark starts."""
    out = tmp_path / "o"
    proc = gpu_check("--dry-run", "--only", "gpu-tests", "--out", str(out), timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps = [s["name"] for s in json.loads((out / "summary.json").read_text())["steps"]]
    assert steps == ["env", "gpu-tests"]
    assert not any((out / "notebooks").iterdir())

    bad = gpu_check("--dry-run", "--only", "gpu-tests,notebook", "--out", str(tmp_path / "b"))
    assert bad.returncode == 2
    assert "--only notebook is not a step group" in bad.stderr and "notebooks" in bad.stderr
    bad = gpu_check("--dry-run", "--notebook-timeout-s", "4m", "--out", str(tmp_path / "c"))
    assert bad.returncode == 2 and "--notebook-timeout-s=4m is not allowed" in bad.stderr
