"""labkit.jobs.checkpoint at its edges (issue 31): damaged checkpoints, manifests with odd fields,
steps the folder names cannot hold, a disk that fills during a save or its write-speed probe,
and a crash while a step's folder is being replaced.

The promise under test: the user is told what happened and where, a damaged newest checkpoint
is skipped for the previous complete one, a failed save leaves no temporary folder and raises
one labkit error (an ``Exception``, not torch's ``BaseException``), and no crash loses the last
complete checkpoint. A full disk is met two ways: simulated inside torch's own writer (its
file streams raise ENOSPC once a byte budget is spent, always run), and a real 4 MiB tmpfs
mounted in a user namespace (``unshare -Urm``, no root needed; skipped where the kernel
forbids it).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import subprocess
import sys
import textwrap
import warnings
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as tdist
import torch.multiprocessing as mp
from test_checkpoint import Log, fresh, trained

from labkit.jobs import checkpoint
from labkit.jobs.checkpoint import folders as checkpoint_folders
from labkit.jobs.checkpoint import saving as checkpoint_save

REPO = Path(__file__).resolve().parents[1]


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_weights(model: torch.nn.Module, expected: dict[str, torch.Tensor]) -> None:
    for name, t in model.state_dict().items():
        assert torch.equal(t, expected[name]), name


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    """Complete checkpoints of steps 1 and 2 (different weights); step 1's weights."""
    root = tmp_path_factory.mktemp("two")
    model, opt = trained(steps=1)
    checkpoint.save(root, 1, model, opt, extra={"data_position": 1}, log=None)
    first = weights(model)
    model, opt = trained(steps=2)
    checkpoint.save(root, 2, model, opt, extra={"data_position": 2}, log=None)
    return root, first


def copy_of(two, tmp_path: Path, only_newest: bool = False) -> Path:
    root = tmp_path / "ck"
    shutil.copytree(two[0], root)
    if only_newest:
        shutil.rmtree(root / "step000000001")
    return root


# --- damaged checkpoints: skipped with a warning, the previous complete one loaded ----------------

DAMAGE = {  # what is done to the newest checkpoint: what the message must name
    # found by the scan, before torch reads anything: the manifest records every file's size
    "truncated share": "__0_0.distcp is truncated",
    "truncated index": ".metadata is truncated",
    # a manifest without sizes (written by an older labkit): found when torch reads the files
    "truncated share, manifest without sizes": "__0_0.distcp is truncated",
    "truncated index, manifest without sizes": ".metadata cannot be read",
    # the right size, the wrong bytes: found when torch reads them
    "overwritten share": "__0_0.distcp",
    "garbage rank file": "rank0.pt",  # a pickle cut short: "pickle data was truncated"
    "overwritten rank file": "rank0.pt cannot be read",
}


