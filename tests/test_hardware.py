"""labkit.hardware: detection on this machine, the GPU branch through fakes, the peak table."""

from __future__ import annotations

import contextlib
import os
import re
import warnings
from types import SimpleNamespace

import pytest
import torch

from labkit import hardware as hw
from labkit.hardware import ceilings

HAS_CUDA = torch.cuda.is_available()
HAS_NVIDIA_DRIVER = os.path.exists("/proc/driver/nvidia/version")


# ---------------------------------------------------------------------------------------------
# Fakes for torch.cuda and NVML, so the GPU branch is tested on CPU machines.


class FakeCuda:
    def __init__(self, names: list[str]):
        self.names = names

    def is_available(self) -> bool:
        return bool(self.names)

    def device_count(self) -> int:
        return len(self.names)

    def get_device_properties(self, i: int) -> SimpleNamespace:
        return SimpleNamespace(
            name=self.names[i],
            total_memory=80 * 2**30,
            major=9,
            minor=0,
            uuid=f"0000000{i}-aaaa-bbbb-cccc-dddddddddddd",
        )


def make_nvml(names: list[str], init_error: str | None = None, broken_field: bool = False):
    """A stand-in for the pynvml module. NVML raises one NVMLError subclass per error code;
    labkit recognises them by class name, so the fake only has to name them the same way."""
    errors = {n: type(n, (Exception,), {}) for n in ("NVMLError_LibraryNotFound", "NVMLError")}
    calls = []

    def init():
        calls.append("init")
        if init_error:
            raise errors.get(init_error, type(init_error, (Exception,), {}))("fake failure")

    def memory(handle):
        if broken_field:
            raise errors["NVMLError"]("Not Supported")
        return SimpleNamespace(total=141 * 10**9)

    return SimpleNamespace(
        calls=calls,
        nvmlInit=init,
        nvmlShutdown=lambda: calls.append("shutdown"),
        nvmlDeviceGetCount=lambda: len(names),
        nvmlSystemGetDriverVersion=lambda: b"550.54.15",
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetName=lambda h: names[h],
        nvmlDeviceGetMemoryInfo=memory,
        nvmlDeviceGetCudaComputeCapability=lambda h: (9, 0),
        nvmlDeviceGetUUID=lambda h: f"GPU-{h:08d}-0000-0000-0000-000000000000",
    )


# ---------------------------------------------------------------------------------------------
# This machine


@pytest.mark.skipif(HAS_CUDA, reason="this machine has a CUDA GPU")
def test_cpu_machine_is_cpu_tier():
    assert hw.tier() == "cpu"
    info = hw.describe_tier()
    assert info.tier == "cpu"
    assert "modelled" in str(info) and "never measured" in str(info)
    assert "<b>Tier: cpu</b>" in info._repr_html_()


@pytest.mark.skipif(HAS_CUDA or HAS_NVIDIA_DRIVER, reason="this machine has an NVIDIA driver")
def test_cpu_machine_has_no_gpus_and_nvml_says_why():
    assert hw.gpu_info() == []
    ok, message = hw.nvml_status()
    assert not ok
    assert "NVML" in message or "nvidia-ml-py" in message


def test_cpu_info():
    info = hw.cpu_info()
    assert info.model_name
    assert info.logical_cores is None or info.logical_cores >= 1
    assert info.usable_cores is None or info.usable_cores >= 1
    assert set(info.flags) <= set(hw.CPU_FLAGS_OF_INTEREST)


def test_cpu_info_parses_cpuinfo(tmp_path):
    fake = tmp_path / "cpuinfo"
    fake.write_text(
        "processor\t: 0\nmodel name\t: Example CPU 9000\nflags\t\t: fpu avx2 amx_bf16 amx_tile\n\n"
        "processor\t: 1\nmodel name\t: Example CPU 9000\nflags\t\t: fpu\n"
    )
    info = hw.cpu_info(str(fake))
    assert info.model_name == "Example CPU 9000"
    assert info.flags == ("avx2", "amx_tile", "amx_bf16")
    assert info.has("amx_bf16") and not info.has("avx512_bf16")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_real_gpu_is_detected():
    gpus = hw.gpu_info()
    assert len(gpus) == torch.cuda.device_count() >= 1
    assert hw.tier() in ("single-gpu", "multi-gpu")
    assert gpus[0].memory_bytes and gpus[0].memory_bytes > 0
    peak = hw.peak_flops(gpus[0].name, torch.bfloat16)
    assert peak.known or peak.reason  # a value with a source, or a reason: never silent


