"""PyTorch's side of examples/big_model_memory.rs: a GPT-2-small-shaped training step on the CPU
(transformers' GPT2LMHeadModel with random weights, batch 1, 1,024 tokens, forward + backward +
AdamW, dropout off), with or without activation checkpointing (`torch.utils.checkpoint` with
`use_reentrant=False`, through `gradient_checkpointing_enable`):

    MALLOC_MMAP_THRESHOLD_=131072 python3 benches/checkpoint_reference.py plain
    MALLOC_MMAP_THRESHOLD_=131072 python3 benches/checkpoint_reference.py checkpoint

The fixed mmap threshold makes glibc map every large block and unmap it when freed, so the resident
set follows what PyTorch holds. After a warm-up step (AdamW's state is made lazily) the peak resident
set is reset (`5 > /proc/self/clear_refs`); the step's peak is then VmHWM minus the resident set
before it: every tensor the step made, the gradients included (`zero_grad` sets them to None), as
ndscope's batch-scope peak counts. The resident set after the forward pass is what the autograd
graph keeps. Two threads, median of 3 timed steps.
"""
import statistics
import sys
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel

torch.set_num_threads(2)


def status_bytes(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def main():
    mode = sys.argv[1] if len(sys.argv) > 1 else "plain"
    if mode not in ("plain", "checkpoint"):
        sys.exit("usage: checkpoint_reference.py plain|checkpoint")
    torch.manual_seed(7)
    # Dropout off, as in ndscope's Gpt2 (dropout would also keep PyTorch's sdpa off its fused path).
    config = GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa")
    model = GPT2LMHeadModel(config)
    model.config.use_cache = False
    if mode == "checkpoint":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    ids = (torch.arange(1024) * 7919 % 50257).unsqueeze(0)
    times, peaks, after_forward = [], [], []
    for k in range(4):
        opt.zero_grad(set_to_none=True)
        reset_peak()
        before = status_bytes("VmRSS")
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        kept = status_bytes("VmRSS") - before
        loss.backward()
        opt.step()
        elapsed = time.perf_counter() - start
        peak = status_bytes("VmHWM") - before
        print(f"step {k + 1}: loss {loss.item():.4f}, {elapsed:.2f} s, peak {peak >> 20} MiB above the "
              f"step's start, {kept >> 20} MiB after the forward pass")
        if k > 0:
            times.append(elapsed)
            peaks.append(peak)
            after_forward.append(kept)
    print(f"torch {torch.__version__}, {mode}: median step {statistics.median(times):.3f} s, step peak "
          f"{max(peaks) >> 20} MiB, {max(after_forward) >> 20} MiB after the forward pass")


if __name__ == "__main__":
    main()