def damage(folder: Path, kind: str) -> None:
    share, index, own = folder / "__0_0.distcp", folder / ".metadata", folder / "rank0.pt"
    if kind.endswith("manifest without sizes"):
        manifest = json.loads((folder / checkpoint.MANIFEST).read_text())
        del manifest["files"]
        (folder / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    if kind.startswith("truncated"):
        cut = share if "share" in kind else index
        cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    elif kind == "overwritten share":
        share.write_bytes(bytes(share.stat().st_size))
    elif kind == "garbage rank file":
        own.write_bytes(b"\x80\x04\x95\x10\x00\x00\x00")
    elif kind == "overwritten rank file":
        own.write_bytes(bytes(own.stat().st_size))


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_a_damaged_newest_checkpoint_is_skipped_with_a_warning_and_the_previous_loads(
        tmp_path, two, kind, caplog):  # fmt: skip
    root = copy_of(two, tmp_path)
    newest = root / "step000000002"
    damage(newest, kind)
    model, opt = fresh()
    with pytest.warns(checkpoint.CheckpointWarning) as caught:
        state = checkpoint.load_latest(root, model, opt, log=None)
    assert state is not None and state.step == 1 and state.extra == {"data_position": 1}
    assert_weights(model, two[1])  # all of step 1, whatever torch read of step 2 first
    text = " ".join(str(w.message) for w in caught)
    assert str(newest) in text and "damaged" in text and DAMAGE[kind] in text, text
    # torch's loader logs a traceback per unreadable index: labkit has named the damage
    assert not [r.getMessage() for r in caplog.records if r.exc_info], caplog.text


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_when_every_checkpoint_is_damaged_one_labkit_error_names_the_folder_and_the_fix(
        tmp_path, two, kind):  # fmt: skip
    root = copy_of(two, tmp_path, only_newest=True)
    newest = root / "step000000002"
    damage(newest, kind)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", checkpoint.CheckpointWarning)
        try:
            checkpoint.load_latest(root, *fresh(), log=None)
        except Exception as err:  # what a notebook catches
            caught = err
        else:
            pytest.fail("a damaged checkpoint was loaded, or scratch was chosen silently")
    assert isinstance(caught, checkpoint.CheckpointError), repr(caught)
    msg = str(caught)
    assert str(newest) in msg and DAMAGE[kind] in msg and f"rm -r {newest}" in msg, msg
    assert "Traceback" not in msg


# --- manifests that parse but hold odd fields ------------------------------------------------------

ODD_FIELDS = [
    ("signature", None),
    ("signature", [["wte.weight", "256x32", "float32"]]),
    ("world_size", "1"),
    ("world_size", 0),
    ("step", "2"),
    ("optimizer", None),
    ("format", "1"),
    ("files", ["__0_0.distcp"]),
]


def set_field(folder: Path, key: str, value) -> None:
    manifest = json.loads((folder / checkpoint.MANIFEST).read_text())
    manifest[key] = value
    (folder / checkpoint.MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize(("key", "value"), ODD_FIELDS)
def test_a_manifest_with_an_odd_field_is_named_and_the_previous_checkpoint_loads(
        tmp_path, two, key, value):  # fmt: skip
    root = copy_of(two, tmp_path)
    set_field(root / "step000000002", key, value)
    model, opt = fresh()
    with pytest.warns(checkpoint.CheckpointWarning, match=rf"step000000002.*{key}"):
        state = checkpoint.load_latest(root, model, opt, log=None)
    assert state.step == 1
    assert_weights(model, two[1])


@pytest.mark.parametrize(("key", "value"), ODD_FIELDS)
def test_an_odd_manifest_alone_gives_one_error_that_names_the_field(tmp_path, two, key, value):
    root = copy_of(two, tmp_path, only_newest=True)
    folder = root / "step000000002"
    set_field(folder, key, value)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", checkpoint.CheckpointWarning)
        with pytest.raises(checkpoint.CheckpointError) as err:
            checkpoint.load_latest(root, *fresh(), log=None)
    msg = str(err.value)
    assert f"{checkpoint.MANIFEST} field {key!r}" in msg and str(folder) in msg, msg
    assert "this job has 1" not in msg  # never "saved by 1 ranks, this job has 1"
    # The folder-by-folder loader says the same, not a TypeError from deep inside.
    with pytest.raises(checkpoint.CheckpointError, match=rf"field {key!r}"):
        checkpoint.load_resharded(folder, *fresh(), log=None)


# --- steps the folder names cannot hold ----------------------------------------------------------


@pytest.mark.parametrize("step", [-1, 10**10, 10**9, 1.5, True, "3", None])
def test_a_step_the_folder_name_cannot_hold_is_refused_before_anything_is_written(tmp_path, step):
    model = torch.nn.Linear(4, 2)
    with pytest.raises(ValueError) as err:
        checkpoint.save(tmp_path / "ck", step, model, torch.optim.AdamW(model.parameters()),
                        log=None)  # fmt: skip
    assert str(err.value).startswith(f"step={step!r} is not allowed: an integer from 0 to "
                                     "999999999 (a checkpoint's folder is named step + 9 digits, "
                                     "which is how load_latest finds it again; pass the number "
                                     "of optimizer steps done so far"), err.value  # fmt: skip
    assert not (tmp_path / "ck").exists()


def test_a_numpy_step_is_a_step(tmp_path):
    """A step counted with numpy (np.arange) is as good as Python's int. Before: refused."""
    model = torch.nn.Linear(4, 2)
    saved = checkpoint.save(tmp_path, np.int64(7), model, torch.optim.AdamW(model.parameters()),
                            log=None)  # fmt: skip
    assert saved.step == 7 and type(saved.step) is int and Path(saved.path).name == "step000000007"


@pytest.mark.parametrize("step", [0, 999_999_999])
def test_the_first_and_last_steps_a_folder_name_holds_load_back(tmp_path, step):
    model = torch.nn.Linear(4, 2)
    saved = checkpoint.save(tmp_path, step, model, torch.optim.AdamW(model.parameters()), log=None)
    other = torch.nn.Linear(4, 2)
    state = checkpoint.load_latest(tmp_path, other, torch.optim.AdamW(other.parameters()),
                                   log=None)  # fmt: skip
    assert state is not None and state.step == step and state.path == saved.path


# --- a disk that fills during a save ---------------------------------------------------------------


@contextlib.contextmanager
def disk_with_room(room_bytes: int):
    """torch's own ``dcp.save`` on a disk with ``room_bytes`` left: the file streams of its
    ``FileSystemWriter`` (``torch/distributed/checkpoint/filesystem.py``, ``FileSystem.
    create_stream``) raise ENOSPC, as ``write(2)`` does, once the budget is spent. What torch
    makes of it is its own: inside ``torch.save``'s zip writer the OSError becomes
    "unexpected pos ... vs ..."."""
    from torch.distributed.checkpoint import filesystem

    real = filesystem.FileSystem.create_stream
    left = [room_bytes]

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        with real(self, path, mode) as stream:
            write = stream.write

            def full_write(data):
                n = memoryview(data).nbytes
                if n > left[0]:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                left[0] -= n
                return write(data)

            stream.write = full_write
            yield stream

    filesystem.FileSystem.create_stream = create_stream
    try:
        yield
    finally:
        filesystem.FileSystem.create_stream = real


@pytest.mark.parametrize("room", [100_000, 0])  # torch's "unexpected pos", and a bare ENOSPC
def test_a_disk_that_fills_during_a_save_gives_one_labkit_error_and_keeps_the_last_checkpoint(
        tmp_path, room):  # fmt: skip
    model, opt = trained(steps=1)
    checkpoint.save(tmp_path, 1, model, opt, log=None)
    kept = weights(model)
    newer, newer_opt = trained(steps=2)
    with disk_with_room(room):
        try:
            checkpoint.save(tmp_path, 2, newer, newer_opt, log=None)
        except Exception as err:  # a notebook's `except Exception` must catch it
            caught = err
        else:
            pytest.fail("the save succeeded on a full disk")
    assert isinstance(caught, checkpoint.CheckpointError), repr(caught)
    msg = str(caught)
    assert "no space left" in msg and str(tmp_path) in msg, msg
    assert "step000000001" in msg  # the checkpoint still there to resume from
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step000000001"]  # no .tmp- left
    other, other_opt = fresh()
    assert checkpoint.load_latest(tmp_path, other, other_opt, log=None).step == 1
    assert_weights(other, kept)


class GroupBroke(RuntimeError):
    """Stands for torch's DistBackendError: the process group broke during the save."""


def test_an_error_of_dcp_save_that_is_no_failed_write_goes_up_as_it_is(tmp_path, monkeypatch):
    """Before: it became a CheckpointError whose fix was "Pass an extra of plain values", after
    one more collective on the group that had just broken."""
    import torch.distributed.checkpoint as dcp

    def broken(*args, **kwargs):
        raise GroupBroke("Connection closed by peer [127.0.0.1]:29500")

    gathered = []
    monkeypatch.setattr(dcp, "save", broken)
    monkeypatch.setattr(checkpoint_save, "from_all", lambda x: gathered.append(x) or [x])
    model, opt = trained(steps=1)
    with pytest.raises(GroupBroke) as err:
        checkpoint.save(tmp_path, 1, model, opt, log=None)
    assert type(err.value) is GroupBroke
    assert str(err.value) == "Connection closed by peer [127.0.0.1]:29500"
    assert gathered == [[]]  # the temporary folder's; none after the error


def test_an_extra_that_does_not_pickle_is_named_with_its_fix_and_nothing_is_published(tmp_path):
    model, opt = trained(steps=1)
    with pytest.raises(checkpoint.CheckpointError) as err:
        checkpoint.save(tmp_path, 1, model, opt, extra={"next": lambda: 0}, log=None)
    msg = str(err.value)
    assert "checkpoint step 1 could not be written" in msg and "Pass an extra of plain values" in msg
    assert "rank0.pt" in msg and list(tmp_path.iterdir()) == [], msg


def test_an_interrupt_during_a_save_stays_an_interrupt_and_leaves_no_temporary_folder(
        tmp_path, monkeypatch):  # fmt: skip
    """■ while DCP writes: DCP catches it (a BaseException) into its CheckpointException.
    Before: a CheckpointError ("could not be written ... KeyboardInterrupt"); load_latest
    re-raises an interrupt, and so does save now."""
    from torch.distributed.checkpoint import filesystem

    real = filesystem.FileSystem.create_stream

    @contextlib.contextmanager
    def interrupted(self, path, mode):
        with real(self, path, mode):
            raise KeyboardInterrupt

    model, opt = trained(steps=1)
    checkpoint.save(tmp_path, 1, model, opt, log=None)
    monkeypatch.setattr(filesystem.FileSystem, "create_stream", interrupted)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(tmp_path, 2, *trained(steps=2), log=None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step000000001"]


def test_a_published_save_survives_a_write_speed_probe_that_meets_a_full_disk(tmp_path,
                                                                             monkeypatch):  # fmt: skip
    def full(folder, nbytes=0):
        probe = Path(folder) / f".write-probe-{os.getpid()}"
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(probe))

    monkeypatch.setattr(checkpoint_save, "write_bandwidth", full)
    model, opt = trained(steps=1)
    log = Log()
    saved = checkpoint.save(tmp_path, 1, model, opt, log=log)
    assert saved.write_bytes_per_s is None and saved.predicted_s is None
    assert any("write speed not measured" in n and "No space left" in n for n in saved.notes)
    assert any("write speed not measured" in line for line in log), log
    assert checkpoint.load_latest(tmp_path, *fresh(), log=None).step == 1


def test_the_write_speed_probe_is_skipped_where_the_disk_has_no_room_for_it(tmp_path, monkeypatch):
    def must_not_probe(folder, nbytes=0):
        raise AssertionError("probed a disk with no room for the probe")

    real = shutil.disk_usage

    def nearly_full(path):
        usage = real(path)
        return usage._replace(free=200_000)

    monkeypatch.setattr(checkpoint_save, "write_bandwidth", must_not_probe)
    monkeypatch.setattr(shutil, "disk_usage", nearly_full)
    model, opt = trained(steps=1)
    saved = checkpoint.save(tmp_path, 1, model, opt, log=None)
    assert saved.write_bytes_per_s is None
    assert any("write speed not measured" in n and "MiB free" in n for n in saved.notes)


FULL_DISK_SCRIPT = textwrap.dedent("""
    import json, os, shutil, sys, warnings
    from pathlib import Path
    sys.path.insert(0, "tests")
    from test_checkpoint import fresh, trained
    from labkit.jobs import checkpoint

    disk = Path(sys.argv[1])
    out = {}

    def fill(leave):
        # Take all but `leave` bytes of the disk (tmpfs allocates on fallocate).
        free = shutil.disk_usage(disk).free
        fd = os.open(disk / f"filler{len(out)}", os.O_CREAT | os.O_WRONLY)
        os.posix_fallocate(fd, 0, max(free - leave, 1))
        os.close(fd)

    # 1. A save that fits, with no room for its 1 MiB write-speed probe.
    model, opt = trained(steps=1)
    need = checkpoint.save(disk / "sizing", 1, model, opt, log=None).bytes
    shutil.rmtree(disk / "sizing")
    fill(need + 200_000)
    saved = checkpoint.save(disk / "fits", 1, model, opt, log=None)
    out["fits"] = {"notes": saved.notes, "bw": saved.write_bytes_per_s,
                   "loaded": checkpoint.load_latest(disk / "fits", *fresh(), log=None).step}
    for p in disk.iterdir():
        shutil.rmtree(p) if p.is_dir() else p.unlink()

    # 2. A save that does not fit, after one that did.
    checkpoint.save(disk / "full", 1, model, opt, log=None)
    fill(need // 2)
    try:
        checkpoint.save(disk / "full", 2, *trained(steps=2), log=None)
        out["full"] = {"error": None}
    except Exception as err:
        out["full"] = {"error": type(err).__name__, "message": str(err)}
    out["full"]["left"] = sorted(p.name for p in (disk / "full").iterdir())
    out["full"]["loaded"] = checkpoint.load_latest(disk / "full", *fresh(), log=None).step
    print("RESULT " + json.dumps(out))
""")


def _user_namespaces_work() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-Urm", "true"], capture_output=True, timeout=30)
    return probe.returncode == 0


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_real_full_disk_fails_the_save_cleanly_and_spares_a_published_one(tmp_path):
    """The same two cases on a real 4 MiB tmpfs, in a mount namespace of one process."""
    if not _user_namespaces_work():
        pytest.skip("no user namespaces here (unshare -Urm): a tmpfs needs one without root")
    disk = tmp_path / "disk"
    disk.mkdir()
    script = tmp_path / "full_disk.py"
    script.write_text(FULL_DISK_SCRIPT)
    mount = 'mount -t tmpfs -o size=4m tmpfs "$1" && exec "$2" "$3" "$1"'
    proc = subprocess.run(["unshare", "-Urm", "sh", "-c", mount, "sh", str(disk), sys.executable,
                           str(script)], cwd=REPO, capture_output=True, text=True, timeout=110)  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(lines[-1].removeprefix("RESULT "))
    fits = out["fits"]
    assert fits["loaded"] == 1 and fits["bw"] is None, fits
    assert any("write speed not measured" in n for n in fits["notes"]), fits
    full = out["full"]
    assert full["error"] == "CheckpointError" and "no space left" in full["message"], full
    assert str(disk / "full") in full["message"], full
    assert full["left"] == ["step000000001"] and full["loaded"] == 1, full


# --- a crash while a step's folder is replaced ---------------------------------------------------


class Killed(BaseException):
    """The process dies at this point (nothing after it runs, no handler cleans up)."""


def _crash(*args, **kwargs):
    raise Killed()


@pytest.fixture
def replaced(tmp_path):
    """Step 2 saved, then training went back to step 1 and reached step 2 again with other
    weights: (root, the first step 2's weights, the second's model and optimizer)."""
    model, opt = trained(steps=1)
    checkpoint.save(tmp_path, 2, model, opt, extra={"data_position": 2}, log=None)
    again, again_opt = trained(steps=2, seed=7)
    return tmp_path, weights(model), again, again_opt


def test_a_crash_between_setting_the_old_step_aside_and_publishing_keeps_the_old_one(replaced,
                                                                                    monkeypatch):  # fmt: skip
    root, first, again, again_opt = replaced
    monkeypatch.setattr(checkpoint_save, "_rename", _crash)  # dies before the new folder's rename
    with pytest.raises(Killed):
        checkpoint.save(root, 2, again, again_opt, extra={"data_position": 2}, log=None)
    monkeypatch.undo()
    model, opt = fresh()
    log = Log()
    state = checkpoint.load_latest(root, model, opt, log=log)
    assert state is not None and state.step == 2, log
    assert_weights(model, first)  # the complete one that was being replaced
    assert Path(state.path) == root / "step000000002"  # put back where it belongs
    assert any("interrupted" in line for line in log), log
    checkpoint.save(root, 3, again, again_opt, log=None)
    assert sorted(p.name for p in root.iterdir()) == ["step000000002", "step000000003"]


def test_a_crash_after_publishing_before_removing_the_old_step_loads_the_new_one(replaced,
                                                                                monkeypatch):  # fmt: skip
    root, _, again, again_opt = replaced
    monkeypatch.setattr(checkpoint_save, "_discard", _crash)  # dies before the old folder is removed
    with pytest.raises(Killed):
        checkpoint.save(root, 2, again, again_opt, extra={"data_position": 2}, log=None)
    monkeypatch.undo()
    model, opt = fresh()
    state = checkpoint.load_latest(root, model, opt, log=None)
    assert state.step == 2
    assert_weights(model, weights(again))
    checkpoint.save(root, 3, again, again_opt, log=None)  # tidies what the crash left
    assert sorted(p.name for p in root.iterdir()) == ["step000000002", "step000000003"]


def test_a_leftover_old_step_is_loaded_where_it_cannot_be_put_back(replaced, monkeypatch):
    """A read-only checkpoint folder: the loader cannot rename, and still finds the old step."""
    root, first, again, again_opt = replaced
    monkeypatch.setattr(checkpoint_save, "_rename", _crash)
    with pytest.raises(Killed):
        checkpoint.save(root, 2, again, again_opt, log=None)
    monkeypatch.undo()
    monkeypatch.setattr(checkpoint_folders, "put_back", lambda aside, final: False)
    model, opt = fresh()
    state = checkpoint.load_latest(root, model, opt, log=None)
    assert state.step == 2 and Path(state.path).name.startswith(".replaced-")
    assert_weights(model, first)


# --- two ranks agree: a damaged rank file, a full disk on one rank -------------------------------

WORLD = 2


def _full_write_own(path: Path, own: dict) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def _two_rank_worker(rank: int, folder: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    store = tdist.FileStore(str(Path(folder) / "store"), WORLD)
    # A short timeout: a rank left waiting in a collective fails the test instead of hanging it.
    tdist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD,
                             timeout=timedelta(seconds=30))  # fmt: skip
    out: dict = {}
    root = Path(folder) / "ck"
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 4)
        opt = torch.optim.AdamW(model.parameters())
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        for step in (1, 2):
            checkpoint.save(root, step, model, opt, extra={"rank": rank, "step": step}, log=None)
        tdist.barrier()
        if rank == 0:  # rank 1's own file of the newest checkpoint is overwritten: only rank
            own = root / "step000000002" / "rank1.pt"  # 1 finds out, rank 0 reads its own fine
            own.write_bytes(bytes(own.stat().st_size))
        tdist.barrier()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            loaded = checkpoint.load_latest(root, model, opt, log=None)
        out["loaded"] = [loaded.step, loaded.extra]
        out["warnings"] = [str(w.message) for w in seen]
        # The disk fills under rank 1's share of step 3; then under rank 1's own file of step 4.
        for step in (3, 4):
            real_write_own = checkpoint_save._write_own
            if rank == 1 and step == 4:
                checkpoint_save._write_own = _full_write_own
            try:
                with disk_with_room(0) if (rank, step) == (1, 3) else contextlib.nullcontext():
                    checkpoint.save(root, step, model, opt, log=None)
                out[f"save{step}"] = None
            except Exception as err:
                out[f"save{step}"] = [type(err).__name__, str(err)]
            finally:
                checkpoint_save._write_own = real_write_own
        tdist.barrier()
        out["left"] = sorted(p.name for p in root.iterdir())
    finally:
        (Path(folder) / f"rank{rank}.json").write_text(json.dumps(out))
        tdist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_two_ranks_fall_back_together_and_fail_a_full_disk_together(tmp_path):
    mp.start_processes(_two_rank_worker, args=(str(tmp_path),), nprocs=WORLD, start_method="spawn")
    outs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for rank, out in enumerate(outs):
        assert out["loaded"] == [1, {"rank": rank, "step": 1}], out  # both ranks: step 1
        for step in (3, 4):
            kind, msg = out[f"save{step}"]
            assert kind == "CheckpointError" and "no space left" in msg and "rank 1" in msg, out
        assert out["left"] == ["step000000001", "step000000002"], out
    assert any("rank1.pt cannot be read" in w and "damaged" in w for w in outs[0]["warnings"]), outs[0]
