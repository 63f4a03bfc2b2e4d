"""Is this commit slower than another? The same work at two commits, side by side.

    python -m benchmarks.bench_commits fbaa9c7                  # that commit against HEAD
    python -m benchmarks.bench_commits fbaa9c7 --rounds 2 --notebooks 00 02 --record

What CI pays for, at each commit, from that commit's own code:

* ``import labkit`` in a fresh interpreter (every test process, kernel and rank pays it);
* one 2-rank job of the all-reduce worker through that commit's ``launch.run`` (gloo, CPU):
  start-up, rendezvous, supervision, results, as every job a test or a notebook launches;
* every notebook both commits hold, its complete copy run top to bottom at smoke size in a
  fresh kernel (papermill), as ``tests/test_notebooks.py`` runs it. Notebook 07 is left out
  unless asked for: its job plants faults drawn per run, so the two commits' runs would not do
  the same work.

Each commit is unpacked (``git archive``) into ``build/bench-commits/<commit>`` and put first on
``PYTHONPATH``, so the kernel and every rank it launches import that commit's labkit (the
launcher passes its own root on to the ranks). The installed packages are this environment's
for both. Every round runs each item once per commit, in an order that swaps every round
(A B, B A, ...), so a neighbour's burst of load or a warm cache falls on both alike. The
result per item is ratio = median(new) / median(old) and the paired ratio (the median over
rounds of new_i / old_i); the notebooks also as one total, the sum of their medians. Nothing
here passes or fails: a ratio within the items' own spread says "no measurable difference".
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import _common

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "build" / "bench-commits"
LEFT_OUT = ("07",)  # a capstone job's faults are drawn per run: not the same work twice

IMPORT = "import labkit"
LAUNCH = """
try:  # the typed config and launch.run(config) of the redesign
    from labkit.jobs import launch
    from labkit.workers.allreduce import AllReduceConfig
    res = launch.run(AllReduceConfig(numel=2**16, repeats=3, warmup=1), nproc=2, device="cpu",
                     backend="gloo", stream=False, timeout_s=120)
except ImportError:  # before it: a module name and a dict
    from labkit import launch
    res = launch.run("labkit.workers.allreduce", config={"numel": 2**16, "repeats": 3,
                     "warmup": 1}, nproc=2, device="cpu", backend="gloo", stream=False,
                     timeout_s=120)
assert all(res.rank(r) for r in range(2)), "a rank left no result"
"""


def resolve(rev: str) -> str:
    return subprocess.run(["git", "rev-parse", "--short=7", f"{rev}^{{commit}}"], cwd=ROOT,
                          check=True, capture_output=True, text=True).stdout.strip()  # fmt: skip


def unpack(commit: str) -> Path:
    """The tree of ``commit`` under build/bench-commits/, unpacked once."""
    tree = WORK / commit
    if not (tree / "labkit" / "__init__.py").exists():
        shutil.rmtree(tree, ignore_errors=True)
        tree.mkdir(parents=True)
        with tempfile.TemporaryFile() as tar:
            subprocess.run(["git", "archive", "--format=tar", commit], cwd=ROOT, check=True,
                           stdout=tar)  # fmt: skip
            tar.seek(0)
            with tarfile.open(fileobj=tar) as t:
                t.extractall(tree, filter="data")
    return tree


def notebooks(tree: Path) -> dict[str, Path]:
    """Notebook id → complete notebook, of one commit's tree."""
    out = {}
    for path in sorted((tree / "solutions").glob("[0-9]*.ipynb")):
        out[path.stem.split("_")[0]] = path
    return out


def env_for(tree: Path, home: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tree), *filter(None, [env.get("PYTHONPATH")])])
    env["LABKIT_HOME"] = str(home)  # each commit its own runs folder and caches
    env.pop("LABKIT_SIZE", None)
    return env


def timed(cmd: list[str], *, cwd: Path, env: dict[str, str], what: str) -> float:
    t0 = time.perf_counter()
    res = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    took = time.perf_counter() - t0
    if res.returncode:
        tail = (res.stdout + res.stderr)[-2000:]
        raise SystemExit(f"{what} failed (exit {res.returncode}) in {cwd}:\n{tail}")
    return took


