"""PyTorch's side of `cargo bench --bench ops -- --noplot linear_f32`: a `Linear`'s `x Wᵀ` (`W`
stored `[out, in]`) on GPT-2 small's and a Llama-1B-shaped model's shapes, in f32 on the CPU, two
threads, medians of 10 after 3 warm-up calls:

    python3 benches/linear_reference.py
"""
import time

import torch

torch.set_num_threads(2)

# (label, (tokens, in, out)): the same rows as benches/ops.rs's `linear_f32` group.
SHAPES = [
    ("gpt2_head_128", (128, 768, 50257)),
    ("gpt2_mlp_128", (128, 768, 3072)),
    ("gpt2_mlp_1024", (1024, 768, 3072)),
    ("llama1b_qo_512", (512, 2048, 2048)),
    ("llama1b_up_512", (512, 2048, 8192)),
    ("llama1b_down_512", (512, 8192, 2048)),
]

for label, (m, k, n) in SHAPES:
    x, w = torch.randn(m, k), torch.randn(n, k)
    for _ in range(3):
        torch.nn.functional.linear(x, w)
    times = []
    for _ in range(10):
        start = time.perf_counter()
        torch.nn.functional.linear(x, w)
        times.append(time.perf_counter() - start)
    times.sort()
    median = (times[4] + times[5]) / 2
    print(f"torch linear_f32/{label}: {median * 1e3:.2f} ms, {2 * m * k * n / median / 1e9:.0f} GFLOP/s")