# ---------------------------------------------------------------------------------------------
# The GPU branch, through fakes


def test_gpu_info_from_torch_cuda():
    gpus = hw.gpu_info(cuda=FakeCuda(["NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3"]))
    assert [g.index for g in gpus] == [0, 1]
    assert gpus[0].name == "NVIDIA H100 80GB HBM3"
    assert gpus[0].compute_capability == (9, 0)
    assert gpus[0].memory_bytes == 80 * 2**30
    assert gpus[1].uuid.startswith("GPU-")  # same form as NVML and nvidia-smi
    assert {g.source for g in gpus} == {"torch.cuda"}


def test_gpu_info_falls_back_to_nvml_and_shuts_it_down():
    nvml = make_nvml(["NVIDIA H200"])
    gpus = hw.gpu_info(cuda=FakeCuda([]), nvml=nvml)
    assert len(gpus) == 1 and gpus[0].source == "nvml"
    assert gpus[0].name == "NVIDIA H200" and gpus[0].memory_bytes == 141 * 10**9
    assert nvml.calls == ["init", "shutdown"]


def test_nvml_field_failure_is_none_not_zero():
    gpus = hw.gpu_info(cuda=FakeCuda([]), nvml=make_nvml(["NVIDIA H200"], broken_field=True))
    assert gpus[0].memory_bytes is None
    assert "N/A" in str(gpus[0])


def test_gpu_info_without_driver_is_empty():
    nvml = make_nvml(["x"], init_error="NVMLError_LibraryNotFound")
    assert hw.gpu_info(cuda=FakeCuda([]), nvml=nvml) == []


def test_nvml_status_messages():
    ok, message = hw.nvml_status(make_nvml(["NVIDIA H200"]))
    assert ok and "550.54.15" in message and "1 GPU" in message
    ok, message = hw.nvml_status(make_nvml([], init_error="NVMLError_LibraryNotFound"))
    assert not ok and "no NVIDIA driver" in message
    ok, message = hw.nvml_status(make_nvml([], init_error="NVMLError_DriverNotLoaded"))
    assert not ok and "driver not loaded" in message


def test_tiers_from_fake_gpu_counts():
    assert hw.tier(cuda=FakeCuda([])) == "cpu"
    assert hw.tier(cuda=FakeCuda(["NVIDIA H200"])) == "single-gpu"
    assert hw.tier(cuda=FakeCuda(["NVIDIA H200"] * 8)) == "multi-gpu"
    single = hw.describe_tier(cuda=FakeCuda(["NVIDIA H200"]))
    assert any("NCCL" in s for s in single.cannot_show)


def test_cpu_torch_with_visible_gpus_gets_a_note():
    info = hw.describe_tier(cuda=FakeCuda([]), nvml=make_nvml(["NVIDIA H200"]))
    assert info.tier == "cpu"
    assert any("CUDA build of torch" in n for n in info.notes)


# ---------------------------------------------------------------------------------------------
# Peak table and matching


