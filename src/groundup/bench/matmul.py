"""The machine's measured float32 matmul peak: the yardstick the training throughput is compared with."""

from __future__ import annotations

import torch

from groundup.bench import Row, median_time


def matmul_peak_gflops(n: int = 1024, repeat: int = 7, device: str | torch.device = "cpu") -> float:
    """Median GFLOP/s of an ``n x n`` float32 matrix product (2 n^3 floating-point operations) on ``device`` (each
    product waited for, on a GPU)."""
    device = torch.device(device)
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def product():
        a @ b
        sync()

    seconds = median_time(product, repeat=repeat, warmup=2)
    return 2 * n**3 / seconds / 1e9


def run() -> list[Row]:
    peak = matmul_peak_gflops()
    return [Row("float32 matmul 1024x1024", peak, "GFLOP/s", f"{torch.get_num_threads()} threads")]
