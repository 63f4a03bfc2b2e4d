"""Install, from a folder of wheels, the packages a GPU image lacks, into a private folder.

    python scripts/install_wheels.py WHEEL_FOLDER TARGET_FOLDER

``scripts/gpu_check.sh --wheels`` runs this on a machine without network, then puts TARGET on
PYTHONPATH. Entries on PYTHONPATH come before site-packages, so whatever lands in TARGET
shadows the image's own copy. Hence:

- never torch, numpy, triton or the CUDA libraries (``nvidia_*_cu12``): the image's torch was
  built against its own, and a different numpy under its matplotlib breaks every plot;
- never a package the image already has (its versions were installed to work together),
  except nvidia-ml-py: pure Python, and the NVML bindings must be new enough for GPM;
- one wheel at a time, so a wheel built for another Python costs that package only.

Prints what it installed, kept and refused, and exits 1 if any wheel failed to install.
"""

from __future__ import annotations

import importlib.metadata as md
import re
import subprocess
import sys
from pathlib import Path

NEVER = re.compile(r"^(torch|numpy|triton|nvidia_.+_cu\d+)$")
ALWAYS = frozenset({"nvidia_ml_py"})


def dist_name(wheel: Path) -> str:
    """The normalised distribution name of a wheel file (PEP 427: name-version-...whl)."""
    return re.sub(r"[-_.]+", "_", wheel.name.split("-")[0]).lower()


def installed_version(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    folder, target = Path(argv[0]), argv[1]
    installed, kept, refused, failed = [], [], [], []
    for wheel in sorted(folder.glob("*.whl")):
        name = dist_name(wheel)
        have = installed_version(name)
        if NEVER.match(name):
            refused.append(name)
        elif have is not None and name not in ALWAYS:
            kept.append(f"{name} {have}")
        else:
            cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                   "--no-compile", "--no-cache-dir", "--upgrade", "--target", target, str(wheel)]  # fmt: skip
            ok = subprocess.run(cmd, check=False).returncode == 0
            (installed if ok else failed).append(wheel.name)
    print(f"installed {len(installed)}: {', '.join(installed) or '-'}")
    print(f"kept the image's own: {', '.join(kept) or '-'}")
    print(f"never from a wheel (the image's torch stack): {', '.join(refused) or '-'}")
    if failed:
        print(f"FAILED (built for another Python or platform?): {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
