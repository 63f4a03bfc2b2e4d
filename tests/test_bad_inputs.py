"""Bad input, as a learner or an instructor types it, is answered with what is wrong, where, and
what to write instead: never a bare KeyError, JSON decoder message, OverflowError, int-parsing
limit, allocator error or UnicodeDecodeError (issue 31, "bad input still answered raw").

Every test here is fast and allocates nothing large: the batch finder's refusals and caps are
tested with a tiny search or a pretended host, never by asking this machine for the memory.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch

from labkit import config
from labkit.__main__ import main as labkit_main
from labkit.batching import finder
from labkit.course import exam, quiz, timings
from labkit.course.capstone import faults, keys

ROOT = Path(__file__).resolve().parents[1]
MiB, GiB, TiB = 2**20, 2**30, 2**40

# --- RunConfig.from_dict --------------------------------------------------------------------


def test_from_dict_names_a_missing_section_and_shows_a_valid_dict():
    with pytest.raises(ValueError) as err:
        config.RunConfig.from_dict({"model": {}})
    msg = str(err.value)
    assert "no 'train' section" in msg, msg
    assert "e.g. {'model': {'n_layer': 2}, 'train': {'steps': 10}}" in msg, msg
    with pytest.raises(ValueError, match=r"no 'model' or 'train' section"):
        config.RunConfig.from_dict({})


def test_from_dict_names_unknown_sections_and_fields_with_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown section 'optim'.* 'model' and 'train'"):
        config.RunConfig.from_dict({"model": {}, "train": {}, "optim": {}})
    with pytest.raises(ValueError) as err:
        config.RunConfig.from_dict({"model": {"layers": 2}, "train": {}})
    msg = str(err.value)
    assert msg.startswith("RunConfig.from_dict: model has unknown field 'layers' (did you mean "
                          "'n_layer'?)"), msg  # fmt: skip
    assert "ModelConfig's fields: vocab_size, seq_len, n_layer" in msg, msg
    with pytest.raises(ValueError, match=r"train has unknown field 'stepz' \(did you mean 'steps'"):
        config.RunConfig.from_dict({"model": {}, "train": {"stepz": 3}})


@pytest.mark.parametrize(
    ("d", "message"),
    [
        (None, r"from_dict: None is not a dict: give \{'model': \{\.\.\.\}, 'train'"),
        ([1, 2], r"from_dict: \[1, 2\] is not a dict"),
        ({"model": 5, "train": {}}, r"'model' is 5, an int: give a dict of ModelConfig's fields"),
        ({"model": {}, "train": None}, r"'train' is None: give a dict of TrainConfig's fields"),
    ],
)
def test_from_dict_refuses_what_is_not_a_dict_of_dicts(d, message):
    with pytest.raises(ValueError, match=message):
        config.RunConfig.from_dict(d)


def test_from_dict_still_round_trips_and_a_left_out_field_keeps_its_default():
    cfg = config.preset("lab")
    assert config.RunConfig.from_dict(cfg.to_dict()) == cfg
    partial = config.RunConfig.from_dict({"model": {"n_layer": 2}, "train": {"steps": 10}})
    assert (partial.model.n_layer, partial.train.steps) == (2, 10)
    assert partial.train.lr == config.TrainConfig().lr
    with pytest.raises(ValueError, match=r"^lr='x' is a str"):  # the field's own check
        config.RunConfig.from_dict({"model": {}, "train": {"lr": "x"}})


# --- labkit launch --config -------------------------------------------------------------------


def test_launch_config_that_is_not_json_says_the_option_takes_json_with_an_example(capsys):
    code = labkit_main(["launch", "labkit.workers.allreduce", "--config", "numel=4"])
    err = capsys.readouterr().err
    assert code == 2
    assert "--config 'numel=4' is not JSON" in err, err
    assert """--config '{"numel": 4}'""" in err, err  # its key=value, written as JSON
    assert "Expecting value" not in err  # the decoder's own words stay out


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("4", r"--config '4' is JSON but not an object"),
        ("{'numel': 4}", r"is not JSON: .*double quotes"),
        ("numel=4,steps=2", r"""e\.g\. --config '\{"numel": 4, "steps": 2\}'"""),
        ("lr=1e-3,name=x", r"""'\{"lr": 0\.001, "name": "x"\}'"""),
    ],
)
def test_a_config_option_is_read_as_a_json_object(text, message):
    with pytest.raises(ValueError, match=message):
        config.parse_json_object(text, "--config")
    assert config.parse_json_object('{"numel": 4}', "--config") == {"numel": 4}


# --- labkit exam --minutes ----------------------------------------------------------------------


@pytest.mark.parametrize("minutes", ["inf", "nan", "-5", "-inf", "1e9"])
def test_exam_minutes_out_of_range_names_the_option_and_the_range(minutes, monkeypatch, capsys):
    def no_answer(_prompt: str) -> str:
        raise EOFError  # the exam must not even start

    monkeypatch.setattr("builtins.input", no_answer)
    assert exam.main(["-n", "2", "--seed", "1", f"--minutes={minutes}"]) == 2
    out = capsys.readouterr().out
    assert f"labkit exam: --minutes {minutes} is not allowed" in out, out
    assert f"from more than 0 up to {exam.MAX_MINUTES:g}" in out and "0 for no time limit" in out


@pytest.mark.parametrize("minutes", [math.inf, math.nan, -1, 0, 1e9, True])
def test_draw_refuses_minutes_that_no_clock_can_show(minutes):
    with pytest.raises(exam.ExamError, match=rf"minutes={minutes!r} is not allowed: .*up to "
                                             rf"{exam.MAX_MINUTES:g}"):  # fmt: skip
        exam.draw(2, seed=1, minutes=minutes)


# --- capstone seeds -----------------------------------------------------------------------------

HUGE = "9" * 5000  # past Python's 4300-digit limit on int(str)


@pytest.mark.parametrize("seed", [HUGE, " " + HUGE, int("9" * 4000) * 10**1000, 2**31 * 10],
                         ids=["digits", "spaced-digits", "int", "just-too-big"])
def test_a_huge_seed_is_refused_with_the_range(seed):
    with pytest.raises(faults.SeedError) as err:
        faults.parse_seed(seed)
    msg = str(err.value)
    assert "a whole number from 0 to 2147483647" in msg, msg
    assert len(msg) < 400, msg  # named, not echoed in full


def test_capstone_cli_refuses_a_huge_seed_with_the_range(tmp_path, capsys):
    key = tmp_path / "key.json"
    assert labkit_main(["capstone", "new", "--seed", HUGE, "--key", str(key)]) == 2
    err = capsys.readouterr().err
    assert "labkit capstone: seed=" in err and "(5000 digits)" in err, err[:500]
    assert "from 0 to 2147483647" in err and len(err) < 400
    assert not key.exists()  # refused before anything was made


def test_a_job_code_with_a_huge_seed_is_refused_as_a_mistyped_code():
    with pytest.raises(keys.CapstoneKeyError) as err:
        keys.read_code(f"cpu-{HUGE}-d22vgd54")
    msg = str(err.value)
    assert "is not one this labkit" in msg and "check it for a typo" in msg, msg[:300]
    assert len(msg) < 400, msg[:300]
    with pytest.raises(keys.CapstoneKeyError, match=r"is a seed, not a job code") as err:
        keys.read_code(HUGE)
    assert len(str(err.value)) < 400


# --- labkit timings --only ----------------------------------------------------------------------


@pytest.fixture
def nothing_runs(monkeypatch):
    """Stop the timings tool before it runs a notebook (today's code would run one)."""

    def refuse(*_args, **_kw):
        raise AssertionError("a notebook ran: the bad --only should have been refused")

    monkeypatch.setattr(timings, "run_many", refuse)


def test_timings_only_1_suggests_01_and_lists_the_notebooks(nothing_runs, capsys):
    with pytest.raises(SystemExit):
        labkit_main(["timings", "--solutions", str(ROOT / "solutions"), "--only", "1"])
    err = capsys.readouterr().err
    assert "--only 1: no such notebook in" in err, err
    assert "write 01 for 1" in err, err
    assert "the notebooks are 00, 01, 02, 02b, 03" in err, err


def test_timings_only_refuses_an_unknown_id_among_known_ones(nothing_runs, capsys):
    with pytest.raises(SystemExit):
        labkit_main(["timings", "--solutions", str(ROOT / "solutions"), "--only", "00", "99"])
    err = capsys.readouterr().err
    assert "--only 99: no such notebook" in err and "the notebooks are 00," in err, err
    with pytest.raises(ValueError, match=r"--only 3B 7x: no such notebook .*\(write 03b for 3B\)"):
        timings.find_notebooks(ROOT / "solutions", ["00", "3B", "7x"])
    assert [p.name[:3] for p in timings.find_notebooks(ROOT / "solutions", ["03b", "00"])] == [
        "00_", "03b"]  # fmt: skip


# --- the batch finder ---------------------------------------------------------------------------

SMOKE = config.preset("smoke").model


def test_finder_refuses_a_max_batch_no_memory_holds_before_any_trial():
    # Today's code tried batch 10**9 at once: 512 GB of token ids, a raw allocator error (or,
    # where the kernel overcommits, the OOM killer). Refused before any trial now.
    with pytest.raises(ValueError, match=rf"max_batch=1000000000 is not allowed: an integer "
                                         rf"from 1 to {finder.MAX_BATCH}"):  # fmt: skip
        finder.find_max_batch(SMOKE, 2**50, max_batch=10**9)


def test_finder_caps_a_budget_beyond_the_host_with_a_warning_naming_both():
    available, source = finder.host_memory_available()
    with pytest.warns(UserWarning) as caught:
        # max_batch=4 keeps the search tiny whatever it is capped at
        result = finder.find_max_batch(SMOKE, 16 * TiB, max_batch=4)
    msg = str(caught[0].message)
    assert "budget_bytes=17592186044416 (16.00 TiB)" in msg, msg
    assert f"{source}" in msg and "capped at" in msg, msg
    assert result.budget_bytes <= available and result.found == 4
    assert "capped" in result.limit


def test_the_capped_budget_is_what_the_search_respects(monkeypatch):
    # a pretended host with 4 MiB available: 16 TiB is capped to 90% of it, and every trial
    # that fits stays within the cap (the smoke GPT's states alone are 1.84 MiB, a sequence
    # about 0.7 MiB more: 2 fit, 3 do not; max_batch=4 keeps the search to a few small trials)
    monkeypatch.setattr(finder, "host_memory_available", lambda: (4 * MiB, "MemAvailable"))
    with pytest.warns(UserWarning, match=r"16\.00 TiB.*4\.00 MiB available \(MemAvailable\)"):
        capped = finder.find_max_batch(SMOKE, 16 * TiB, max_batch=4)
    assert capped.budget_bytes == int(0.9 * 4 * MiB)
    assert 1 <= capped.found < 4 and capped.failures >= 1
    assert all(t.peak_bytes <= capped.budget_bytes for t in capped.trials if t.fits)
    assert "capped from the 16.00 TiB asked" in capped.limit
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # within the host: no warning, the budget as given
        assert finder.capped_budget(3 * MiB, torch.device("cpu")) == 3 * MiB


def test_a_cgroup_limit_is_the_room_left_under_it(tmp_path):
    """A container or a SLURM job's cgroup: its limit less its use (reclaimable page cache
    counted as room) is what the OOM killer allows, whatever MemAvailable says."""
    v2, v1, free = tmp_path / "v2", tmp_path / "v1", tmp_path / "unlimited"
    for folder, files in ((v2, {"memory.max": "1073741824", "memory.current": "805306368",
                                "memory.stat": "anon 1\ninactive_file 134217728\n"}),
                          (v1, {"memory.limit_in_bytes": "1073741824",
                                "memory.usage_in_bytes": "805306368",
                                "memory.stat": "cache 5\ntotal_inactive_file 134217728\n"}),
                          (free, {"memory.max": "max", "memory.current": "1",
                                  "memory.stat": ""})):  # fmt: skip
        folder.mkdir()
        for name, text in files.items():
            (folder / name).write_text(text)
    assert finder._cgroup_room(v2) == finder._cgroup_room(v1) == 384 * MiB
    assert finder._cgroup_room(free) is None and finder._cgroup_room(tmp_path) is None
    available, source = finder.host_memory_available()  # this machine: a number and its source
    assert available > 0 and ("MemAvailable" in source or "cgroup" in source)


def test_a_cuda_budget_beyond_the_free_memory_is_capped(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda _d=None: (3 * GiB, 24 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda _d=None: 1 * GiB)
    cuda = torch.device("cuda", 0)
    with pytest.warns(UserWarning, match=r"20\.00 GiB\) is more than the 4\.00 GiB cuda:0 has "
                                         r"free"):  # fmt: skip
        assert finder.capped_budget(20 * GiB, cuda) == int(0.9 * 4 * GiB)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert finder.capped_budget(2 * GiB, cuda) == 2 * GiB  # fits: unchanged
        assert finder.capped_budget(None, cuda) is None  # the whole card: its own OOM
        assert finder.capped_budget(30 * GiB, cuda) == 30 * GiB  # beyond the card: refused later


def test_an_allocator_refusal_becomes_the_finders_own_message():
    torch.manual_seed(0)
    model = finder.GPT(SMOKE)
    refusal = ("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't "
               "allocate memory: you tried to allocate 512000000000 bytes. Error code 12 "
               "(Cannot allocate memory)")  # fmt: skip

    def refuse_big_batches(_module, args):
        if args[0].shape[0] >= 8:
            raise RuntimeError(refusal)  # what torch's CPU allocator raises

    model.blocks[0].register_forward_pre_hook(refuse_big_batches)
    with pytest.raises(finder.HostMemoryError) as err:
        finder.find_max_batch(model, 16 * MiB, start=8)
    msg = str(err.value)
    assert isinstance(err.value, Exception)
    assert msg.startswith("the trial at micro-batch 8 asked this host for 476.84 GiB"), msg
    assert "give a smaller budget_bytes or max_batch" in msg, msg
    with pytest.raises(RuntimeError, match="a bug"):  # any other error is a bug: let through

        def bug(_module, _args):
            raise RuntimeError("a bug")

        model.blocks[1].register_forward_pre_hook(bug)
        finder.find_max_batch(model, 16 * MiB, start=2)


# --- quiz files ---------------------------------------------------------------------------------


def test_a_quiz_file_that_is_not_utf8_is_named_with_the_byte_offset(tmp_path):
    path = tmp_path / "01.json"
    path.write_bytes('{"notebook": "01",\n "title": "Caf\u00e9"}'.encode("latin-1"))
    with pytest.raises(quiz.QuizBankError) as err:
        quiz.load_file(path)
    msg = str(err.value)
    assert msg.startswith(f"{path}: not UTF-8: byte 33 (0xe9, line 2)"), msg
    assert "quiz files must be UTF-8" in msg, msg
