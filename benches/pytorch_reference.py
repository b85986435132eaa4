"""PyTorch's numbers for the work benches/cuda.rs and the allocator examples measure, on the same GPU.

    python3 benches/pytorch_reference.py                  # the MLP step and matmul
    python3 benches/pytorch_reference.py variable_shape   # examples/variable_shape.rs
    python3 benches/pytorch_reference.py churn            # examples/churn.rs
    python3 benches/pytorch_reference.py gpt              # examples/gpt.rs's training step
    python3 benches/pytorch_reference.py graph            # benches/cuda.rs's graph_step (CUDA graphs)
    python3 benches/pytorch_reference.py mixed            # benches/cuda.rs's wide_mlp_step and matmuls
                                                          # in f32, TF32, bf16 and f16 autocast
    python3 benches/pytorch_reference.py attention        # benches/cuda.rs's attention (sdpa, eager)
    python3 benches/pytorch_reference.py gpt2             # benches/cuda.rs's gpt2 (transformers)

Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to measure PyTorch's other allocator design.

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


def batch_size(k):
    """splitmix64(k) mod 512, plus one: the sequence examples/variable_shape.rs uses."""
    m = (1 << 64) - 1
    z = ((k + 1) * 0x9E3779B97F4A7C15) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    z ^= z >> 31
    return z % 512 + 1


def variable_shape(steps=2000):
    """An MLP 784-1024-1024-10 (AdamW) with a new batch size in 1..=512 every step."""
    torch.manual_seed(1)
    model = torch.nn.Sequential(
        torch.nn.Linear(784, 1024), torch.nn.ReLU(),
        torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
        torch.nn.Linear(1024, 10),
    ).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-2)
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for k in range(steps):
        n = batch_size(k)
        x = torch.randn(n, 784, device=dev)
        y = ((torch.arange(n, device=dev) * 7 + k) % 10).long()
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        last = loss.item()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    allocated = torch.cuda.max_memory_allocated()
    reserved = torch.cuda.max_memory_reserved()
    print(
        f"pytorch variable_shape on {torch.cuda.get_device_name(0)}: {steps} steps in {elapsed:.1f} s, "
        f"last loss {last:.3f}; peak allocated {allocated / 1e6:.1f} MB, peak reserved "
        f"{reserved / 1e6:.1f} MB: reserved/allocated {reserved / allocated:.2f}x"
    )


def churn(total=1 << 40):
    """Tensors of ever new sizes (1 GiB x 1.07^n), each dropped at once, then the largest served."""
    capacity = torch.cuda.get_device_properties(0).total_memory
    start, size, churned = 1 << 30, 1 << 30, 0
    while churned < total:
        try:
            t = torch.empty(size // 4, device=dev)
            del t
            churned += size
            size += size // 14
        except torch.OutOfMemoryError:
            size = start
    lo, hi = 0, capacity // (2 << 20)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        try:
            t = torch.empty(mid * (2 << 20) // 4, device=dev)
            del t
            lo = mid
        except torch.OutOfMemoryError:
            hi = mid - 1
    largest = lo * (2 << 20)
    print(
        f"pytorch churn: {churned / 2**30:.0f} GiB churned; largest request served afterwards "
        f"{largest / 2**30:.2f} GiB = {100 * largest / capacity:.1f}% of {capacity / 2**30:.2f} GiB"
    )


def gpt(steps=1000, width=128, heads=4, layers=2, vocab=12, context=8, batch=64):
    """examples/gpt.rs's model and step in PyTorch eager: token and learned position embeddings,
    pre-norm blocks (causal attention, exact GELU MLP of 4x width), final layer norm, head;
    cross-entropy on the three answer positions, AdamW, the loss read every step."""
    F = torch.nn.functional
    torch.manual_seed(1)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1 = torch.nn.LayerNorm(width)
            self.qkv = torch.nn.Linear(width, 3 * width)
            self.proj = torch.nn.Linear(width, width)
            self.ln2 = torch.nn.LayerNorm(width)
            self.fc1 = torch.nn.Linear(width, 4 * width)
            self.fc2 = torch.nn.Linear(4 * width, width)

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, heads, c // heads).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, t, c))
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    class Gpt(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.tokens = torch.nn.Embedding(vocab, width)
            self.positions = torch.nn.Parameter(torch.randn(context, width) * 0.02)
            self.blocks = torch.nn.ModuleList([Block() for _ in range(layers)])
            self.ln = torch.nn.LayerNorm(width)
            self.head = torch.nn.Linear(width, vocab)

        def forward(self, ids):
            x = self.tokens(ids) + self.positions[: ids.shape[1]]
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln(x))

    model = Gpt().to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=1e-2)
    ids = torch.randint(0, vocab, (batch, context), device=dev)
    targets = torch.randint(0, 10, (batch * 3,), device=dev)

    def step():
        opt.zero_grad(set_to_none=True)
        logits = model(ids)[:, 5:8].reshape(batch * 3, vocab)
        loss = F.cross_entropy(logits, targets)
        loss.backward()
        opt.step()
        return loss.item()

    for _ in range(20):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    params = sum(p.numel() for p in model.parameters())
    print(
        f"pytorch gpt step ({layers} blocks, width {width}, {heads} heads, context {context}, "
        f"batch {batch}, {params} parameters, AdamW) on {torch.cuda.get_device_name(0)}: "
        f"{steps / elapsed:.0f} steps/s over {steps} steps"
    )


def graph_step(steps=2000):
    """The MLP step with new host inputs every step, eager and captured whole in a CUDA graph
    (torch.cuda.graph, static inputs, loss read every step), with SGD momentum 0.9 (what ndscope's
    StepGraph captures) and with AdamW(capturable=True)."""
    f = torch.nn.functional
    batches = [
        (torch.randn(128, 784), (torch.arange(128) * 7 + i) % 10) for i in range(4)
    ]
    for name in ("sgd", "adamw"):
        for graphed in (False, True):
            torch.manual_seed(1)
            model = torch.nn.Sequential(
                torch.nn.Linear(784, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)
            ).to(dev)
            if name == "sgd":
                opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            else:
                opt = torch.optim.AdamW(
                    model.parameters(), lr=1e-3, weight_decay=1e-2, capturable=graphed
                )
            static_x = torch.zeros(128, 784, device=dev)
            static_y = torch.zeros(128, dtype=torch.long, device=dev)

            def eager():
                opt.zero_grad(set_to_none=True)
                loss = f.cross_entropy(model(static_x), static_y)
                loss.backward()
                opt.step()
                return loss

            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    eager()
            torch.cuda.current_stream().wait_stream(side)
            if graphed:
                graph = torch.cuda.CUDAGraph()
                opt.zero_grad(set_to_none=True)
                with torch.cuda.graph(graph):
                    static_loss = f.cross_entropy(model(static_x), static_y)
                    static_loss.backward()
                    opt.step()

            def step(i):
                x, y = batches[i % len(batches)]
                static_x.copy_(x)
                static_y.copy_(y)
                if graphed:
                    graph.replay()
                    return static_loss.item()
                return eager().item()

            for i in range(20):
                step(i)
            torch.cuda.synchronize()
            start = time.perf_counter()
            for i in range(steps):
                step(i)
            torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            print(
                f"pytorch graph_step 784-256-10 b128 {name} {'CUDA graph' if graphed else 'eager'} "
                f"on {torch.cuda.get_device_name(0)}: {steps / elapsed:.0f} steps/s over {steps} "
                f"steps (host inputs copied in, loss read every step)"
            )


def wide_mlp_step(steps=200):
    """The 4096-4096-4096-10 MLP at batch 1024 with AdamW, in f32, TF32, bf16 autocast and f16
    autocast with a GradScaler; the loss read every step, as benches/cuda.rs's wide_mlp_step."""
    for name in ("f32", "tf32", "bf16 autocast", "f16 autocast + loss scaling"):
        torch.backends.cuda.matmul.allow_tf32 = name == "tf32"
        torch.manual_seed(1)
        model = torch.nn.Sequential(
            torch.nn.Linear(4096, 4096),
            torch.nn.ReLU(),
            torch.nn.Linear(4096, 4096),
            torch.nn.ReLU(),
            torch.nn.Linear(4096, 10),
        ).to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=1e-2)
        dtype = {"bf16 autocast": torch.bfloat16, "f16 autocast + loss scaling": torch.float16}.get(name)
        x = torch.randn(1024, 4096, device=dev)
        if dtype is not None:
            x = x.to(dtype)  # as benches/cuda.rs feeds it
        y = (torch.arange(1024, device=dev) % 10).long()
        scaler = torch.amp.GradScaler("cuda") if dtype == torch.float16 else None

        def step():
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=dtype or torch.float32, enabled=dtype is not None):
                loss = torch.nn.functional.cross_entropy(model(x), y)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                opt.step()
            return loss.item()

        for _ in range(10):
            step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        for _ in range(steps):
            last = step()
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        flops = 6.0 * 1024 * (4096 * 4096 * 2 + 4096 * 10)
        print(
            f"pytorch wide_mlp_step 4096-4096-4096-10 b1024 AdamW {name} on "
            f"{torch.cuda.get_device_name(0)}: {steps / elapsed:.0f} steps/s over {steps} steps "
            f"({flops * steps / elapsed / 1e12:.0f} TFLOP/s in products); peak allocated "
            f"{torch.cuda.max_memory_allocated()} B; last loss {last:.4f}"
        )
    torch.backends.cuda.matmul.allow_tf32 = False


