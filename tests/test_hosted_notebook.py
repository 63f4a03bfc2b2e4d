"""The hosted-notebook path (README, "Run it in a hosted notebook"), and the dtype a T4 gets.

* The slow test plays a hosted runtime: a bare Jupyter server in a fresh virtual environment
  (jupyter_server, nbclient and ipykernel, nothing of the course's), a read-only ``HOME`` and no
  ``LABKIT_HOME``. Through the server's own REST and websocket API, as a browser would, it runs
  the setup cell (``scripts/hosted_setup_cell.py``) with ``REPO`` pointing at a git copy of this
  checkout, then the learner's notebook 00 in that kernel; then, in a second kernel, the setup
  cell again (which must find everything in place) and notebook 01. Both notebooks must reach
  their last cell as ``test_notebooks`` requires of every learner's copy, with nothing written
  under ``HOME``. As root, whom a mode of 555 does not stop, the server runs in a private mount
  namespace where ``HOME`` is also bind-mounted read-only.
* The fast tests hold the parts: what the setup installs and keeps, labkit's folder where the
  home cannot be written, and the fp16-with-a-loss-scaler choice on a GPU without bf16 (compute
  capability 7.5, a T4, faked), made by the calls notebook 01 makes.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
import warnings
from pathlib import Path

import nbformat
import pytest
import torch
from test_notebooks import check_learner_run

from labkit import hardware, train
from labkit.course import hosted
from labkit.jobs import procs

ROOT = Path(__file__).resolve().parents[1]
CELL = ROOT / "scripts" / "hosted_setup_cell.py"
NOTEBOOKS = ("00_setup_and_first_job.ipynb", "01_single_gpu_training.ipynb")
CELL_TIMEOUT_S = 300
# What a bare host has: a Jupyter server, a kernel, a notebook runner. Held to the lock so the
# test does not move with the index; the setup must bring everything else.
BARE_HOST = ("jupyter_server", "nbclient", "ipykernel")


# --- the parts ------------------------------------------------------------------------------


def _course(tmp_path: Path, requirements: str, lock: str, dependencies: str) -> Path:
    (tmp_path / "requirements.txt").write_text(requirements)
    (tmp_path / "requirements.lock").write_text(lock)
    (tmp_path / "pyproject.toml").write_text(
        f'[project]\nname = "labkit"\ndependencies = [\n{dependencies}]\n\n[tool.x]\ny = [\n]\n')
    (tmp_path / "labkit").mkdir()
    return tmp_path


def test_the_plan_installs_what_is_missing_at_its_pin_and_keeps_what_the_host_has(tmp_path):
    src = _course(
        tmp_path,
        "torch==2.13.0\nnumpy==2.4.6\npsutil==7.2.2\nipykernel==7.4.0\njupyterlab==4.6.6\n"
        "pytest==9.2.0\n",
        "# the lock\nnumpy==2.4.6\npsutil==7.2.2\nsympy==1.14.0\ntraitlets==5.16.1\n",
        '    "torch>=2.4",\n    "numpy>=1.26",\n    "psutil>=5.9",\n    "ipykernel>=6.29",\n'
        '    "jupyterlab>=4.2",\n',
    )
    # a GPU runtime: its CUDA torch and its numpy stay; an old psutil is below labkit's floor
    have = {"torch": "2.6.0+cu124", "numpy": "2.0.2", "psutil": "5.8.0", "traitlets": "5.7.1",
            "ipykernel": "6.17.1"}
    plan = hosted.plan(src, have, torch_kind=lambda: "a CUDA 12.4 build")
    assert plan.install == ["psutil==7.2.2"]
    assert plan.kept == ["torch 2.6.0+cu124 (a CUDA 12.4 build; tested: 2.13.0)",
                         "numpy 2.0.2 (tested: 2.4.6)"]
    # the Jupyter stack is the host's: neither installed nor held to the lock
    assert not [r for r in plan.install if r.startswith(("ipykernel", "jupyterlab", "pytest"))]
    assert plan.constraints == ["sympy==1.14.0"]  # only what the host does not have
    assert plan.labkit  # not installed here from this source

    bare = hosted.plan(src, {}, torch_kind=lambda: None)
    assert bare.install == ["torch==2.13.0", "numpy==2.4.6", "psutil==7.2.2"]
    assert bare.kept == [] and len(bare.constraints) == 4
    # the tested torch as a CPU wheel (2.13.0+cpu) is the pin: nothing to say about it
    assert hosted.plan(src, {"torch": "2.13.0+cpu"}, torch_kind=lambda: "a CPU build").kept == []


def test_versions_compare_by_their_release_numbers():
    assert hosted.at_least("2.6.0+cu124", "2.4") and hosted.at_least("2.4", "2.4.0")
    assert not hosted.at_least("2.3.1", "2.4") and hosted.at_least("10.0", "9.9")
    assert hosted.canonical("Nvidia_ML.py") == "nvidia-ml-py"


def test_the_installed_labkit_is_recognised_as_this_checkout_s():
    # the course's own environment: an editable install of this checkout (./course setup)
    assert hosted.labkit_matches(ROOT)
    assert hosted.plan(ROOT).labkit is False


def test_a_second_run_installs_nothing_and_prints_the_check(capsys):
    """This environment already holds labkit (this checkout, editable) and its dependencies, as
    a kernel does after the first run: no pip, no git; the check's lines are printed."""
    ran = []

    def run(cmd):
        ran.append(list(cmd))
        return subprocess.CompletedProcess(cmd, 0, stdout="Tier: cpu (no CUDA GPU)\n", stderr="")

    hosted.setup(ROOT, str(ROOT), "main", run=run)
    out = capsys.readouterr().out
    assert ran == [[sys.executable, "-m", "labkit", "hosted-check"]]
    assert "nothing to install" in out and "Tier: cpu" in out and "RESTART" not in out


