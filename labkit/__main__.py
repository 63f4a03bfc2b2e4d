"""Command line: ``python -m labkit <command>`` (also installed as ``labkit``).

    labkit doctor      an instructor's pre-flight check of this machine (--json for scripts)
    labkit tier        which tier this machine runs the course in, and what that can show
    labkit cleanup     end processes left by jobs whose notebook kernel was killed
    labkit notebooks   regenerate the learners' notebooks from solutions/ (--check to compare)
"""

from __future__ import annotations

import argparse
import sys


def _tier(_: argparse.Namespace) -> int:
    from labkit import hardware

    print(hardware.describe_tier())
    print(hardware.cpu_info())
    status = hardware.nvml_status()
    print(f"NVML: {'ok' if status.ok else 'unavailable'}: {status.message}")
    return 0


def _cleanup(_: argparse.Namespace) -> int:
    from labkit import launch

    ended = launch.cleanup()
    n_pids = sum(len(job["pids"]) for job in ended)
    print(f"ended {n_pids} process(es) left by {len(ended)} job(s)" if ended
          else "no leftover job processes")
    return 0


def _notebooks(args: argparse.Namespace) -> int:
    from labkit import nbgen

    return nbgen.main(["--check"] if args.check else [])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["doctor"]:  # doctor parses its own options
        from labkit import doctor

        return doctor.main(argv[1:])
    parser = argparse.ArgumentParser(prog="labkit", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="pre-flight check of this machine (see: labkit doctor -h)")
    sub.add_parser("tier", help="show this machine's tier and what it can show").set_defaults(
        fn=_tier)
    sub.add_parser("cleanup", help="end leftovers of jobs whose kernel died").set_defaults(
        fn=_cleanup)
    nb = sub.add_parser("notebooks", help="generate notebooks/ from solutions/")
    nb.add_argument("--check", action="store_true", help="only compare; exit 1 on drift")
    nb.set_defaults(fn=_notebooks)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
