"""The hosted-notebook path: labkit and its tested pins installed into a running kernel (Colab,
Kaggle, SageMaker Studio Lab, any Jupyter server the course did not set up), and what the
machine there can show.

    python -m labkit hosted-check     # the versions, the tier, the training dtype, what is missing

The setup cell (``scripts/hosted_setup_cell.py``, the README's copy of it held equal by a test)
clones the course and runs *this file* from the clone with ``runpy.run_path``, before any of
labkit's dependencies are installed: so everything this module imports at its top is the
standard library, and labkit's own modules run only in :func:`describe`, in a fresh interpreter
(``hosted-check``) once they are installed. :func:`setup` installs into the kernel's own
interpreter (``sys.executable -m pip``, what ``%pip`` does):

* labkit's dependencies (pyproject.toml's ``[project] dependencies``) but the Jupyter stack the
  host runs the notebook with (``HOST_STACK``), which must not change under a running kernel;
* each at the version requirements.txt pins, unless the host already has it at a version labkit
  supports (pyproject's floor): then the host's stays, and the cell says so. This is what
  ``./course`` does with LABKIT_KEEP_TORCH, for the same reason: a hosted GPU runtime ships a
  CUDA build of torch, and the pin from PyPI is gigabytes and may not match the host's driver;
* what those pull in, held to requirements.lock where the host does not have it already;
* labkit itself from the clone, without dependencies (``--no-deps``).

A second run finds it all in place (the installed labkit's files compared with the clone's by
the hashes in pip's RECORD) and installs nothing. If an upgrade replaced a package this kernel
had already imported, the cell says to restart the kernel and run it again.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

HOST_STACK = frozenset({"ipykernel", "jupyterlab"})
"""labkit's dependencies that the host runs the notebook with: never installed or changed here
(Colab, Kaggle and Studio Lab each pin their own, and a kernel's packages changed under it need
a restart)."""

Run = Callable[[Sequence[str]], "subprocess.CompletedProcess[str]"]


def _run(cmd: Sequence[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(cmd), capture_output=True, text=True, check=False)


def canonical(name: str) -> str:
    """A distribution's name as pip compares it (PEP 503): ``Nvidia_ML.py`` → ``nvidia-ml-py``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def release(version: str) -> tuple[int, ...]:
    """The release numbers of a version: (2, 6, 0) from "2.6.0+cu124" or "2.6.0rc1"."""
    m = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(p) for p in m.group().split(".")) if m else ()


def at_least(version: str, floor: str) -> bool:
    """Whether ``version`` meets a ``>=floor`` requirement (release numbers compared)."""
    have, want = release(version), release(floor)
    width = max(len(have), len(want))
    return have + (0,) * (width - len(have)) >= want + (0,) * (width - len(want))