def mixed_matmul():
    """Square products in f32, TF32, bf16 and f16, as benches/cuda.rs's cuda_matmul group."""
    for name, dtype, tf32 in (
        ("f32", torch.float32, False),
        ("tf32", torch.float32, True),
        ("bf16", torch.bfloat16, False),
        ("f16", torch.float16, False),
    ):
        torch.backends.cuda.matmul.allow_tf32 = tf32
        for n in (1024, 4096):
            a = torch.randn(n, n, device=dev, dtype=dtype)
            b = torch.randn(n, n, device=dev, dtype=dtype)
            for _ in range(10):
                a @ b
            torch.cuda.synchronize()
            reps = 200 if n == 1024 else 50
            start = time.perf_counter()
            for _ in range(reps):
                a @ b
                torch.cuda.synchronize()
            elapsed = (time.perf_counter() - start) / reps
            print(f"pytorch matmul {name} {n}: {2 * n ** 3 / elapsed / 1e12:.1f} TFLOP/s")
    torch.backends.cuda.matmul.allow_tf32 = False


def median_ms(fn, runs=50):
    """The median of `runs` timed calls of `fn` (each ending in a synchronize), after three warm-ups."""
    import statistics

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def attention():
    """benches/cuda.rs's attention: causal [1, 12, 1024, 64] and [1, 32, 1024, 128] over 8 key and
    value heads, F.scaled_dot_product_attention (the flash/efficient kernels; enable_gqa for the
    grouped heads) and the eager composition (keys and values repeated per group), forward and
    forward+backward of the sum."""
    import torch.nn.functional as F

    mask = torch.ones(1024, 1024, dtype=torch.bool, device=dev).triu(1)

    for heads, kv_heads, width in ((12, 12, 64), (32, 8, 128)):
        group = heads // kv_heads

        def eager(q, k, v):
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
            return s.masked_fill(mask, float("-inf")).softmax(-1) @ v

        def sdpa(q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=group > 1)

        for dtype in (torch.float32, torch.bfloat16):
            q = torch.randn((1, heads, 1024, width), dtype=dtype, device=dev)
            k, v = (torch.randn((1, kv_heads, 1024, width), dtype=dtype, device=dev) for _ in range(2))
            for name, f in (("sdpa", sdpa), ("eager", eager)):
                with torch.no_grad():
                    forward = median_ms(lambda: f(q, k, v))
                leaves = [x.detach().requires_grad_() for x in (q, k, v)]
                both = median_ms(lambda: f(*leaves).sum().backward())
                print(
                    f"pytorch {torch.__version__} attention [1, {heads}/{kv_heads}, 1024, {width}] {dtype} "
                    f"{name} on {torch.cuda.get_device_name(0)}: forward {forward:.3f} ms, "
                    f"forward+backward {both:.3f} ms"
                )


