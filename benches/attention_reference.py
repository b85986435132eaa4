"""PyTorch's side of benches/attention.rs, on the CPU, with the same shapes:

    python3 benches/attention_reference.py

Two threads (torch.set_num_threads(2)), medians of 10 after two warm-up runs. Attention is
F.scaled_dot_product_attention(is_causal=True) (sdpa) and the eager composition (matmul, masked_fill,
softmax, matmul); cross-entropy is F.cross_entropy with its backward.
"""
import statistics
import time

import torch
import torch.nn.functional as F

torch.set_num_threads(2)
torch.manual_seed(0)


def median_ms(f, runs=10):
    for _ in range(2):
        f()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def eager(q, k, v):
    t = q.shape[-2]
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    mask = torch.ones(t, t, dtype=torch.bool).triu(1)
    return s.masked_fill(mask, float("-inf")).softmax(-1) @ v


def forward_backward(f, *xs):
    xs = [x.detach().requires_grad_() for x in xs]
    f(*xs).sum().backward()


def main():
    shape = (1, 12, 1024, 64)
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = (torch.randn(shape, dtype=dtype) for _ in range(3))
        sdpa = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
        with torch.no_grad():
            print(f"attention {dtype} sdpa forward: {median_ms(lambda: sdpa(q, k, v)):.1f} ms")
            print(f"attention {dtype} eager forward: {median_ms(lambda: eager(q, k, v)):.1f} ms")
        print(f"attention {dtype} sdpa forward+backward: "
              f"{median_ms(lambda: forward_backward(sdpa, q, k, v)):.1f} ms")
        print(f"attention {dtype} eager forward+backward: "
              f"{median_ms(lambda: forward_backward(eager, q, k, v)):.1f} ms")
    q1 = torch.randn(1, 12, 1, 64)
    k, v = torch.randn(shape), torch.randn(shape)
    with torch.no_grad():
        print(f"decode 1 query 1024 keys sdpa: "
              f"{median_ms(lambda: F.scaled_dot_product_attention(q1, k, v), 50) * 1e3:.1f} us")
        scores = torch.randn(12, 1024, 1024)
        print(f"softmax 12x1024x1024: {median_ms(lambda: scores.softmax(-1)):.1f} ms")
        logits = torch.randn(1023, 50257)
        print(f"log_softmax 1023x50257: {median_ms(lambda: logits.log_softmax(-1)):.1f} ms")
    labels = torch.arange(1023) * 7919 % 50257

    def xent():
        x = logits.detach().requires_grad_()
        F.cross_entropy(x, labels).backward()

    print(f"cross_entropy forward+backward 1023x50257: {median_ms(xent):.1f} ms")


if __name__ == "__main__":
    main()