@pytest.mark.parametrize("case", ["missing", "read-only"])
def test_labkit_home_falls_back_to_a_temporary_folder_and_says_so_once(case, monkeypatch,
                                                                        tmp_path):  # fmt: skip
    home = tmp_path / "home"
    if case == "missing":  # a home under a file: nobody, not even root, can make it
        (tmp_path / "file").write_text("")
        home = tmp_path / "file" / "home"
    else:
        if os.geteuid() == 0:
            pytest.skip("root writes into a folder of mode 555 (the slow test mounts HOME read-only)")
        home.mkdir(mode=0o555)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("LABKIT_HOME")
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    with pytest.warns(UserWarning, match="neither written nor made") as said:
        folder = procs.labkit_home()
    assert folder == tmp_path / "tmp" / f"labkit-{os.getuid()}" and folder.is_dir()
    assert len(said) == 1 and str(folder) in str(said[0].message)
    # once: the folder is now LABKIT_HOME, which the jobs this process launches inherit
    assert os.environ["LABKIT_HOME"] == str(folder)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert procs.labkit_home() == folder


def test_a_gpu_without_bf16_trains_in_fp16_with_a_loss_scaler_and_says_why(monkeypatch):
    """Notebook 01's calls on a T4 (compute capability 7.5), faked: CUDA is there, its
    capability read from torch.cuda as on the real GPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    device = train.resolve_device("auto")
    assert device.type == "cuda"
    choice = hardware.default_autocast_dtype(device)  # notebook 01, dtype=None
    assert (choice.dtype, choice.scaler) == ("float16", True)
    assert "compute capability 7.5" in choice.reason and "no bf16" in choice.reason
    assert choice.describe().startswith("training dtype float16, with a loss scaler")
    # train.train(scaler="auto") gives that dtype its GradScaler
    assert isinstance(train.make_scaler(device, choice.dtype), torch.amp.GradScaler)
    # a learner's dtype="bfloat16" on a T4 becomes fp16 too, saying what was asked for
    asked = hardware.default_autocast_dtype(device, "bfloat16")
    assert asked.dtype == "float16" and asked.reason.startswith("bfloat16 requested, but")
    # and an Ampere or newer GPU keeps bf16, with no scaler
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    assert hardware.default_autocast_dtype(device)[:2] == ("bfloat16", False)


@pytest.mark.parametrize("name", ["01_single_gpu_training", "06_profiling"])
def test_notebooks_that_pick_a_training_dtype_on_a_gpu_ask_the_capability_rule(name):
    source = "".join(c.source for c in nbformat.read(ROOT / "notebooks" / f"{name}.ipynb", 4).cells)
    assert "hardware.default_autocast_dtype(" in source


def test_hosted_check_says_the_versions_the_tier_and_the_training_dtype(capsys):
    assert hosted.main([]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("labkit 0.1.0 (") and f"torch {torch.__version__}" in lines[0]
    assert lines[1].startswith("Tier: ") and lines[2].startswith("training dtype ")
    assert lines[3].startswith("Not here: ") and "a second machine" in lines[3]
    assert lines[4].startswith(f"labkit's folder (job logs, exercise files): {procs.labkit_home()}")


# --- the whole path -------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _with_read_only(home: Path, cmd: list[str]) -> list[str]:
    """``cmd``, run where ``home`` cannot be written: its mode (555) does that for a user, and
    for root (who ignores modes) a read-only bind mount in a private mount namespace."""
    if os.geteuid() != 0:
        return cmd
    script = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" "$0" && exec "$@"'
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, str(home), *cmd,
            "--allow-root"]


def _git_copy_of_the_checkout(dest: Path) -> None:
    """This checkout's working tree (what the setup installs: labkit and the files beside it),
    committed to a fresh repository, so that the cell clones it as it would the real one."""
    dest.mkdir()
    shutil.copytree(ROOT / "labkit", dest / "labkit",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))  # fmt: skip
    for name in ("pyproject.toml", "README.md", "LICENSE", "requirements.txt", "requirements.lock"):
        shutil.copy2(ROOT / name, dest / name)
    git = ["git", "-C", str(dest), "-c", "user.name=labkit test", "-c", "user.email=test@localhost"]
    for args in (["init", "-q", "-b", "main"], ["add", "-A"], ["commit", "-q", "-m", "course"]):
        subprocess.run([*git, *args], check=True, capture_output=True)


class Server:
    """A Jupyter server driven through its REST API and kernel websockets, as a browser does."""

    def __init__(self, url: str, token: str):
        self.url, self.token = url, token

    def rest(self, method: str, path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"{self.url}{path}", data=data, method=method,
                                     headers={"Authorization": f"token {self.token}"})  # fmt: skip
        with urllib.request.urlopen(req, timeout=30) as r:
            text = r.read()
        return json.loads(text) if text else {}

    def run_cells(self, name: str, sources: list[str]) -> tuple[list, list[float]]:
        """A new kernel session for notebook ``name``; each source run in it, in order. Returns
        each cell's outputs (nbformat) and its run time in seconds; stops at the first error."""
        session = self.rest("POST", "/api/sessions", {
            "path": name, "name": name, "type": "notebook", "kernel": {"name": "python3"}})
        try:
            return asyncio.run(self._execute(session["kernel"]["id"], sources))
        finally:
            self.rest("DELETE", f"/api/sessions/{session['id']}")

    async def _execute(self, kernel_id: str, sources: list[str]) -> tuple[list, list[float]]:
        from tornado.websocket import websocket_connect

        ws = await websocket_connect(f"{self.url.replace('http', 'ws', 1)}/api/kernels/"
                                     f"{kernel_id}/channels?token={self.token}")  # fmt: skip
        session_id, all_outputs, seconds = uuid.uuid4().hex, [], []
        try:
            for i, source in enumerate(sources):
                msg_id = uuid.uuid4().hex
                await ws.write_message(json.dumps({
                    "header": {"msg_id": msg_id, "msg_type": "execute_request", "session": session_id,
                               "username": "test", "version": "5.3"},
                    "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
                    "content": {"code": source, "silent": False, "store_history": True,
                                "user_expressions": {}, "allow_stdin": False, "stop_on_error": True},
                }))
                start, outputs, replied, idle = time.monotonic(), [], False, False
                while not (replied and idle):
                    raw = await asyncio.wait_for(ws.read_message(), CELL_TIMEOUT_S)
                    assert raw is not None, f"the kernel's websocket closed during cell {i}"
                    msg = json.loads(raw)
                    if msg.get("parent_header", {}).get("msg_id") != msg_id:
                        continue
                    kind = msg["header"]["msg_type"]
                    if msg["channel"] == "shell" and kind == "execute_reply":
                        replied = True
                    elif kind == "status":
                        idle = msg["content"]["execution_state"] == "idle"
                    elif kind == "clear_output":
                        outputs.clear()
                    elif kind in ("stream", "display_data", "execute_result", "error"):
                        outputs.append(nbformat.v4.output_from_msg(msg))
                seconds.append(time.monotonic() - start)
                all_outputs.append(outputs)
                errors = [o for o in outputs if o.output_type == "error"]
                assert not errors, (f"cell {i} raised {errors[0].ename}: {errors[0].evalue}\n"
                                    + _text(outputs)[-3000:] + "\n" + source[:500])  # fmt: skip
        finally:
            ws.close()
        return all_outputs, seconds


