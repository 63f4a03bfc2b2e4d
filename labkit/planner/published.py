"""Published configurations to hold the planner against (:func:`published_cases`: Llama 3 405B,
Megatron-LM's runs), and this machine as a cluster of its measured figures
(:func:`this_machine`).

The planner's checks, apart from the planner: the cases are data with sources.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from labkit.planner.search import Plan
from labkit.planner.specs import (
    Cluster,
    Device,
    Link,
    ModelSpec,
    Search,
    Workload,
)

# ----------------------------------------------------------------------------------------------
# Published configurations to hold the planner against.


@dataclass(frozen=True)
class Published:
    """A configuration a paper reports, with the case to plan it in."""

    name: str
    citation: str
    model: ModelSpec
    cluster: Cluster
    workload: Workload
    search: Search
    shape: dict[str, int]
    reported: str
    """What the paper measured on it (published, not modelled here)."""

    @property
    def shape_name(self) -> str:
        """The published layout as the planner names it (``DP64×TP8×PP16``)."""
        return "×".join(f"{k.upper()}{v}" for k, v in self.shape.items() if v > 1)

    def report(self, plan: Plan, top: int = 3) -> str:
        """What ``plan`` (this case planned) says, for a notebook: the case, the ``top`` layouts
        (compact), and where the published layout ranks with its executed TFLOP/s and MFU
        (modelled) beside what the paper measured. The full citation is ``self.citation``."""
        c, w = self.cluster, self.workload
        lines = [f"{self.name}: {self.model.params / 1e9:.1f}B parameters, {c.gpus_per_node} GPUs "
                 f"per node ({c.intra_node.name} inside, {c.inter_node.name} between), global "
                 f"batch {w.global_batch:,} × {self.model.seq_len:,} tokens; "
                 f"{len(plan.predictions)} valid layouts and variants, "
                 f"{len(plan.ranked(fitting_only=True))} fit (modelled):"]  # fmt: skip
        lines += ["  " + line for line in plan.table(top, compact=True).splitlines()]
        rank = plan.rank_of(**self.shape)
        source = self.citation.split(', "')[0]
        lines.append(f"  published {self.shape_name} ({source}): {self.reported}")
        if rank is None:
            lines.append("  the planner finds no variant of the published layout that fits")
        else:
            pub = plan.best_per_shape()[rank - 1]
            lines.append(f"  planner: rank {rank} of {len(plan.best_per_shape())}, "
                         f"{pub.flops_per_gpu_s(c.n_gpus) / 1e12:.0f} TFLOP/s executed per GPU, "
                         f"MFU {pub.predicted_mfu:.0%} (modelled at the assumed {w.mfu:.0%})")  # fmt: skip
        return "\n".join(lines)


def published_cases(mfu: float = 0.5) -> list[Published]:
    """Llama 3 405B (Table 4, first row) and Megatron-LM's 145.6B and 1T GPTs (Table 1)."""
    llama = ModelSpec(n_layer=126, d_model=16384, n_head=128, n_kv_head=8, ffn_hidden=53248,
                      glu=True, vocab_size=128_000, seq_len=8192, name="Llama 3 405B")  # fmt: skip
    megatron_145 = ModelSpec(n_layer=80, d_model=12288, n_head=96, vocab_size=51_200,
                             seq_len=2048, bias=True, tied_embeddings=True,
                             learned_positions=True, name="GPT 145.6B")  # fmt: skip
    megatron_1t = ModelSpec(n_layer=128, d_model=25600, n_head=160, vocab_size=51_200,
                            seq_len=2048, bias=True, tied_embeddings=True,
                            learned_positions=True, name="GPT 1T")  # fmt: skip
    h100 = dict(gpus_per_node=8, intra_node="NVLink 4", inter_node="InfiniBand NDR 400 Gb/s")
    a100 = dict(gpus_per_node=8, intra_node="NVLink 3", inter_node="InfiniBand HDR 200 Gb/s")
    llama_cite = ("Llama Team, AI @ Meta 2024, \"The Llama 3 Herd of Models\", arXiv 2407.21783 "
                  "(v3), section 3.3.2, Table 4, first row")  # fmt: skip
    meg_cite = ("Narayanan et al. 2021, \"Efficient Large-Scale Language Model Training on GPU "
                "Clusters Using Megatron-LM\", arXiv 2104.04473, Table 1")  # fmt: skip
    # Megatron 2021 ran full activation recomputation (its FLOP count, eq. 3, includes the
    # recomputed forward) and predates sequence parallelism and its distributed optimizer.
    meg_search = Search(recompute=("full",), sequence_parallel=False, zero_stages=(0,),
                        interleave=(1, 2, 4))  # fmt: skip
    return [
        Published(
            "Llama 3 405B, 8,192 H100",
            llama_cite,
            llama,
            # 405B ran on RoCE, not InfiniBand (section 3.3.1): the same 400 Gb/s per GPU
            Cluster.from_tables("NVIDIA H100 80GB HBM3", n_gpus=8192,
                                **{**h100, "inter_node": "RoCE 400 Gb/s"}),
            Workload.from_tokens(2048 * 8192, 8192, mfu=mfu),
            Search(uneven_stages=True, zero_stages=(1, 2, 3)),
            {"dp": 64, "tp": 8, "pp": 16, "cp": 1},
            "430 TFLOP/s per GPU, BF16 MFU 43% (measured by Meta); 16M tokens per batch",
        ),
        Published(
            "GPT 145.6B, 1,536 A100",
            meg_cite,
            megatron_145,
            Cluster.from_tables("NVIDIA A100-SXM4-80GB", n_gpus=1536, **a100),
            Workload(global_batch=2304, mfu=mfu),
            meg_search,
            {"dp": 24, "tp": 8, "pp": 8, "cp": 1},
            "148 TFLOP/s per GPU, 47% of peak (measured by NVIDIA); batch 2304",
        ),
        Published(
            "GPT 1T, 3,072 A100",
            meg_cite,
            megatron_1t,
            Cluster.from_tables("NVIDIA A100-SXM4-80GB", n_gpus=3072, **a100),
            Workload(global_batch=3072, mfu=mfu),
            meg_search,
            {"dp": 6, "tp": 8, "pp": 64, "cp": 1},
            "163 TFLOP/s per GPU, 52% of peak (measured by NVIDIA); batch 3072",
        ),
    ]


