"""transformers' and PyTorch's side of benches/gpt2.rs and examples/gpt2_load.rs, on the CPU, on the
same GPT-2 small directory (random weights, written by either of those):

    python3 benches/gpt2_reference.py load [DIR]    # from_pretrained: time and process peak memory
    python3 benches/gpt2_reference.py step [DIR]    # forward (f32, bf16 autocast), forward+backward

DIR defaults to target/gpt2-small-random. Two threads (torch.set_num_threads(2)), batch 1, medians of
5 after a warm-up run. `load` measures one load per process (the file in the page cache), as
examples/gpt2_load.rs does: run it a few times.
"""
import resource
import statistics
import sys
import time

import torch
from transformers import GPT2LMHeadModel

torch.set_num_threads(2)


def peak_rss_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def current_rss_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) * 1024
    return 0


def load(path):
    before = current_rss_bytes()
    start = time.perf_counter()
    model = GPT2LMHeadModel.from_pretrained(path)
    elapsed = time.perf_counter() - start
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    peak = peak_rss_bytes()
    # from_pretrained leaves the weights memory-mapped: nothing is read until they are used. Reading
    # each once (a sum) is the work ndscope's load does (a copy).
    start = time.perf_counter()
    with torch.no_grad():
        for p in model.parameters():
            p.sum()
    touched = time.perf_counter() - start
    touched_peak = peak_rss_bytes()
    print(
        f"transformers {__import__('transformers').__version__} from_pretrained {path}: "
        f"{elapsed:.3f} s; {weights} B of weights; process resident {before} B before, "
        f"peak {peak} B; the load added {peak - before} B = {(peak - before) / weights:.3f}x the weights; "
        f"reading every weight once then took {touched:.3f} s more, and the peak rose to {touched_peak - before} B "
        f"= {(touched_peak - before) / weights:.3f}x the weights"
    )


def step(path):
    model = GPT2LMHeadModel.from_pretrained(path)
    model.eval()  # dropout off, as ndscope's forward
    for length in (128, 1024):
        ids = (torch.arange(length) * 7919 % 50257).unsqueeze(0)

        def forward():
            with torch.no_grad():
                return model(ids).logits[0, -1].sum().item()

        def forward_bf16_autocast():
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                return model(ids).logits[0, -1].float().sum().item()

        def forward_backward():
            model.zero_grad(set_to_none=True)
            out = model(ids, labels=ids)
            out.loss.backward()
            return out.loss.item()

        runs = (
            ("forward", forward),
            ("forward_bf16_autocast", forward_bf16_autocast),
            ("forward_backward", forward_backward),
        )
        for name, fn in runs:
            fn()
            times = []
            for _ in range(5):
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            print(
                f"pytorch {torch.__version__} gpt2_small {name}/{length}: median {statistics.median(times):.3f} s "
                f"(min {min(times):.3f}, 2 threads, attention {model.config._attn_implementation})"
            )


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "step"
    path = sys.argv[2] if len(sys.argv) > 2 else "target/gpt2-small-random"
    {"load": load, "step": step}[what](path)
