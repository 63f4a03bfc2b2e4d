"""Write requirements.lock: every package, direct or not, that requirements.txt resolves to.

requirements.txt pins the course's direct dependencies; what they pull in (pandas under HTA,
tornado under JupyterLab, ...) would otherwise float, and a release of any of them can break
a notebook between two CI runs. ``./course`` installs requirements.txt with this lock as
constraints (``pip install -r requirements.txt -c requirements.lock``): each package it
installs is held to the version CI tested, and a package the lock does not name (a CUDA
library that a GPU build of torch pulls in, a backport an older Python needs) is left free.

    python scripts/lock_requirements.py            # resolve with pip, write requirements.lock
    python scripts/lock_requirements.py --check    # exit 1 if the lock is not what pip resolves

The resolution is pip's own (``pip install --dry-run --ignore-installed --report``), on this
machine's Python and platform and with its pip configuration (the index, and where a CPU
build of torch comes from); local version labels (``2.13.0+cpu``) are dropped and the CUDA
libraries a GPU build pulls in are left out, so that the same lock admits the CUDA build of
the version. Reaches the package index; writes one file.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements.lock"
HEADER = """\
# Every package the tested install holds, direct or not: `./course` installs requirements.txt
# with this file as constraints (pip install -r requirements.txt -c requirements.lock).
# Written by `python scripts/lock_requirements.py`: pip's resolution of requirements.txt on
# {where}. Do not edit by hand. tests/test_packaging.py checks it against
# requirements.txt, environment.yml and, in the course's environment, what is installed.
"""


def resolve(requirements: Path) -> dict[str, str]:
    """{name: version} of everything pip would install for ``requirements`` from scratch."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--dry-run",
                        "--ignore-installed", "--report", str(report), "-r", str(requirements)],
                       check=True)  # fmt: skip
        installs = json.loads(report.read_text())["install"]
    return {normal(item["metadata"]["name"]): item["metadata"]["version"].split("+")[0]
            for item in installs if not cuda_only(item["metadata"]["name"])}  # fmt: skip


def normal(name: str) -> str:
    """A package name as PEP 503 compares it (``Jupyter_Client`` is ``jupyter-client``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def cuda_only(name: str) -> bool:
    """The CUDA libraries and Triton a GPU build of torch pulls in: never locked, so the same
    lock serves the CPU wheel CI tests and the CUDA build a GPU machine installs."""
    # nvidia-ml-py is NVML's Python binding, a direct pin of requirements.txt, not a CUDA library
    return (normal(name).startswith("nvidia-") and normal(name) != "nvidia-ml-py") or normal(name) == "triton"


def render(pins: dict[str, str]) -> str:
    where = f"CPython {platform.python_version()}, {platform.system()} {platform.machine()}"
    return HEADER.format(where=where) + "".join(f"{n}=={v}\n" for n, v in sorted(pins.items()))


def read(path: Path = LOCK) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            pins[name] = version
    return pins


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="compare, write nothing")
    args = p.parse_args(argv)
    pins = resolve(ROOT / "requirements.txt")
    if args.check:
        old = read() if LOCK.exists() else {}
        changed = sorted(set(old.items()) ^ set(pins.items()))
        for name, version in changed:
            print(f"{'lock ' if old.get(name) == version else 'pip  '}{name}=={version}")
        print("requirements.lock is " + ("up to date" if not changed else "out of date"))
        return 1 if changed else 0
    LOCK.write_text(render(pins))
    print(f"wrote {LOCK.name}: {len(pins)} packages")
    return 0


if __name__ == "__main__":
    sys.exit(main())