@pytest.mark.parametrize(
    ("name", "dtype", "tflops"),
    [
        ("NVIDIA A100-SXM4-80GB", torch.bfloat16, 312),
        ("NVIDIA A100-SXM4-40GB", "fp16", 312),
        ("NVIDIA A100-PCIE-40GB", "tf32", 156),
        ("NVIDIA A100 80GB PCIe", torch.float32, 19.5),
        ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989),
        ("NVIDIA H100 80GB HBM3", "fp32", 67),
        ("NVIDIA H100 PCIe", "bf16", 756),
        ("NVIDIA H100 NVL", "bf16", 835),
        ("NVIDIA H200", torch.bfloat16, 989),
        # Names as torch.cuda.get_device_name() prints them on the GPUs self-paced learners
        # rent (Colab, AWS, GCP, Lambda), with each datasheet's dense figure.
        ("Tesla T4", torch.float16, 65),
        ("Tesla T4", "fp32", 8.1),
        ("Tesla V100-SXM2-16GB", torch.float16, 125),
        ("Tesla V100-SXM2-32GB", "fp32", 15.7),
        ("Tesla V100-PCIE-16GB", torch.float16, 112),
        ("Tesla V100-PCIE-32GB", "fp32", 14),
        ("NVIDIA A10", torch.bfloat16, 125),
        ("NVIDIA A10", "tf32", 62.5),
        ("NVIDIA A10", "fp32", 31.2),
        ("NVIDIA L4", torch.bfloat16, 121),
        ("NVIDIA L4", "tf32", 60),
        ("NVIDIA L4", "fp32", 30.3),
        ("NVIDIA L40S", torch.bfloat16, 362.05),
        ("NVIDIA L40S", "tf32", 183),
        ("NVIDIA L40S", "fp32", 91.6),
        ("NVIDIA H200", "tf32", 494.5),
        ("NVIDIA H200", torch.float32, 67),
        ("NVIDIA GH200 480GB", torch.bfloat16, 990),
        ("NVIDIA GH200 480GB", "tf32", 494),
        ("NVIDIA GH200 144G HBM3e", "fp32", 67),
    ],
)
def test_known_devices_get_their_sourced_peak(name, dtype, tflops):
    peak = hw.peak_flops(name, dtype)
    assert peak.known and peak.flops_per_s == pytest.approx(tflops * 1e12)
    assert peak.source and peak.reason is None
    assert "https://" in peak.source  # every row names the page it was read from


@pytest.mark.parametrize(
    ("name", "family", "board"),
    [
        ("Tesla T4", "T4", "T4 16GB"),
        ("Tesla V100-SXM2-32GB", "V100 SXM2", "V100 SXM2 32GB"),
        ("Tesla V100-PCIE-16GB", "V100 PCIe", "V100 PCIe 16GB"),
        ("NVIDIA A10", "A10", "A10 24GB"),
        ("NVIDIA A10G", "A10G", None),
        ("NVIDIA L4", "L4", "L4 24GB"),
        ("NVIDIA L40S", "L40S", "L40S 48GB"),
        ("NVIDIA H200", "H200 SXM", "H200 SXM 141GB"),
        ("NVIDIA GH200 480GB", "GH200", "GH200 96GB HBM3"),
        ("NVIDIA GH200 144G HBM3e", "GH200", "GH200 144GB HBM3e"),
    ],
)
def test_new_device_names_resolve_to_their_rows(name, family, board):
    match = hw.match_device(name)
    assert (match.family, match.board, match.reason) == (family, board, None)
    if board is not None:
        assert hw.memory_spec(name).device == board


def test_a10_a10g_and_a100_are_three_devices():
    """Whole tokens: "A10" borrows neither the A100's peak nor gives the A10G the A10's."""
    a10, a10g, a100 = (hw.peak_flops(n, "bf16") for n in
                       ("NVIDIA A10", "NVIDIA A10G", "NVIDIA A100-SXM4-80GB"))
    assert (a10.matched, a10g.matched, a100.matched) == ("A10", "A10G", "A100")
    assert (a10.flops_per_s, a100.flops_per_s) == (125e12, 312e12)
    # No public AWS or NVIDIA figure for the A10G: recognised, and no peak, with the reason.
    assert a10g.flops_per_s is None and a10g.source is None
    assert "AWS" in a10g.reason and "MFU is not computed" in a10g.reason
    assert hw.memory_spec("NVIDIA A10G") is None


def test_v100_form_factors_differ_and_need_naming():
    sxm = hw.peak_flops("Tesla V100-SXM2-16GB", "fp16")
    pcie = hw.peak_flops("Tesla V100-PCIE-16GB", "fp16")
    assert pcie.flops_per_s < sxm.flops_per_s
    bare = hw.peak_flops("Tesla V100", "fp16")
    assert bare.flops_per_s is None and "SXM2" in bare.reason and "PCIe" in bare.reason