def read_pins(path: Path) -> dict[str, str]:
    """``{canonical name: "name==version"}`` for each ``name==version`` line of a requirements
    file (requirements.txt, requirements.lock)."""
    pins = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([^\s;#]+)", line)
        if m:
            pins[canonical(m.group(1))] = f"{m.group(1)}=={m.group(2)}"
    return pins


def read_floors(pyproject: Path) -> dict[str, str]:
    """``{canonical name: floor}`` of pyproject.toml's ``[project] dependencies`` ("" where no
    ``>=`` is given). A regular expression, not tomllib: this runs on Python 3.10 too."""
    text = pyproject.read_text(encoding="utf-8")
    block = re.search(r"^dependencies\s*=\s*\[(.*?)^\]", text, re.S | re.M)
    if block is None:
        raise RuntimeError(f"{pyproject} has no [project] dependencies list: is this the course?")
    floors = {}
    for item in re.findall(r'"([^"]+)"', block.group(1)):
        m = re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:>=\s*([\w.]+))?", item)
        if m:
            floors[canonical(m.group(1))] = m.group(2) or ""
    return floors


def installed_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def installed_versions() -> dict[str, str]:
    """``{canonical name: version}`` of every distribution this interpreter sees."""
    found = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            found.setdefault(canonical(name), dist.version)
    return found


def torch_build() -> str | None:
    """"a CUDA 12.4 build" or "a CPU build" of the installed torch, read from torch/version.py
    without importing torch (seconds, and a kernel's CUDA state); None without torch."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        text = (Path(next(iter(spec.submodule_search_locations))) / "version.py").read_text()
    except OSError:
        return None
    m = re.search(r"^cuda\b[^=\n]*=\s*['\"]([^'\"]+)['\"]", text, re.M)
    return f"a CUDA {m.group(1)} build" if m else "a CPU build"


@dataclass
class Plan:
    """What :func:`setup` will install here, and what of the host's it keeps."""

    install: list[str] = field(default_factory=list)
    """Requirements at the tested version (``numpy==2.4.6``): labkit needs them and the host
    has them not, or older than labkit's floor."""
    kept: list[str] = field(default_factory=list)
    """The host's own versions kept, each with the tested one: "torch 2.6.0+cu124 (a CUDA 12.4
    build; tested: 2.13.0)"."""
    constraints: list[str] = field(default_factory=list)
    """requirements.lock's lines for the packages the host does not have yet."""
    labkit: bool = True
    """Whether labkit itself must be installed: absent, or its files differ from the source's."""

    @property
    def nothing_to_do(self) -> bool:
        return not self.install and not self.labkit


def plan(src: Path, have: dict[str, str] | None = None,
         torch_kind: Callable[[], str | None] = torch_build) -> Plan:  # fmt: skip
    """What to install into this interpreter from the course at ``src``. ``have`` is the
    installed ``{canonical name: version}`` (default: this interpreter's)."""
    have = installed_versions() if have is None else have
    pins, lock = read_pins(src / "requirements.txt"), read_pins(src / "requirements.lock")
    out = Plan(labkit=not labkit_matches(src))
    for name, floor in read_floors(src / "pyproject.toml").items():
        if name in HOST_STACK:
            continue
        pin = pins.get(name) or lock.get(name)
        if pin is None:
            raise RuntimeError(f"{src / 'requirements.txt'} pins no version of {name}, which "
                               "pyproject.toml lists: the repository is inconsistent")  # fmt: skip
        tested = pin.partition("==")[2]
        version = have.get(name)
        if version is None or (floor and not at_least(version, floor)):
            out.install.append(pin)
        elif version.partition("+")[0] != tested:  # 2.13.0+cpu is the tested 2.13.0
            build = torch_kind() if name == "torch" else None
            out.kept.append(f"{name} {version} ({build + '; ' if build else ''}tested: {tested})")
    out.constraints = [line for name, line in lock.items() if name not in have]
    return out


def _record_hash(path: Path) -> str:
    digest = hashlib.sha256(path.read_bytes()).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def labkit_matches(src: Path) -> bool:
    """Whether the installed labkit is the source at ``src``: an editable install of it, or a
    copy whose every file has the hash pip's RECORD gives (and no module of the source is
    missing from it)."""
    try:
        dist = importlib.metadata.distribution("labkit")
    except importlib.metadata.PackageNotFoundError:
        return False
    direct = json.loads(dist.read_text("direct_url.json") or "{}")
    if direct.get("dir_info", {}).get("editable"):
        return direct.get("url") == src.resolve().as_uri()
    recorded = {str(f): f.hash.value for f in dist.files or ()
                if f.hash is not None and f.parts[0] == "labkit"}  # fmt: skip
    if not recorded:
        return False
    for rel, value in recorded.items():
        path = src / rel
        if not path.is_file() or _record_hash(path) != value:
            return False
    modules = {p.relative_to(src).as_posix() for p in (src / "labkit").rglob("*.py")}
    return modules <= recorded.keys()


def _git(src: Path, *args: str, run: Run = _run) -> str | None:
    done = run(["git", "-C", str(src), *args])
    return done.stdout.strip() if done.returncode == 0 else None


def update_clone(src: Path, repo: str, ref: str, run: Run = _run) -> str:
    """Bring the clone at ``src`` to the newest commit of ``ref`` (a branch, tag or commit) of
    ``repo``: fetched, then checked out if it differs. Returns a line that says where it is."""
    _git(src, "remote", "set-url", "origin", repo, run=run)  # the cell's REPO may have changed
    if _git(src, "fetch", "-q", "--depth", "1", "origin", ref, run=run) is None:
        here = _git(src, "rev-parse", "--short", "HEAD", run=run) or "?"
        return f"{src} at {here} (could not fetch {ref!r} from {repo}: offline?)"
    head, fetched = (_git(src, "rev-parse", r, run=run) for r in ("HEAD", "FETCH_HEAD"))
    if head != fetched and _git(src, "checkout", "-q", "--detach", "FETCH_HEAD", run=run) is None:
        raise RuntimeError(f"git could not check out {ref!r} in {src}: delete that folder and "
                           "run the cell again")  # fmt: skip
    return f"{src} at {(fetched or '?')[:9]} ({ref})"


def _pip(args: Sequence[str], run: Run) -> list[str]:
    """Run pip in this interpreter; its complaints (resolver conflicts) as lines to print."""
    done = run([sys.executable, "-m", "pip", "install", "-q", *args])
    lines = done.stderr.splitlines()
    first_error = next((i for i, line in enumerate(lines) if line.startswith("ERROR")), None)
    if done.returncode != 0:
        tail = "\n".join(lines[max(0, len(lines) - 20) if first_error is None else first_error:][:40])
        raise RuntimeError(f"pip install {' '.join(args)} failed (exit {done.returncode}):\n{tail}")
    return [] if first_error is None else lines[first_error:][:20]


def _imported_distributions(names: set[str]) -> list[str]:
    """Which of the distributions ``names`` this process has already imported a module of.
    Private top-level modules do not count: setuptools' ``_distutils_hack`` is imported by
    every interpreter at its start (a .pth file), and replacing it harms nothing."""
    imported = set()
    for module, dists in importlib.metadata.packages_distributions().items():
        if module in sys.modules and not module.startswith("_"):
            imported |= {canonical(d) for d in dists} & names
    return sorted(imported)


def setup(src: str | os.PathLike[str], repo: str | None = None, ref: str | None = None, *,
          run: Run = _run) -> None:  # fmt: skip
    """Install labkit from the course at ``src`` into this interpreter, with its tested pins,
    and print what was done and what this machine can show (see the module's docstring).

    ``repo`` and ``ref`` are the setup cell's: when ``src`` is a clone of ``repo`` (not the
    folder ``repo`` itself), it is first brought to the newest commit of ``ref``.
    """
    start = time.monotonic()
    src = Path(src).resolve()
    where = str(src)
    if repo is not None and ref and Path(repo).resolve() != src:
        where = update_clone(src, repo, ref, run)
    todo = plan(src)
    before = installed_versions()
    print(f"labkit setup from {where} into {sys.executable}")
    if todo.nothing_to_do:
        print("  nothing to install: labkit and its dependencies are in place")
    complaints: list[str] = []
    if todo.install:
        with tempfile.NamedTemporaryFile("w", suffix=".txt", prefix="labkit-lock-",
                                         delete=False) as f:  # fmt: skip
            f.write("\n".join(todo.constraints) + "\n")
        try:
            complaints += _pip([*todo.install, "-c", f.name], run)
        finally:
            os.unlink(f.name)
        print(f"  installed the tested versions: {', '.join(todo.install)}")
    if todo.labkit:
        # --no-cache-dir: a wheel of this one commit would only pile up in pip's cache
        labkit_args = ["--no-deps", "--force-reinstall", "--no-cache-dir", str(src)]
        try:  # setuptools is there when torch is (torch needs it); else pip builds in isolation
            complaints += _pip(["--no-build-isolation", *labkit_args], run)
        except RuntimeError:
            complaints += _pip(labkit_args, run)
        print(f"  installed labkit {installed_version('labkit')} from {src} (--no-deps)")
    if todo.kept:
        print(f"  kept the host's: {'; '.join(todo.kept)}")
    after = installed_versions()
    changed = {n for n, v in after.items() if before.get(n) != v}
    pulled = len(changed) - len({canonical(r.partition('==')[0]) for r in todo.install}) - todo.labkit
    if pulled > 0:
        print(f"  and {pulled} package(s) they need, held to requirements.lock")
    for line in complaints:
        print(f"  pip: {line}")
    importlib.invalidate_caches()
    check = run([sys.executable, "-m", "labkit", "hosted-check"])
    print(check.stdout.rstrip())
    if check.returncode != 0:
        raise RuntimeError(f"labkit is installed but `python -m labkit hosted-check` failed:\n"
                           f"{check.stderr[-2000:]}")  # fmt: skip
    stale = _imported_distributions(changed)
    if stale:
        print(f"\nRESTART the kernel (Colab: Runtime → Restart session), then run this cell again: "
              f"this kernel had already imported {', '.join(stale)}, which setup replaced")
    print(f"setup took {time.monotonic() - start:.0f} s")


def describe() -> str:
    """What this machine shows the course: labkit's and torch's versions, the tier and its GPU,
    the training dtype and why, what a hosted runtime lacks, and where labkit writes."""
    import torch

    import labkit
    from labkit import hardware
    from labkit.jobs import procs

    tier = hardware.describe_tier()
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU build"
    lines = [f"labkit {labkit.__version__} ({Path(labkit.__file__).parent}), torch "
             f"{torch.__version__} ({build}), Python {sys.version.split()[0]}"]  # fmt: skip
    gpus = "; ".join(str(g) for g in tier.gpus) or "no CUDA GPU"
    lines.append(f"Tier: {tier.tier} ({gpus})")
    cc = tier.gpus[0].compute_capability if tier.tier != "cpu" and tier.gpus else None
    lines.append(hardware.autocast_dtype_for(cc).describe())
    missing = []
    if tier.tier == "cpu":
        missing.append("a GPU (GPU speed and memory are modelled from the published tables, "
                       "or read from the recordings of real GPUs that ship with labkit)")  # fmt: skip
    elif tier.tier == "single-gpu":
        missing.append("a second GPU (notebooks 02 and 03 run their ranks on the CPU over gloo; "
                       "NCCL needs one GPU per rank)")  # fmt: skip
    missing.append("a second machine (notebook 02b rehearses several nodes on this one)")
    for tool, what in (("nsys", "Nsight Systems"), ("ncu", "Nsight Compute"),
                       ("sbatch", "SLURM")):  # fmt: skip
        if shutil.which(tool) is None:
            missing.append(f"{what} (no `{tool}` on PATH)")
    lines.append("Not here: " + "; ".join(missing))
    had_home = bool(os.environ.get("LABKIT_HOME"))
    home = procs.labkit_home()
    how = ("LABKIT_HOME" if had_home
           else "the home folder is read-only or missing: a temporary folder"
           if os.environ.get("LABKIT_HOME") else "the default")  # fmt: skip
    lines.append(f"labkit's folder (job logs, exercise files): {home} ({how})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="labkit hosted-check",
        description="What this machine shows the course, as a hosted notebook's setup cell "
                    "prints it: versions, tier, training dtype, what is missing here.")  # fmt: skip
    parser.parse_args(argv)
    print(describe())
    return 0


if __name__ == "__main__":
    sys.exit(main())