def gpt2():
    """benches/cuda.rs's gpt2: GPT-2 small (GPT2Config(), random weights) at 1,024 tokens, eager,
    the forward pass to the last position's logits and forward+backward of the loss, f32 and bf16
    autocast."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(7)
    model = GPT2LMHeadModel(GPT2Config()).to(dev)
    model.eval()  # dropout off, as ndscope's bench
    ids = (torch.arange(1024, device=dev) * 7919 % 50257).unsqueeze(0)
    for name, dtype in (("f32", None), ("bf16_autocast", torch.bfloat16)):
        def forward():
            with torch.no_grad(), torch.autocast("cuda", dtype=dtype, enabled=dtype is not None):
                return model(ids).logits[0, -1].float().sum().item()

        def forward_backward():
            model.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=dtype, enabled=dtype is not None):
                out = model(ids, labels=ids)
            out.loss.backward()
            return out.loss.item()

        print(
            f"pytorch {torch.__version__} gpt2_small {name} 1024 tokens on {torch.cuda.get_device_name(0)} "
            f"(attention {model.config._attn_implementation}): forward {median_ms(forward, 20):.2f} ms, "
            f"forward+backward {median_ms(forward_backward, 20):.2f} ms"
        )


if __name__ == "__main__":
    import sys

    what = sys.argv[1] if len(sys.argv) > 1 else "step"
    if what == "variable_shape":
        variable_shape()
    elif what == "churn":
        churn()
    elif what == "gpt":
        gpt()
    elif what == "graph":
        graph_step()
    elif what == "mixed":
        wide_mlp_step()
        mixed_matmul()
    elif what == "attention":
        attention()
    elif what == "gpt2":
        gpt2()
    else:
        mlp_step()
        matmul()
