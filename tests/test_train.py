import copy
import math

import pytest
import torch

from labkit import train
from labkit.config import ModelConfig, TrainConfig
from labkit.model import GPT

CFG = ModelConfig(seq_len=16, n_layer=2, n_head=2, d_model=32)
CPU = torch.device("cpu")


def batches(n, b, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randint(0, CFG.vocab_size, (b, CFG.seq_len), generator=g)
        out.append((x, torch.roll(x, -1, dims=1)))
    return out


def fresh(seed=0):
    torch.manual_seed(seed)
    model = GPT(CFG)
    return model, train.make_optimizer(model, TrainConfig(lr=1e-2))


def test_gradient_accumulation_equals_one_large_batch():
    """k micro-batches of b accumulate the same gradient as one batch of k·b."""
    micro = batches(4, 2)
    big = [(torch.cat([x for x, _ in micro]), torch.cat([y for _, y in micro]))]
    m1, o1 = fresh()
    m2 = copy.deepcopy(m1)
    o2 = train.make_optimizer(m2, TrainConfig(lr=1e-2))
    s1 = train.train_step(m1, o1, micro, device=CPU)
    s2 = train.train_step(m2, o2, big, device=CPU)
    assert s1.loss == pytest.approx(s2.loss, rel=1e-5)
    assert s1.tokens == s2.tokens == 4 * 2 * CFG.seq_len
    for p1, p2 in zip(m1.parameters(), m2.parameters(), strict=True):
        # Adam divides by sqrt(v): float rounding in tiny gradients shows at ~1e-5.
        torch.testing.assert_close(p1, p2, rtol=1e-4, atol=2e-5)


def test_no_sync_is_entered_for_all_but_the_last_micro_batch():
    entered = []

    class Spy:
        def __enter__(self):
            entered.append(True)

        def __exit__(self, *exc):
            return False

    model, opt = fresh()
    train.train_step(model, opt, batches(3, 2), device=CPU, no_sync=Spy)
    assert len(entered) == 2


def test_repeated_steps_reduce_the_loss():
    model, opt = fresh()
    fixed = batches(1, 4)
    first = train.train_step(model, opt, fixed, device=CPU).loss
    for _ in range(20):
        last = train.train_step(model, opt, fixed, device=CPU)
    assert last.loss < 0.8 * first
    assert last.seconds > 0 and last.tokens_per_s > 0


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_steps_run_on_cpu_autocast(dtype):
    model, opt = fresh()
    scaler = train.make_scaler(CPU, dtype)
    assert (scaler is not None) == (dtype == "float16")
    stats = train.train_step(model, opt, batches(2, 2), device=CPU, dtype=dtype, scaler=scaler,
                             grad_clip=1.0)
    assert torch.isfinite(torch.tensor(stats.loss))


def test_weight_decay_only_on_matrices():
    _, opt = fresh()
    decay, no_decay = opt.param_groups
    assert all(p.dim() >= 2 for p in decay["params"]) and decay["weight_decay"] > 0
    assert all(p.dim() < 2 for p in no_decay["params"]) and no_decay["weight_decay"] == 0


def test_empty_batches_and_missing_gpu_are_clear_errors():
    model, opt = fresh()
    with pytest.raises(ValueError, match="batches is empty"):
        train.train_step(model, opt, [], device=CPU)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU"):
            train.resolve_device("cuda")


def test_progress_prints_a_bounded_number_of_lines():
    lines = []
    progress = train.Progress(100, lines=5, print_fn=lines.append)
    stats = train.StepStats(loss=1.0, seconds=0.01, tokens=100)
    for step in range(1, 101):
        progress(step, stats)
    assert len(lines) == 5 and lines[-1].startswith("step   100/100")


def _fp16_run(scaler):
    from labkit import config, data

    cfg = config.preset("smoke").replace(steps=3, dtype="float16")
    torch.manual_seed(0)
    model = GPT(cfg.model)
    splits = data.load_splits()
    return train.train(model, cfg, splits.train, device=torch.device("cpu"), scaler=scaler)


def test_train_takes_a_scaler_or_none_or_auto(monkeypatch):
    from labkit.precision import ManualScaler

    manual = ManualScaler(growth_interval=2)  # GradScaler's defaults but a short interval
    manual_run = _fp16_run(manual)
    assert [h.step for h in manual.history] == [1, 2, 3]  # the scaler given was the one used
    assert manual.history[2].scale == 2 * manual.history[0].scale  # grew after 2 clean steps
    auto_run = _fp16_run("auto")  # GradScaler: the same rule, and no growth in 3 steps
    assert auto_run.loss[:2] == manual_run.loss[:2]  # the scales differ only from step 3

    def no_default(*args):
        raise AssertionError("scaler=None must not fall back to the default scaler")

    monkeypatch.setattr(train, "make_scaler", no_default)
    unscaled = _fp16_run(None)  # no scaler at all: fp16 gradients as they come
    assert len(unscaled.loss) == 3
    with pytest.raises(ValueError, match="'auto', None"):
        _fp16_run("yes")


def test_the_optimizer_uses_the_configured_adam_eps():
    model, _ = fresh()
    optimizer = train.make_optimizer(model, TrainConfig(adam_eps=1e-12))
    assert {g["eps"] for g in optimizer.param_groups} == {1e-12}
    assert TrainConfig().adam_eps == 1e-8  # PyTorch's AdamW default


def test_pin_batches_leaves_cpu_batches_alone():
    given = batches(2, 2)
    got = train.pin_batches(given, CPU)
    assert all(gx is x and gy is y for (gx, gy), (x, y) in zip(got, given, strict=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_pin_batches_pins_for_cuda():
    got = train.pin_batches(batches(2, 2), torch.device("cuda", 0))
    assert all(x.is_pinned() and y.is_pinned() for x, y in got)


def test_history_records_data_and_iteration_time_beside_the_step():
    h = train.History()
    stats = train.StepStats(loss=1.0, seconds=0.5, tokens=100)
    h.record(1, stats, lr=1e-3)  # a caller that times only the step
    h.record(2, stats, lr=1e-3, data_s=0.25, iteration_s=1.0)
    assert h.seconds == [0.5, 0.5] and h.data_seconds[1:] == [0.25]
    assert math.isnan(h.data_seconds[0]) and math.isnan(h.iteration_seconds[0])
    assert h.iteration_tokens_per_s(skip=1) == 100.0
    assert math.isnan(h.iteration_tokens_per_s(skip=0))  # an untimed iteration in the range
    assert h.tokens_per_s(skip=0) == 200.0


def test_train_times_the_whole_iteration_around_the_step():
    from labkit.config import RunConfig
    cfg = RunConfig(model=CFG, train=TrainConfig(micro_batch=2, steps=3, warmup_steps=1))
    torch.manual_seed(0)
    data = torch.randint(0, CFG.vocab_size, (500,))
    h = train.train(GPT(CFG), cfg, data, device=CPU)
    assert len(h.data_seconds) == len(h.iteration_seconds) == 3
    # the iteration's clock starts before the batches and stops after the synchronised step
    for step_s, data_s, iteration_s in zip(h.seconds, h.data_seconds, h.iteration_seconds,
                                           strict=True):
        assert 0 <= data_s and step_s + data_s <= iteration_s


class _FakeCuda:
    """A device whose type says CUDA, so PinAhead uses its helper thread (pinning itself
    needs CUDA: pin_batches is replaced below)."""

    type = "cuda"


def test_pin_ahead_draws_the_next_steps_batches_on_a_helper_thread(monkeypatch):
    import threading

    from labkit import train as tr

    drawn_on: list[str] = []

    def stream():
        for i in range(10):
            drawn_on.append(threading.current_thread().name)
            yield [(torch.full((1,), i), torch.full((1,), i))]

    monkeypatch.setattr(tr, "pin_batches", lambda batches, device: list(batches))
    with tr.PinAhead(stream(), _FakeCuda()) as ahead:
        got = [int(ahead.get(more=i < 3)[0][0]) for i in range(4)]
    assert got == [0, 1, 2, 3]  # the same order as drawing in the main thread
    assert len(drawn_on) == 4  # nothing drawn that no step uses
    assert all(name.startswith("labkit-pin") for name in drawn_on)
    cpu = tr.PinAhead(stream(), torch.device("cpu"))
    assert cpu.pool is None and int(cpu.get(more=True)[0][0][0]) == 0
    assert drawn_on[-1] == threading.current_thread().name  # on a CPU: drawn when asked