def items(trees: dict[str, Path], only: list[str] | None) -> dict[str, dict[str, Any]]:
    """Each item: per commit, the command, its folder and what it is."""
    py = sys.executable
    out: dict[str, dict[str, Any]] = {
        "import labkit": {c: ([py, "-c", IMPORT], t) for c, t in trees.items()},
        "2-rank launch": {c: ([py, "-c", LAUNCH], t) for c, t in trees.items()},
    }
    held = [notebooks(t) for t in trees.values()]
    shared = sorted(set(held[0]) & set(held[1]))
    chosen = [n for n in shared if n not in LEFT_OUT] if only is None else only
    for nb in chosen:
        if nb not in shared:
            raise SystemExit(f"--notebooks {nb}: not in both commits (both hold {shared})")
        out[f"notebook {nb}"] = {}
        for (c, t), nbs in zip(trees.items(), held, strict=True):
            run_out = WORK / "executed" / c / nbs[nb].name
            run_out.parent.mkdir(parents=True, exist_ok=True)
            cmd = [py, "-m", "papermill", str(nbs[nb]), str(run_out), "-p", "size", "smoke",
                   "--cwd", str(nbs[nb].parent), "--no-progress-bar", "--no-log-output"]  # fmt: skip
            out[f"notebook {nb}"][c] = (cmd, t)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old", help="the commit to compare against (e.g. fbaa9c7)")
    ap.add_argument("new", nargs="?", default="HEAD", help="the commit measured (HEAD)")
    ap.add_argument("--rounds", type=int, default=1, help="rounds of every item (1)")
    ap.add_argument("--imports", type=int, default=10, help="import timings per round (10)")
    ap.add_argument("--notebooks", nargs="*", help="notebook ids (default: all both hold but 07)")
    ap.add_argument("--record", action="store_true", help="save into benchmarks/results/")
    ap.add_argument("--out", help="save the record to this file")
    args = ap.parse_args(argv)
    old, new = resolve(args.old), resolve(args.new)
    trees = {old: unpack(old), new: unpack(new)}
    homes = {c: WORK / "home" / c for c in trees}
    todo = items(trees, args.notebooks)
    load_before = os.getloadavg()
    samples: dict[str, list[float]] = {}
    for rnd in range(args.rounds):
        for i, (name, per_commit) in enumerate(todo.items()):
            order = [old, new] if (rnd + i) % 2 == 0 else [new, old]
            repeats = args.imports if name == "import labkit" else 1
            for _ in range(repeats):
                for c in order[:: 1 if _ % 2 == 0 else -1]:
                    cmd, tree = per_commit[c]
                    took = timed(cmd, cwd=tree, env=env_for(tree, homes[c]), what=f"{name} at {c}")
                    samples.setdefault(f"{name} @ {c}", []).append(took)
            a, b = samples[f"{name} @ {old}"], samples[f"{name} @ {new}"]
            print(f"round {rnd + 1}: {name:<14} {old} {statistics.median(a):8.3f} s   "
                  f"{new} {statistics.median(b):8.3f} s   ratio {statistics.median(b) / statistics.median(a):.3f}",
                  flush=True)  # fmt: skip
    per_item = {}
    for name in todo:
        a, b = f"{name} @ {old}", f"{name} @ {new}"
        per_item[name] = _common.comparison(samples, b, a, target=1.05,
                                            what=f"median seconds, {new} / {old}")  # fmt: skip
    nb_names = [n for n in todo if n.startswith("notebook ")]
    total = {c: sum(statistics.median(samples[f"{n} @ {c}"]) for n in nb_names) for c in trees}
    print(f"\n{'item':<16}{old:>10}{new:>10}   ratio  paired")
    for name, cmp in per_item.items():
        med = cmp["median_s"]
        print(f"{name:<16}{med[f'{name} @ {old}']:>10.3f}{med[f'{name} @ {new}']:>10.3f}"
              f"   {cmp['ratio']:.3f}  {cmp['paired_ratio']:.3f}")  # fmt: skip
    if nb_names:
        print(f"{'notebooks, sum':<16}{total[old]:>10.1f}{total[new]:>10.1f}   "
              f"{total[new] / total[old]:.3f}")  # fmt: skip
    record = _common.make_record(
        "commits", device="cpu", samples_s=samples,
        params={"old": old, "new": new, "rounds": args.rounds, "imports": args.imports,
                "notebooks": [n.split()[1] for n in nb_names], "size": "smoke"},
        per_item=per_item,
        notebooks_sum_s=total,
        notebooks_ratio=(total[new] / total[old]) if nb_names else None,
        load_average_before_after=[list(load_before), list(os.getloadavg())],
    )  # fmt: skip
    _common.emit(record, name=f"commits-{old}-{new}", out=args.out, record_it=args.record)


if __name__ == "__main__":
    main()
