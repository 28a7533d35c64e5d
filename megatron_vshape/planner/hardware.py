"""GPU specifications the cost model needs (dense bf16 peak, HBM, NVLink, inter-node bandwidth).

Bandwidths are per GPU and per direction, as vendors quote them; the cost model applies an
achievable fraction (``CostModel.bandwidth_efficiency``) on top, so these stay datasheet numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1024**3


@dataclass(frozen=True)
class GPU:
    name: str
    peak_flops: float  # dense bf16 FLOP/s
    memory_bytes: float  # HBM capacity
    hbm_bandwidth: float  # bytes/s (optimizer step is memory-bound)
    nvlink_bandwidth: float  # bytes/s per direction, within a node
    internode_bandwidth: float  # bytes/s per direction per GPU (one NIC per GPU)
    gpus_per_node: int = 8
    fp8_flops: float = 0.0  # dense FP8 FLOP/s (0: no FP8 tensor cores)


# Dense (not 2:4 sparse) peaks from NVIDIA's datasheets: "NVIDIA A100 Tensor Core GPU" (SXM 80 GB),
# "NVIDIA H100 Tensor Core GPU" (SXM5), "NVIDIA H200 Tensor Core GPU" (SXM), and "NVIDIA DGX B200"
# / HGX B200 (per GPU: 1/8 of the system's 72 PFLOP/s FP8 and 36 PFLOP/s FP16 sparse figures, halved
# for dense; 1,440 GB and 64 TB/s HBM3e over 8 GPUs). NVLink figures are bidirectional on the
# datasheets, halved here; one 400 Gb/s (HDR on A100: 200 Gb/s) NIC per GPU.
GPUS: dict[str, GPU] = {
    # A100 SXM 80 GB: 312 TFLOP/s bf16, no FP8, 2.0 TB/s HBM2e, NVLink3 600 GB/s bidirectional, HDR 200 Gb/s NIC.
    "a100": GPU("A100 80GB", 312e12, 80 * GIB, 2.0e12, 300e9, 25e9),
    # H100 SXM 80 GB: 989 TFLOP/s dense bf16, 1979 FP8, 3.35 TB/s, NVLink4 900 GB/s bidirectional, NDR 400 Gb/s.
    "h100": GPU("H100 80GB", 989e12, 80 * GIB, 3.35e12, 450e9, 50e9, fp8_flops=1979e12),
    # H200 141 GB: H100's compute (989 bf16, 1979 FP8) with 4.8 TB/s HBM3e.
    "h200": GPU("H200 141GB", 989e12, 141 * GIB, 4.8e12, 450e9, 50e9, fp8_flops=1979e12),
    # B200 (HGX/DGX B200) 180 GB: 2.25 PFLOP/s dense bf16, 4.5 FP8, 8 TB/s HBM3e, NVLink5 1.8 TB/s
    # bidirectional, ConnectX-7 400 Gb/s.
    "b200": GPU("B200 180GB", 2.25e15, 180 * GIB, 8.0e12, 900e9, 50e9, fp8_flops=4.5e15),
}


def get_gpu(name: str) -> GPU:
    gpu = GPUS.get(name.lower())
    if gpu is None:
        raise ValueError(f"--gpu: unknown GPU {name!r}; choose one of: {', '.join(GPUS)}")
    return gpu