@pytest.mark.parametrize(("name", "cc"), [("Tesla T4", "7.5"), ("Tesla V100-SXM2-16GB", "7.0")])
@pytest.mark.parametrize("dtype", ["bf16", "tf32"])
def test_pre_ampere_gpus_have_no_bf16_or_tf32_peak_and_say_why(name, cc, dtype):
    peak = hw.peak_flops(name, dtype)
    assert peak.flops_per_s is None and peak.matched is not None
    assert f"compute capability {cc}" in peak.reason and "8.0 (Ampere)" in peak.reason
    assert "MFU is not computed" in peak.reason


def test_dense_figures_are_half_the_sparse_ones_where_sources_say_so():
    """A row whose source quotes the datasheet's sparse figure holds half of it: exactly where
    the sheet printed only that figure and labkit halved it, within the sheet's own rounding
    where it printed both (the L40S sheet prints 362.05 dense beside 733 sparse)."""
    checked = 0
    for row in hw.PEAK_TABLE:
        found = re.search(r"\(([\d,.]+) with sparsity\)", row.source)
        if found:
            sparse = float(found.group(1).replace(",", "")) * 1e12
            rel = 2e-3 if "halved here" in row.source else 0.02
            assert row.flops_per_s == pytest.approx(sparse / 2, rel=rel), row
            checked += 1
    assert checked >= 15


def test_h100_pcie_is_not_sxm():
    sxm = hw.peak_flops("NVIDIA H100 80GB HBM3", "bf16")
    pcie = hw.peak_flops("NVIDIA H100 PCIe", "bf16")
    assert (sxm.matched, pcie.matched) == ("H100 SXM", "H100 PCIe")
    assert pcie.flops_per_s < sxm.flops_per_s


@pytest.mark.parametrize(
    "name",
    [
        "NVIDIA A100X",
        "NVIDIA GeForce RTX 4090",
        "NVIDIA H100",  # form factor unknown: SXM and PCIe differ by 30%
        "NVIDIA H200 NVL",
        "NVIDIA A100-SXM4-40GB MIG 1g.5gb",
        # Near misses of the rows above: other boards, other clocks, vGPU slices.
        "Tesla V100S-PCIE-32GB",
        "Tesla V100-SXM3-32GB",
        "Tesla V100-FHHL-16GB",
        "NVIDIA T4G",
        "NVIDIA A10M",
        "NVIDIA L40",
        "NVIDIA L40S-48Q",
        "NVIDIA L4 L40S",
        "NVIDIA GH200 NVL2",
        "NVIDIA GB200",
    ],
)
def test_unknown_devices_get_no_peak_and_a_reason(name):
    peak = hw.peak_flops(name, torch.bfloat16)
    assert peak.flops_per_s is None and peak.source is None
    assert name in peak.reason and "MFU is not computed" in peak.reason
    assert "N/A" in str(peak)


def test_cpus_get_no_peak():
    for name in ("cpu", hw.cpu_info().model_name, "Intel(R) Xeon(R) Platinum 8480+"):
        peak = hw.peak_flops(name, torch.float32)
        assert peak.flops_per_s is None
        assert "no published peak for CPUs" in peak.reason


def test_missing_dtype_row_gives_reason():
    peak = hw.peak_flops("NVIDIA H100 NVL", torch.float32)  # no source here, so not in the table
    assert peak.flops_per_s is None and peak.matched == "H100 NVL"
    assert "float32" in peak.reason and "MFU is not computed" in peak.reason


def test_every_row_is_sourced_and_unique():
    keys = [(r.device, r.dtype) for r in hw.PEAK_TABLE]
    assert len(keys) == len(set(keys))
    for row in hw.PEAK_TABLE:
        assert row.source.strip() and row.flops_per_s > 0
    for row in hw.MEMORY_TABLE:
        assert row.source.strip() and row.bandwidth_bytes_per_s > 0 and row.memory_gb > 0


