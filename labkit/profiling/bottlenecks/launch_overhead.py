"""Bottleneck 2, Python overhead and many small kernels: eager against ``torch.compile``.

A small model is launch-bound: each operator costs microseconds of Python and dispatch
whatever its size. ``torch.compile`` fuses operators into fewer, larger kernels and, with
``mode="reduce-overhead"`` on CUDA, replays the step as a CUDA graph with one launch.
:func:`measure_compile` times the compile, checks the compiled loss against eager's
(:func:`compile_loss_rtol`), then alternates eager and compiled steps. A module of its own
because compiling brings its own machinery: inductor's on-disk cache
(:func:`use_inductor_cache`), the C++ compiler it needs on a CPU (:func:`check_compiler`), and
failures turned into :class:`CompileUnavailable` naming the fix.

A cold compile of the smoke GPT (forward and backward) takes about a minute on a 2-core
machine, nearly all of it building C++ kernels; with inductor's cache warm it takes seconds.

Source: ``torch.compile`` https://docs.pytorch.org/docs/stable/generated/torch.compile.html.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from labkit import timing
from labkit.config import RunConfig
from labkit.data import get_batch, load_splits
from labkit.errors import LabkitError
from labkit.jobs import procs
from labkit.profiling.bottlenecks.common import (
    BeforeAfter,
    Measured,
    fresh_models,
    phased_step,
    run_device,
    step_tokens,
)
from labkit.train import DTYPES, autocast

INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


def use_inductor_cache() -> Path:
    """Point inductor's on-disk cache at ``labkit_home()/inductor`` unless the user chose one.

    By default the cache lives in the temp directory (``/tmp/torchinductor_<user>``:
    https://docs.pytorch.org/tutorials/recipes/torch_compile_caching_tutorial.html), which a
    launcher or a cleaned ``/tmp`` throws away, and a cold compile of even the smoke GPT costs
    tens of seconds on a 2-core machine. labkit's launcher gives jobs the same folder. Called
    by :func:`measure_compile`, never at import. Inductor reads the variable when it first
    needs the cache, so call this before the first compile in the process.
    """
    current = os.environ.get(INDUCTOR_CACHE_ENV)
    # Torch fills the variable in with its default the first time anything asks for the cache
    # folder (torch._inductor.runtime.cache_dir_utils.cache_dir; the profiler's memory
    # timeline does), so "set" is not "chosen by the user": the default value is replaced too.
    if current is None or current == _torch_default_cache_dir():
        os.environ[INDUCTOR_CACHE_ENV] = str(procs.labkit_home() / "inductor")
    return Path(os.environ[INDUCTOR_CACHE_ENV])


def _torch_default_cache_dir() -> str | None:
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:  # pragma: no cover - older or newer torch: keep what is set
        return None
    return default_cache_dir()


class CompileUnavailable(RuntimeError, LabkitError):
    """``torch.compile`` cannot build kernels here (no C++ compiler on CPU, no Triton on CUDA)."""


_CXX_FIX = ("inductor turns the model into C++ on a CPU and needs a C++ compiler: install "
            "one (Debian/Ubuntu: `sudo apt install g++`; conda: `conda install -c conda-forge "
            "gxx`) or name yours in the CXX environment variable, then restart the kernel")  # fmt: skip


def check_compiler(device: torch.device | str = "cpu") -> str:
    """The C++ compiler inductor will use on a CPU, found the way inductor finds it.

    Raises :class:`CompileUnavailable` naming the fix when there is none. On CUDA inductor
    writes Triton kernels instead; that is checked by compiling.
    """
    if timing.as_device(device).type != "cpu":
        return "not needed (inductor generates Triton kernels on CUDA)"
    from torch._inductor import config as inductor_config  # the search inductor runs itself
    from torch._inductor import cpp_builder, exc

    try:
        return cpp_builder.cpp_compiler_search(tuple(inductor_config.cpp.cxx))
    except exc.InvalidCxxCompiler as err:
        tried = [c for c in inductor_config.cpp.cxx if c]
        raise CompileUnavailable(f"no working C++ compiler (tried {tried}): {_CXX_FIX}") from err


@dataclass(frozen=True, kw_only=True)
class CompileResult(BeforeAfter):
    """Eager (before) against ``torch.compile`` (after), with the compile's own cost."""

    compile_s: float
    """Wall time of the compiled model's first forward + backward: tracing, code generation,
    building kernels (or loading them from the cache) and running them once."""
    loss_eager: float
    loss_compiled: float
    """The losses of one batch, compared before any timing."""
    rtol: float
    atol: float
    mode: str
    scope: Literal["model", "blocks"]
    cache_dir: str
    cache: str
    """What inductor's FX-graph cache did during the first call: "cold" (compiled every
    graph), "warm" (loaded every graph), "mixed", or "unknown"."""

    @property
    def break_even_steps(self) -> float:
        """Steps after which the compile has paid for itself (inf if it never does)."""
        saved = self.before.median_s - self.after.median_s
        return self.compile_s / saved if saved > 0 else math.inf

    def _footer(self) -> list[str]:
        return [f"compile (first forward+backward): {self.compile_s:.1f} s, inductor cache "
                f"{self.cache} ({self.cache_dir}); loss eager {self.loss_eager:.6f}, compiled "
                f"{self.loss_compiled:.6f} (tolerance rtol={self.rtol:g}, atol={self.atol:g})",
                *super()._footer()]  # fmt: skip


def _cache_counts() -> tuple[int, int] | None:
    try:
        from torch._dynamo.utils import counters
    except ImportError:  # pragma: no cover - every torch 2.x has it
        return None
    return counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]