def this_machine(model_cfg: Any, *, global_batch: int, matmul_flops_per_s: float,
                 link_bytes_per_s: float, link_latency_s: float = 0.0, nproc: int = 4,
                 mfu: float = 0.5, link_name: str = "gloo over loopback",
                 device_name: str = "this CPU (one rank)",
                 ) -> tuple[ModelSpec, Cluster, Workload, Search]:  # fmt: skip
    """The case of this machine's 2 × 2 runs: ``nproc`` CPU ranks over gloo on one host, fp32
    (4-byte parameters, gradients and activations, AdamW's m and v: K = 8), a measured matmul
    ceiling for the compute and a measured loopback link for every collective. Memory is not
    checked (host memory is shared by the ranks)."""
    model = ModelSpec.from_model_config(model_cfg)
    link = Link(name=link_name, bytes_per_s=link_bytes_per_s,
                latency_s=link_latency_s, source="measured: link probe of labkit.workers.allreduce")  # fmt: skip
    device = Device(name=device_name, peak_flops_per_s=matmul_flops_per_s,
                    memory_bytes=None, source="measured: torch.matmul ceiling on this machine")  # fmt: skip
    cluster = Cluster(device=device, n_gpus=nproc, gpus_per_node=nproc, intra_node=link,
                      inter_node=link)  # fmt: skip
    workload = Workload(global_batch=global_batch, mfu=mfu, param_bytes=4, grad_bytes=4,
                        optimizer_bytes=8, activation_bytes=4, attention="flash")  # fmt: skip
    search = Search(
        zero_stages=(0,),
        interleave=(1,),
        max_cp=nproc,
        sequence_parallel=False,
        vocab_parallel=False,
    )
    return model, cluster, workload, search