def test_memory_spec():
    assert hw.memory_spec("NVIDIA H200").bandwidth_bytes_per_s == 4.8e12
    assert hw.memory_spec("NVIDIA H100 80GB HBM3").bandwidth_bytes_per_s == 3.35e12
    assert hw.memory_spec("NVIDIA A100-SXM4-80GB").device == "A100 SXM4 80GB"
    assert hw.memory_spec("NVIDIA A10").bandwidth_bytes_per_s == 600e9
    assert hw.memory_spec("Tesla T4").bandwidth_bytes_per_s == 300e9
    assert hw.memory_spec("NVIDIA GH200 480GB").bandwidth_bytes_per_s == 4.0e12
    assert hw.memory_spec("NVIDIA A100X") is None


def test_peak_lookup_rejects_bad_arguments():
    with pytest.raises(ValueError, match="device_name"):
        hw.peak_flops("", torch.bfloat16)
    with pytest.raises(ValueError, match="dtype"):
        hw.peak_flops("NVIDIA H200", 16)


# ---------------------------------------------------------------------------------------------
# Measured ceiling


def test_measured_matmul_flops_is_positive_and_labelled():
    result = hw.measured_matmul_flops(n=64, repeats=3, warmup=1)
    assert result.value > 0
    assert result.method.startswith("measured")
    assert (result.shape, result.repeats, result.device, result.dtype) == ((64, 64, 64), 3, "cpu",
                                                                          "float32")
    assert result.value == pytest.approx(2 * 64**3 / result.best_s)
    assert result.best_s <= result.median_s


def test_measured_matmul_flops_is_the_best_call_of_the_best_shape(monkeypatch):
    """A ceiling: the fastest call wins, over every shape, never a median a slow call moved."""
    # Injected seconds, one per call in the order the rounds make them:
    # (shape a, shape b) x 3 rounds. Both shapes are 1024 FLOPs.
    elapsed = iter([4.0, 2.0, 1.0, 3.0, 8.0, 9.0])

    class FakeTimer:
        def __init__(self, device):
            self.elapsed_s = float("nan")

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.elapsed_s = next(elapsed)

    monkeypatch.setattr(ceilings.timing, "Timer", FakeTimer)  # where measured_matmul_flops looks
    a, b = (4, 8, 16), (8, 8, 8)
    result = hw.measured_matmul_flops(shapes=[a, b], repeats=3, warmup=0)
    # a took 4, 1, 8 s (best 1, median 4); b took 2, 3, 9 s (best 2, median 3). By medians b
    # would win; a ceiling takes the best call, so a, at 1024 FLOP / 1 s.
    assert dict(result.per_shape) == pytest.approx({a: 1024.0, b: 512.0})
    assert (result.shape, result.value) == (a, 1024.0)
    assert (result.best_s, result.median_s) == (1.0, 4.0)
    assert "2 shapes" in result.method and "best of 3" in result.method


def test_measured_matmul_flops_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    hw.measured_matmul_flops(n=16, repeats=1, warmup=0)
    assert torch.equal(torch.rand(3), expected)


def test_measured_matmul_flops_rejects_bad_arguments():
    with pytest.raises(ValueError, match="n=0 is not allowed"):
        hw.measured_matmul_flops(n=0)
    with pytest.raises(ValueError, match="repeats"):
        hw.measured_matmul_flops(n=8, repeats=0)
    with pytest.raises(ValueError, match="dtype"):
        hw.measured_matmul_flops(dtype=torch.int32, n=8)
    with pytest.raises(ValueError, match="shapes"):
        hw.measured_matmul_flops(shapes=[(8, 8)])
    with pytest.raises(ValueError, match="shapes"):
        hw.measured_matmul_flops(shapes=[(8, 0, 8)])
    with pytest.raises(ValueError, match="shapes"):
        hw.measured_matmul_flops(shapes=[])


def test_limit_cpu_threads_sets_torch_threads_and_says_so():
    before = torch.get_num_threads()
    try:
        message = hw.limit_cpu_threads(1)
        assert torch.get_num_threads() == 1
        assert "threads: 1 (was" in message
        for bad in (0, -1, 1.0, True, 10_000):
            with pytest.raises(ValueError, match=r"is not allowed: an integer from 1 to \d+ \(threads"):
                hw.limit_cpu_threads(bad)
        assert torch.get_num_threads() == 1  # a refused call changes nothing
    finally:
        torch.set_num_threads(before)