def _cache_state(before: tuple[int, int] | None, after: tuple[int, int] | None) -> str:
    if before is None or after is None:
        return "unknown"
    hits, misses = after[0] - before[0], after[1] - before[1]
    if hits and not misses:
        return "warm"
    if misses and not hits:
        return "cold"
    return "mixed" if hits else "unknown"


def _compile(model: nn.Module, scope: str, mode: str | None, dynamic: bool,
             backend: str = "inductor") -> nn.Module:
    if scope == "model":
        return torch.compile(model, mode=mode, dynamic=dynamic, backend=backend)  # type: ignore[return-value]
    # Regional compilation: compile the repeated block, not the whole model. The blocks share
    # one compiled graph (their parameters are inputs, not constants, since PyTorch 2.5), so
    # inductor compiles one block's forward and backward instead of the whole network:
    # https://docs.pytorch.org/tutorials/recipes/regional_compilation.html
    for block in model.blocks:  # type: ignore[union-attr]
        block.compile(mode=mode, dynamic=dynamic, backend=backend)
    return model


def compile_loss_rtol(dtype: str) -> float:
    """How far a compiled model's loss may be from eager's, relative, in precision ``dtype``.

    float32: 1e-4 (fused kernels only reorder sums). In bf16 or fp16 eager rounds every
    intermediate to the 16-bit format while inductor keeps a fused kernel's intermediates in
    float32, so the two may differ by a unit of the format: 2 × its eps (``torch.finfo``: bf16
    2**-7, fp16 2**-10).
    """
    if dtype == "float32":
        return 1e-4
    return 2 * torch.finfo(DTYPES[dtype]).eps


