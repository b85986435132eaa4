"""PyTorch's numbers for the work benches/cuda.rs measures, on the same GPU.

    python3 benches/pytorch_reference.py

Prints the MLP step (784-256-10, batch 128, AdamW, loss read every step as ndscope's bench does) in
steps/s with the caching allocator's cudaMalloc calls per step and peak allocated/reserved bytes, and
the f32 matmul throughput at 1024 and 4096. TF32 stays off, as in ndscope's cuBLAS calls.
"""
import time

import torch

torch.backends.cuda.matmul.allow_tf32 = False
dev = torch.device("cuda:0")


def mlp_step():
    torch.manual_seed(1)
    model = torch.nn.Sequential(
        torch.nn.Linear(784, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)
    ).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-2)
    x = torch.randn(128, 784, device=dev)
    y = (torch.arange(128, device=dev) % 10).long()

    def step():
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    for _ in range(20):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    segments = torch.cuda.memory_stats()["segment.all.allocated"]
    steps = 1000
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    calls = torch.cuda.memory_stats()["segment.all.allocated"] - segments
    print(
        f"pytorch mlp_step 784-256-10 b128 AdamW on {torch.cuda.get_device_name(0)}: "
        f"{steps / elapsed:.0f} steps/s over {steps} steps; cudaMalloc calls per step "
        f"{calls / steps:.3f}; peak allocated {torch.cuda.max_memory_allocated()} B; "
        f"peak reserved {torch.cuda.max_memory_reserved()} B"
    )


def matmul():
    for n in (1024, 4096):
        a = torch.randn(n, n, device=dev)
        b = torch.randn(n, n, device=dev)
        for _ in range(10):
            a @ b
        torch.cuda.synchronize()
        reps = 50
        start = time.perf_counter()
        for _ in range(reps):
            a @ b
        torch.cuda.synchronize()
        elapsed = (time.perf_counter() - start) / reps
        print(f"pytorch matmul {n}: {elapsed * 1e6:.1f} us, {2 * n**3 / elapsed / 1e9:.0f} GFLOP/s")


if __name__ == "__main__":
    mlp_step()
    matmul()