# ---------------------------------------------------------------------------------------------
# Default precision by compute capability (pure: tested on CPU)


@pytest.mark.parametrize(
    ("capability", "dtype", "scaler"),
    [
        ((7, 0), "float16", True),  # V100
        ((7, 5), "float16", True),  # T4
        ((8, 0), "bfloat16", False),  # A100
        ((8, 6), "bfloat16", False),  # A10, A10G
        ((8, 9), "bfloat16", False),  # L4, L40S
        ((9, 0), "bfloat16", False),  # H100, H200, GH200
        ((10, 0), "bfloat16", False),  # a later GPU keeps bf16
        ((6, 0), "float32", False),  # P100: no tensor cores
        (None, "float32", False),  # no CUDA GPU: the CPU presets' float32
    ],
)
def test_default_autocast_dtype_follows_compute_capability(capability, dtype, scaler):
    choice = hw.autocast_dtype_for(capability)
    assert (choice.dtype, choice.scaler) == (dtype, scaler)
    assert choice.reason


def test_bf16_request_becomes_fp16_with_a_scaler_before_ampere():
    for cc in ((7, 0), (7, 5)):
        choice = hw.autocast_dtype_for(cc, "bfloat16")
        assert (choice.dtype, choice.scaler) == ("float16", True)
        assert "bfloat16 requested" in choice.reason and "8.0" in choice.reason
    assert hw.autocast_dtype_for((8, 0), "bfloat16").dtype == "bfloat16"
    assert hw.autocast_dtype_for(None, "bfloat16").dtype == "bfloat16"  # CPU autocast runs it


def test_float32_and_float16_requests_are_kept_and_fp16_always_gets_a_scaler():
    for cc in (None, (7, 5), (8, 0), (9, 0)):
        assert hw.autocast_dtype_for(cc, "float32")[:2] == ("float32", False)
        assert hw.autocast_dtype_for(cc, "float16")[:2] == ("float16", True)


def test_autocast_dtype_for_rejects_bad_arguments():
    for bad in ((8,), (8, "0"), "8.0", 8.0, (8, -1), (True, 0)):
        with pytest.raises(ValueError, match="get_device_capability"):
            hw.autocast_dtype_for(bad)
    with pytest.raises(ValueError, match="requested='fp8'"):
        hw.autocast_dtype_for((9, 0), "fp8")


class FakeCudaCapability(FakeCuda):
    def __init__(self, capability):
        super().__init__(["NVIDIA Fake"])
        self.capability = capability

    def current_device(self) -> int:
        return 0

    def get_device_capability(self, i: int) -> tuple[int, int]:
        return self.capability


def test_default_autocast_dtype_reads_the_device_capability():
    assert hw.default_autocast_dtype(cuda=FakeCudaCapability((7, 5))).dtype == "float16"
    assert hw.default_autocast_dtype("cuda:0", cuda=FakeCudaCapability((9, 0))).dtype == "bfloat16"
    assert hw.default_autocast_dtype("cpu", cuda=FakeCudaCapability((9, 0))).dtype == "float32"
    assert hw.default_autocast_dtype(cuda=FakeCuda([])).dtype == "float32"
    with pytest.raises(ValueError, match=r"torch\.cuda\.is_available"):
        hw.default_autocast_dtype("cuda", cuda=FakeCuda([]))


# ---------------------------------------------------------------------------------------------
# Which SDPA kernel runs, and whether it stores the s×s matrix


def _sdpa_saved_bytes(seq_len: int, backends=None) -> int:
    """Bytes autograd saves for one SDPA call (1 batch, 2 heads, head size 8, causal)."""
    from torch.nn.attention import sdpa_kernel

    saved = []
    q, k, v = (torch.randn(1, 2, seq_len, 8, requires_grad=True) for _ in range(3))

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    limit = sdpa_kernel(backends) if backends else contextlib.nullcontext()
    with limit, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    return sum(saved)