def measure_compile(cfg: RunConfig, *, device: torch.device | str | None = None,
                    mode: str | None = "auto", scope: Literal["model", "blocks"] = "model",
                    dynamic: bool = False, rounds: int = 10, warmup: int = 2,
                    rtol: float | None = None, atol: float = 1e-5,
                    backend: str = "inductor") -> CompileResult:
    """Compile the GPT, time the compile, check its loss against eager, then time both.

    1. Two copies of one initialised GPT, each with its own AdamW. One is compiled:
       ``scope="model"`` compiles the whole model; ``scope="blocks"`` only its transformer
       blocks (regional compilation: less to compile, so a shorter cold start).
       ``mode="auto"`` is inductor's default on CPU and ``"reduce-overhead"`` (CUDA graphs:
       one launch replays the step's kernels) on CUDA. ``dynamic=False``: the shapes never
       change here, so no dynamic-shape graph is attempted.
    2. The compiled copy's first forward + backward on a batch is timed (``compile_s``), and
       its loss must equal eager's on the same batch within ``|Δ| <= atol + rtol·|eager|``
       (fused kernels reorder sums, so not bit for bit; ``rtol=None`` is
       :func:`compile_loss_rtol` of ``cfg.train.dtype``), else ValueError. No
       optimizer step is taken, so both copies still hold the same weights.
    3. Eager and compiled training steps alternate (``labkit.timing.alternate``: E C, C E, ...)
       on the same batches; ``warmup`` rounds are not counted (CUDA graphs record there).

    ``backend`` is torch.compile's: "inductor" (the default, what generates fused kernels) or,
    say, "aot_eager" (traces forward and backward but runs them with eager kernels: no code
    generation, so seconds instead of a minute, and no speed-up; the tests use it to check
    this function's own work).

    Inductor's cache goes to ``labkit_home()/inductor`` unless TORCHINDUCTOR_CACHE_DIR is set
    (:func:`use_inductor_cache`): a second run loads the kernels instead of building them.
    Raises :class:`CompileUnavailable` when there is no C++ compiler (CPU) or the backend fails.
    """
    if scope not in ("model", "blocks"):
        raise ValueError(f"scope={scope!r} is not allowed: 'model' or 'blocks'")
    device = run_device(cfg, device)
    if mode == "auto":
        mode = "reduce-overhead" if device.type == "cuda" else None
    cache_dir = use_inductor_cache()
    if backend == "inductor":
        check_compiler(device)
    (eager, opt_e), (base, opt_c) = fresh_models(cfg, device, 2)
    compiled = _compile(base, scope, mode, dynamic, backend)
    # CUDA graphs: https://docs.pytorch.org/docs/stable/generated/torch.compile.html
    cudagraphs = device.type == "cuda" and mode in ("reduce-overhead", "max-autotune")

    train, _ = load_splits()
    g = torch.Generator().manual_seed(cfg.train.seed)
    n_batches = warmup + rounds + 1
    batches = [get_batch(train, cfg.train.micro_batch, cfg.model.seq_len, g, device)
               for _ in range(n_batches)]  # fmt: skip

    dtype = cfg.train.dtype  # both copies train in the run's precision (phased_step)
    if rtol is None:
        rtol = compile_loss_rtol(dtype)
    x, y = batches[0]
    with autocast(device, dtype):
        _, loss_e = eager(x, y)
    loss_e.backward()
    counts = _cache_counts()
    timing.synchronize(device)
    t0 = time.perf_counter()
    try:
        if cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        with autocast(device, dtype):
            _, loss_c = compiled(x, y)
        loss_c.backward()
        timing.synchronize(device)
    except Exception as err:
        raise _compile_error(err, device) from err
    compile_s = time.perf_counter() - t0
    cache = _cache_state(counts, _cache_counts())
    loss_eager, loss_compiled = loss_e.item(), loss_c.item()
    if not abs(loss_compiled - loss_eager) <= atol + rtol * abs(loss_eager):
        raise ValueError(f"compiled loss {loss_compiled!r} differs from eager {loss_eager!r} by "
                         f"more than atol={atol:g} + rtol={rtol:g}·|eager|: the compiled model "
                         "does not compute what the eager one does; nothing was timed")  # fmt: skip
    opt_e.zero_grad(set_to_none=True)
    opt_c.zero_grad(set_to_none=True)

    losses: dict[str, list[float]] = {"eager": [], "compiled": []}

    def stepper(name: str, model: nn.Module, opt: torch.optim.Optimizer) -> Callable[[], float]:
        def one_step() -> float:
            x, y = batches[1 + len(losses[name]) % (n_batches - 1)]
            timing.synchronize(device)
            t0 = time.perf_counter()
            if cudagraphs and model is compiled:
                torch.compiler.cudagraph_mark_step_begin()  # a new iteration: outputs reused
            loss = phased_step(model, opt, x, y, dtype=dtype)
            value = float(loss)  # synchronises; read now, before a CUDA graph reuses its memory
            t = time.perf_counter() - t0
            losses[name].append(value)
            return t
        return one_step

    samples = timing.alternate({"eager": stepper("eager", eager, opt_e),
                                "compiled": stepper("compiled", compiled, opt_c)},
                               rounds=rounds, warmup=warmup)  # fmt: skip
    tokens = step_tokens(cfg)
    method = "perf_counter per training step, loss read each step (synchronises)"
    mode_name = mode or "default"
    eager_m = Measured(name="eager", step_s=tuple(samples["eager"]), tokens_per_step=tokens,
                       device=str(device), method=method, losses=tuple(losses["eager"]),
                       settings={"compiled": False})  # fmt: skip
    comp_m = Measured(name=f"compiled ({scope}, mode={mode_name})",
                      step_s=tuple(samples["compiled"]), tokens_per_step=tokens,
                      device=str(device), method=method, losses=tuple(losses["compiled"]),
                      settings={"compiled": True, "scope": scope, "mode": mode_name,
                                "dynamic": dynamic})  # fmt: skip
    if device.type == "cuda":
        note = ("On a GPU a small model is launch-bound: the compiled step launches fewer, "
                "fused kernels, and reduce-overhead replays them as one CUDA graph.")
    else:
        note = ("On a CPU there are no GPU launches to save: the gain is fewer passes over "
                "memory (fused element-wise operations) and less Python and dispatch per step.")
    return CompileResult(
        bottleneck="Python overhead / small kernels (torch.compile)", before=eager_m,
        after=comp_m, variants=(eager_m, comp_m), note=note, compile_s=compile_s,
        loss_eager=loss_eager, loss_compiled=loss_compiled, rtol=rtol, atol=atol,
        mode=mode_name, scope=scope, cache_dir=str(cache_dir), cache=cache,
    )


def _compile_error(err: Exception, device: torch.device) -> Exception:
    """A compile failure as CompileUnavailable naming the fix; other errors unchanged."""
    from torch._dynamo.exc import BackendCompilerFailed
    from torch._inductor.exc import InvalidCxxCompiler

    chain: list[BaseException] = []
    e: BaseException | None = err
    while e is not None and e not in chain:
        chain.append(e)
        e = getattr(e, "inner_exception", None) or e.__cause__
    if any(isinstance(c, InvalidCxxCompiler) for c in chain):
        return CompileUnavailable(f"torch.compile found no working C++ compiler: {_CXX_FIX}")
    if isinstance(err, BackendCompilerFailed):
        fix = (_CXX_FIX if device.type == "cpu" else
               "inductor writes Triton kernels on CUDA: `pip install triton` (it ships with "
               "the CUDA wheels of torch) and check the GPU is supported")
        first = str(err).strip().splitlines()
        return CompileUnavailable(f"torch.compile could not build the model's kernels "
                                  f"({first[-1] if first else type(err).__name__}); {fix}. "
                                  "The eager model still works: skip the compiled run")  # fmt: skip
    return err