def _text(outputs: list) -> str:
    return "\n".join(o.get("text", "") or o.get("data", {}).get("text/plain", "") for o in outputs)


def _start_server(work: Path, host: Path, env: dict[str, str],
                  log: Path) -> tuple[Server, subprocess.Popen]:  # fmt: skip
    token, port = uuid.uuid4().hex, _free_port()
    cmd = [str(host / "bin" / "jupyter-server"), f"--ServerApp.token={token}",
           f"--ServerApp.port={port}", "--ServerApp.port_retries=0", "--ServerApp.ip=127.0.0.1",
           "--ServerApp.open_browser=False", f"--ServerApp.root_dir={work}"]  # fmt: skip
    proc = subprocess.Popen(_with_read_only(Path(env["HOME"]), cmd), env=env,
                            stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    server = Server(f"http://127.0.0.1:{port}", token)
    deadline = time.monotonic() + 60
    while True:
        try:
            server.rest("GET", "/api/status")
            return server, proc
        except OSError as err:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise AssertionError(f"the Jupyter server did not start ({err}):\n"
                                     f"{log.read_text()[-3000:]}") from None
            time.sleep(0.5)


def _pip_cache() -> Path:
    """This runner's pip cache (``./course`` filled it setting up .venv): the host's pip reads
    the same wheels from it, not from the network again. Where pip keeps its cache is the
    host's business, not labkit's; the read-only HOME is for labkit."""
    if os.environ.get("PIP_CACHE_DIR"):
        return Path(os.environ["PIP_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pip"


def _cell_source(repo: str, ref: str) -> str:
    source = CELL.read_text(encoding="utf-8")
    for name, value in (("REPO", repo), ("REF", ref)):
        line = next(x for x in source.splitlines() if x.startswith(f"{name} = "))
        source = source.replace(line, f"{name} = {value!r}")
    return source


@pytest.mark.slow
def test_setup_cell_then_notebooks_00_and_01_in_a_bare_jupyter_server_with_a_read_only_home(
    tmp_path,
):
    top, server, proc = tmp_path, None, None
    times: dict[str, float] = {}
    try:
        _git_copy_of_the_checkout(top / "course")
        work, home, tmp = top / "work", top / "home", top / "tmp"
        for folder in (work, home, tmp, top / "runtime"):
            folder.mkdir()
        for name in NOTEBOOKS:
            shutil.copy2(ROOT / "notebooks" / name, work / name)
        home.chmod(0o555)
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("LABKIT_HOME", "XDG_", "VIRTUAL_ENV", "PYTHON", "JUPYTER",
                                    "IPYTHON", "MPL"))}  # fmt: skip
        host = top / "host"
        env.update(HOME=str(home), TMPDIR=str(tmp), JUPYTER_RUNTIME_DIR=str(top / "runtime"),
                   PATH=f"{host / 'bin'}{os.pathsep}{env['PATH']}", LABKIT_SIZE="smoke",
                   LABKIT_OFFLINE="1", PIP_CACHE_DIR=str(_pip_cache()))  # fmt: skip

        # The host's image is made elsewhere, by its provider: its own home, not the learner's.
        image = {**env, "HOME": str(top / "image-home")}
        start = time.monotonic()
        subprocess.run([sys.executable, "-m", "venv", str(host)], check=True, env=image)
        subprocess.run([str(host / "bin" / "python"), "-m", "pip", "install", "-q", *BARE_HOST,
                        "-c", str(ROOT / "requirements.lock")],
                       check=True, env=image, capture_output=True)  # fmt: skip
        times["bare host (venv + Jupyter server)"] = time.monotonic() - start
        server, proc = _start_server(work, host, env, top / "server.log")
        cell = _cell_source(f"file://{top / 'course'}", "main")

        runs = {}
        for name in NOTEBOOKS:
            nb = nbformat.read(work / name, as_version=4)
            code = [c for c in nb.cells if c.cell_type == "code"]
            outputs, seconds = server.run_cells(name, [cell] + [c.source for c in code])
            for c, out in zip(code, outputs[1:], strict=True):
                c.outputs, c.execution_count = out, 1
            runs[name] = (nb, _text(outputs[0]))
            times[f"{name[:2]}: setup cell"] = seconds[0]
            times[f"{name[:2]}: notebook"] = sum(seconds[1:])

        first, second = runs[NOTEBOOKS[0]][1], runs[NOTEBOOKS[1]][1]
        assert "installed the tested versions: torch==2.13.0" in first, first
        assert "installed labkit 0.1.0" in first and "Tier: cpu (no CUDA GPU)" in first, first
        assert "training dtype float32: no CUDA GPU" in first, first
        assert str(host) in first.split("labkit 0.1.0 (")[-1], "the kernel imports the installed labkit"
        # labkit's folder: the home is read-only, so a temporary one, said by the cell
        assert f"{tmp}/labkit-" in first and "read-only or missing" in first, first
        assert "nothing to install" in second and "RESTART" not in first + second, second
        for name in NOTEBOOKS:
            check_learner_run(work / name, runs[name][0])
        written = [str(p) for p in home.rglob("*")]
        assert written == [], f"wrote under the read-only HOME: {written}"
    finally:
        print("\nhosted-notebook path, wall seconds: " + ", ".join(
            f"{k} {v:.0f}" for k, v in times.items()))
        if server is not None and proc is not None:
            try:
                server.rest("POST", "/api/shutdown")
                proc.wait(timeout=20)
            except (OSError, subprocess.TimeoutExpired):
                os.killpg(proc.pid, 9)
                proc.wait()