def test_sdpa_on_cpu_runs_a_fused_kernel_and_the_flash_prediction_holds():
    check = hw.sdpa_backend(seq_len=64, head_dim=8, n_head=2)
    assert (check.backend, check.op) == ("flash", "_scaled_dot_product_flash_attention_for_cpu")
    assert check.formula_attention == "flash" and not check.materializes_scores
    assert check.warning is None
    assert "flash" in str(check) and "measured" in str(check)
    # What "fused" means for memory: what autograd keeps grows linearly with s.
    assert _sdpa_saved_bytes(128) == 2 * _sdpa_saved_bytes(64)


def test_sdpa_math_fallback_is_detected_and_warned():
    from torch.nn.attention import SDPBackend

    with warnings.catch_warnings():  # torch may say (once) why the fused kernels were skipped
        warnings.simplefilter("ignore", UserWarning)
        dropout = hw.sdpa_backend(seq_len=64, head_dim=8, dropout_p=0.1)
    pinned = hw.sdpa_backend(seq_len=64, head_dim=8, backends=[SDPBackend.MATH])
    for check in (dropout, pinned):
        assert (check.backend, check.op, check.formula_attention) == ("math", None,
                                                                      "materialized")
        assert "s×s" in check.warning and "attention='materialized'" in check.warning
        assert "sdpa_kernel" in check.warning and "https://docs.pytorch.org" in check.warning
    assert pinned.pinned == ("MATH",) and "limited to MATH" in str(pinned)
    # What "math" means for memory: the saved s×s matrix makes it grow faster than linearly.
    assert _sdpa_saved_bytes(128, [SDPBackend.MATH]) > 3 * _sdpa_saved_bytes(64, [SDPBackend.MATH])


def test_pinning_the_fused_kernels_raises_instead_of_falling_back():
    from torch.nn.attention import SDPBackend

    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
             SDPBackend.CUDNN_ATTENTION]
    assert hw.sdpa_backend(seq_len=32, head_dim=8, backends=fused).backend == "flash"
    with warnings.catch_warnings(), pytest.raises(RuntimeError, match="No available kernel"):
        warnings.simplefilter("ignore", UserWarning)
        hw.sdpa_backend(seq_len=32, head_dim=8, dropout_p=0.1, backends=fused)


def test_sdpa_backend_rejects_bad_arguments_and_leaves_global_rng_alone():
    for kwargs, what in (({"seq_len": 0, "head_dim": 8}, "seq_len"),
                         ({"seq_len": 8, "head_dim": 8, "dropout_p": 1.0}, "dropout_p"),
                         ({"seq_len": 8, "head_dim": 8, "dtype": torch.int32}, "dtype"),
                         ({"seq_len": 8, "head_dim": 8, "backends": ["math"]}, "backends")):
        with pytest.raises(ValueError, match=what):
            hw.sdpa_backend(**kwargs)
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    hw.sdpa_backend(seq_len=16, head_dim=8, dtype="bfloat16")
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_sdpa_on_the_gpu_runs_a_fused_kernel_in_the_default_dtype():
    choice = hw.default_autocast_dtype("cuda")
    check = hw.sdpa_backend(seq_len=512, head_dim=64, n_head=8, device="cuda",
                            dtype=choice.dtype)
    assert check.backend != "math", check


class FakeT4(FakeCuda):
    def get_device_properties(self, i: int) -> SimpleNamespace:
        return SimpleNamespace(**{**vars(super().get_device_properties(i)), "major": 7, "minor": 5})


def test_a_tier_before_compute_capability_8_says_bf16_and_tf32_are_not_on_tensor_cores():
    t4 = hw.describe_tier(cuda=FakeT4(["Tesla T4"]))
    assert t4.tier == "single-gpu"
    assert not any("tf32, bf16" in s for s in t4.can_show)
    assert any("fp32 and fp16 (bf16 only emulated)" in s for s in t4.can_show)
    assert any("compute capability 7.5 has none" in s and "loss scaler" in s for s in t4.cannot_show)
    h200 = hw.describe_tier(cuda=FakeCuda(["NVIDIA H200"]))  # 9.0: the table's own line
    assert any("fp32, tf32, bf16, fp16" in s for s in h200.can_show)
    assert not any("compute capability" in s for s in h200.cannot_show)
