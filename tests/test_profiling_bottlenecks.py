"""labkit.profiling.bottlenecks: the planted bottlenecks compute the right thing and clean up.

Speed is never asserted (a shared 2-core machine decides nothing): these tests check that the
slow dataset yields labkit.data's windows, that every loader variant yields the same batches,
that the measurements have one sample per step with the phases recorded, that a failing worker
surfaces clearly without leaving processes, and that compiled and eager agree.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest
import torch

from labkit import verdict
from labkit.config import ModelConfig, RunConfig, TrainConfig
from labkit.data import BatchIterator, load_splits
from labkit.profiling import bottlenecks as bn
from labkit.profiling.bottlenecks import common, data_loading, host_sync, launch_overhead

TINY = RunConfig(
    model=ModelConfig(vocab_size=256, seq_len=16, n_layer=1, n_head=2, d_model=16),
    train=TrainConfig(micro_batch=4, steps=4, device="cpu", seed=0),
)


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _wait_for_children(expected: set[int], timeout_s: float = 10.0) -> set[int]:
    """Children beyond ``expected`` still alive after up to ``timeout_s`` (none, hopefully)."""
    deadline = time.monotonic() + timeout_s
    while (extra := _children() - expected) and time.monotonic() < deadline:
        time.sleep(0.1)
    return extra


# ---------------------------------------------------------------------------------------
# The dataset


def test_every_item_is_labkit_datas_window_with_y_shifted_by_one():
    train = load_splits().train
    ds = bn.TokenizingDataset(train, seq_len=64)
    windows = BatchIterator(train, 1, 64).windows  # (n, 65): labkit.data's windows
    assert len(ds) == windows.shape[0]
    for i in range(len(ds)):  # the whole corpus: cleaning must be the identity on all of it
        x, y = ds[i]
        assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (64,)
        assert torch.equal(x, windows[i, :-1].long()), f"item {i}"
        assert torch.equal(y, windows[i, 1:].long()), f"item {i}"
    x, y = ds[10]
    assert torch.equal(y[:-1], x[1:])


def test_more_passes_give_the_same_tokens():
    ds1 = bn.TokenizingDataset(seq_len=32, passes=1, n_items=8)
    ds5 = bn.TokenizingDataset(seq_len=32, passes=5, n_items=8)
    for i in range(8):
        assert all(torch.equal(a, b) for a, b in zip(ds1[i], ds5[i], strict=True))


def test_tokenize_round_trips_any_bytes_including_invalid_utf8():
    raw = "café, naïve_x = 3 ² 'll\n\t".encode() + b"\xff\x80\x00z"
    assert bytes(bn.tokenize(raw)) == raw


def test_text_that_cleaning_changes_is_refused_with_a_clear_error():
    decomposed = "e\u0301" * 20  # e + combining acute: NFC composes each pair into one "é"
    data = torch.frombuffer(bytearray(decomposed.encode()), dtype=torch.uint8)
    ds = bn.TokenizingDataset(data, seq_len=8)
    with pytest.raises(bn.DatasetItemError, match="cleaning changed the window"):
        ds[0]


@pytest.mark.parametrize("kwargs", [{"seq_len": 0}, {"passes": 0}, {"n_items": 0},
                                    {"n_items": 10**9}, {"data": torch.zeros(10)}])  # fmt: skip
def test_dataset_refuses_bad_arguments(kwargs):
    with pytest.raises(ValueError, match=r"not allowed|must be"):
        bn.TokenizingDataset(**kwargs)


def test_calibrate_passes_returns_a_positive_count():
    assert bn.calibrate_passes(1e-9, batch_size=8) == 1  # less than one pass costs
    assert bn.calibrate_passes(0.05, batch_size=8, items=4) > 1
    with pytest.raises(ValueError, match="seconds > 0"):
        bn.calibrate_passes(0.0, batch_size=8)


# ---------------------------------------------------------------------------------------
# Loaders


def _batches(loader, n):
    with bn.BatchStream(loader) as stream:
        return [next(stream) for _ in range(n)], stream.epochs


def test_loader_variants_yield_the_same_batches_in_the_same_order():
    ds = bn.TokenizingDataset(seq_len=16, passes=2, n_items=24)
    before = _children()
    variants = [bn.LoaderVariant("w0"), bn.LoaderVariant("w2", num_workers=2),
                bn.LoaderVariant("w2p", num_workers=2, prefetch_factor=3,
                                 persistent_workers=True)]  # fmt: skip
    got = [_batches(bn.make_loader(ds, v, batch_size=4, seed=7), 15) for v in variants]
    reference, epochs = got[0]
    assert epochs == 3  # 6 batches per epoch: 15 batches cross two epoch boundaries
    for batches, _ in got[1:]:
        for (x0, y0), (x, y) in zip(reference, batches, strict=True):
            assert torch.equal(x0, x) and torch.equal(y0, y)
    # each epoch holds every item once, in a new shuffled order
    epoch1 = [tuple(row.tolist()) for x, _ in reference[:6] for row in x]
    epoch2 = [tuple(row.tolist()) for x, _ in reference[6:12] for row in x]
    assert sorted(epoch1) == sorted(epoch2) and len(set(epoch1)) == 24
    assert epoch1 != epoch2
    assert not _wait_for_children(before), "loader workers outlived their BatchStream"


def test_loader_variants_ladder_and_pin_memory_only_on_cuda():
    cpu = bn.loader_variants("cpu", workers=2)
    assert [v.num_workers for v in cpu] == [0, 2, 2]
    assert not any(v.pin_memory for v in cpu)
    assert cpu[-1].persistent_workers and cpu[-1].prefetch_factor == 4
    cuda = bn.loader_variants("cuda", workers=3)  # only builds descriptions: no GPU needed
    assert [v.pin_memory for v in cuda] == [False, False, True, True]
    ds = bn.TokenizingDataset(seq_len=16, n_items=8)
    with pytest.raises(ValueError, match="pin_memory only speeds"):
        bn.make_loader(ds, cuda[2], batch_size=4, device="cpu")
    with pytest.raises(ValueError, match="need worker"):
        bn.LoaderVariant("bad", prefetch_factor=2)


def test_measure_loader_has_one_sample_per_step_and_records_the_phases():
    ds = bn.TokenizingDataset(seq_len=16, passes=2, n_items=16)
    (model, opt), = common.fresh_models(TINY, torch.device("cpu"), 1)
    loader = bn.make_loader(ds, bn.LoaderVariant("w0"), batch_size=4)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        m = bn.measure_loader(model, opt, loader, steps=5, warmup=1, name="w0")
    assert len(m.step_s) == len(m.data_s) == len(m.compute_s) == 5
    assert all(d > 0 for d in m.data_s) and all(c > 0 for c in m.compute_s)
    assert len(m.losses) == 6 and m.tokens_per_step == 4 * 16
    assert 0 < m.data_share < 1 and m.tokens_per_s > 0
    counts = {name: 0 for name in ("data", "forward", "backward", "optimizer")}
    for event in prof.events():
        if event.name in counts:
            counts[event.name] += 1
    assert counts == {name: 6 for name in counts}  # warm-up step included: every step is phased


def test_data_loading_study_trains_every_variant_on_the_same_batches():
    ds = bn.TokenizingDataset(seq_len=16, passes=2, n_items=16)
    before = _children()
    lines: list[str] = []
    variants = [bn.LoaderVariant("w0"), bn.LoaderVariant("w1", num_workers=1)]
    res = bn.measure_data_loading(TINY, ds, variants=variants, steps=3, warmup=1, rounds=2,
                                  progress=lines.append)  # fmt: skip
    assert res.before.name == "w0" and res.after.name == "w1"
    assert [len(m.step_s) for m in res.variants] == [6, 6]  # 2 rounds x 3 steps
    assert res.before.losses == res.after.losses  # same model, same batches, same order
    assert len(lines) == 4 and res.device == "cpu" and "pin_memory" in res.note
    assert "w0" in str(res) and "<table>" in res._repr_html_()
    assert verdict.contradictions(str(res)) == []  # the printed verdict fits its numbers
    assert not _wait_for_children(before)


@pytest.mark.parametrize("variant", [bn.LoaderVariant("w2", num_workers=2),
                                     bn.LoaderVariant("w2p", num_workers=2,
                                                      persistent_workers=True)],
                         ids=["workers", "persistent"])  # fmt: skip
def test_a_failing_worker_surfaces_clearly_and_leaves_no_process(variant):
    ds = bn.TokenizingDataset(seq_len=16, n_items=16, fail_at=5)
    (model, opt), = common.fresh_models(TINY, torch.device("cpu"), 1)
    loader = bn.make_loader(ds, variant, batch_size=4)
    before = _children()
    with pytest.raises(bn.LoaderError) as info:
        bn.measure_loader(model, opt, loader, steps=8, warmup=0)
    message = str(info.value)
    assert "item 5: planted fault" in message and "fix the Dataset" in message
    assert "num_workers=2" in message
    assert isinstance(info.value.__cause__, bn.DatasetItemError)  # the worker's own error, chained
    assert not _wait_for_children(before), "a failed loader left worker processes running"


# ---------------------------------------------------------------------------------------
# torch.compile


def test_inductor_cache_goes_to_labkit_home_unless_set(monkeypatch, tmp_path):
    monkeypatch.setenv("LABKIT_HOME", str(tmp_path))
    monkeypatch.delenv(bn.INDUCTOR_CACHE_ENV, raising=False)
    assert bn.use_inductor_cache() == tmp_path / "inductor"
    assert os.environ[bn.INDUCTOR_CACHE_ENV] == str(tmp_path / "inductor")
    monkeypatch.setenv(bn.INDUCTOR_CACHE_ENV, str(tmp_path / "mine"))
    assert bn.use_inductor_cache() == tmp_path / "mine"
    # torch writes its own default into the variable when anything first asks for the cache
    # (the profiler's memory timeline does): that is not a user's choice, and is replaced
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv(bn.INDUCTOR_CACHE_ENV, default_cache_dir())
    assert bn.use_inductor_cache() == tmp_path / "inductor"


def test_importing_sets_nothing():
    env = {k: v for k, v in os.environ.items() if k != bn.INDUCTOR_CACHE_ENV}
    code = ("import os, labkit.profiling.bottlenecks, torch; "
            f"print(os.environ.get('{bn.INDUCTOR_CACHE_ENV}'), torch.cuda.is_initialized())")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True, timeout=120).stdout.split()  # fmt: skip
    assert out == ["None", "False"]


def test_no_cxx_compiler_is_a_clear_error(monkeypatch, tmp_path):
    from torch._inductor import config as inductor_config

    monkeypatch.setenv(bn.INDUCTOR_CACHE_ENV, str(tmp_path))

    # inductor's own way to change its config for a while (monkeypatch's undo breaks it)
    with inductor_config.patch({"cpp.cxx": (None, "no-such-c++-compiler")}):
        with pytest.raises(bn.CompileUnavailable, match=r"C\+\+ compiler.*install"):
            bn.check_compiler("cpu")
        with pytest.raises(bn.CompileUnavailable, match=r"g\+\+"):
            bn.measure_compile(TINY, rounds=1)
    assert bn.check_compiler("cpu")  # the real compiler is found again


def test_a_backend_failure_becomes_compile_unavailable_naming_the_fix():
    from torch._dynamo.exc import BackendCompilerFailed
    from torch._inductor.exc import InvalidCxxCompiler

    def inductor():
        pass

    err = BackendCompilerFailed(inductor, InvalidCxxCompiler(), None)
    mapped = launch_overhead._compile_error(err, torch.device("cpu"))
    assert isinstance(mapped, bn.CompileUnavailable) and "CXX" in str(mapped)
    other = ValueError("not a compile problem")
    assert launch_overhead._compile_error(other, torch.device("cpu")) is other


# backend="aot_eager": torch.compile's tracing of forward and backward, run with eager
# kernels. A cold inductor compile of even this tiny GPT takes 20-40 s on 2 cores (inductor
# itself is exercised by notebook 06 at lab size and by the CUDA test below); what is tested
# here is measure_compile's own work: parity before timing, interleaving, the record.
def test_compiled_loss_equals_eager_and_both_are_timed():
    res = bn.measure_compile(TINY, rounds=3, warmup=1, backend="aot_eager")
    assert abs(res.loss_compiled - res.loss_eager) <= res.atol + res.rtol * abs(res.loss_eager)
    assert len(res.before.step_s) == len(res.after.step_s) == 3
    assert res.compile_s > 0 and res.mode == "default" and res.scope == "model"
    # both copies trained on the same batches from the same weights: their losses track
    for e, c in zip(res.before.losses, res.after.losses, strict=True):
        assert c == pytest.approx(e, rel=1e-3)
    assert "compile (first forward+backward)" in str(res)


# ---------------------------------------------------------------------------------------
# Host-device synchronisation


def test_sync_loops_compute_the_same_losses_and_say_why_cpu_shows_nothing():
    printed: list[str] = []
    res = bn.measure_sync(TINY, read_every=3, rounds=2, warmup=1, print_fn=printed.append)
    assert res.before.losses == res.after.losses and len(res.before.losses) == 9
    assert len(res.before.step_s) == len(res.after.step_s) == 2
    assert printed == list(res.lines) and len(printed) == 9 and printed[0].startswith("step    1")
    assert res.asynchronous is False and res.device == "cpu"
    assert "no asynchronous queue" in res.note
    assert res.read_every == 3 and res.after.settings == {"read_every": 3}
    assert res.comparison().outcome == "noisy"  # 2 runs: too few for any verdict
    assert verdict.contradictions(str(res)) == []


# ---------------------------------------------------------------------------------------
# Precision: every step runs in the run's dtype (notebook 06's header names it)


def _watch(model: torch.nn.Module) -> tuple[set[torch.dtype], list[bool]]:
    """The dtypes the linear layers compute in; whether autocast was on during backward."""
    linear_out: set[torch.dtype] = set()
    backward_autocast: list[bool] = []
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_hook(lambda _m, _i, out: linear_out.add(out.dtype))
    next(model.parameters()).register_hook(
        lambda _g: backward_autocast.append(torch.is_autocast_enabled("cpu")))
    return linear_out, backward_autocast


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_phased_step_runs_the_forward_in_dtype_and_the_backward_outside_autocast(dtype):
    from labkit.model import GPT

    torch.manual_seed(0)
    model = GPT(TINY.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    linear_out, backward_autocast = _watch(model)
    x = torch.randint(0, 256, (2, TINY.model.seq_len))
    loss = bn.phased_step(model, opt, x, x, dtype=dtype)
    assert linear_out == {getattr(torch, dtype)}
    assert backward_autocast == [False]
    assert loss.dtype == torch.float32 and not loss.requires_grad  # the loss is float32 anyway


def test_every_measurement_trains_in_the_configs_dtype(monkeypatch):
    """measure_* take the dtype from cfg.train.dtype, so a bf16 run is measured in bf16."""
    seen: set[str] = set()
    real = bn.phased_step

    def spy(*args, dtype="float32", **kwargs):
        seen.add(dtype)
        return real(*args, dtype=dtype, **kwargs)

    # each bottleneck's module looks phased_step up in its own namespace
    for module in (data_loading, launch_overhead, host_sync):
        monkeypatch.setattr(module, "phased_step", spy)
    bf16 = TINY.replace(dtype="bfloat16")
    bn.measure_sync(bf16, read_every=1, rounds=1, warmup=0)
    assert seen == {"bfloat16"}
    seen.clear()
    ds = bn.TokenizingDataset(seq_len=16, passes=1, n_items=8)
    bn.measure_data_loading(bf16, ds, variants=bn.loader_variants("cpu")[:1], steps=1,
                            warmup=0, rounds=1)  # fmt: skip
    assert seen == {"bfloat16"}
    seen.clear()
    res = bn.measure_compile(bf16, rounds=1, warmup=0, backend="aot_eager")
    assert seen == {"bfloat16"} and res.rtol == bn.compile_loss_rtol("bfloat16")


def test_compile_tolerance_follows_the_precision():
    assert bn.compile_loss_rtol("float32") == 1e-4
    assert bn.compile_loss_rtol("bfloat16") == 2 * 2**-7
    assert bn.compile_loss_rtol("float16") == 2 * 2**-10


# ---------------------------------------------------------------------------------------
# The GPU tier (scripts/gpu_check.sh): the CUDA paths work; no speed is asserted

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CUDA_TINY = TINY.replace(device="cuda")


@gpu
@needs_cuda
def test_cuda_sync_is_asynchronous_and_losses_agree():
    res = bn.measure_sync(CUDA_TINY, read_every=3, rounds=2, warmup=1)
    assert res.asynchronous is True and res.device.startswith("cuda")
    assert res.after.losses == pytest.approx(res.before.losses, rel=1e-4)
    assert "cudaStreamSynchronize" in res.note


@gpu
@needs_cuda
def test_cuda_loaders_pin_memory_and_train_on_the_same_batches():
    ds = bn.TokenizingDataset(seq_len=16, passes=2, n_items=16)
    variants = bn.loader_variants("cuda", workers=1)
    assert any(v.pin_memory for v in variants)
    before = _children()
    res = bn.measure_data_loading(CUDA_TINY, ds, variants=variants, steps=3, warmup=1, rounds=1)
    for m in res.variants[1:]:
        assert m.losses == pytest.approx(res.before.losses, rel=1e-4)
    assert not _wait_for_children(before)


@gpu
@needs_cuda
def test_cuda_graphs_compile_matches_eager():
    res = bn.measure_compile(CUDA_TINY, rounds=3, warmup=2)
    assert res.mode == "reduce-overhead"
    assert abs(res.loss_compiled - res.loss_eager) <= res.atol + res.rtol * abs(res.loss_eager)
    for e, c in zip(res.before.losses, res.after.losses, strict=True):
        assert c == pytest.approx(e, rel=1e-3)
