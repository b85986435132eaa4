"""ndscope against PyTorch on this machine, in one run: the table of issue 37.

GPT-2 small (random weights, `target/gpt2-small-random`, written by ndscope's side on first use)
forward and forward+backward at 128 and 1,024 tokens in f32 (PyTorch eager and `torch.compile`) and
bf16 autocast; fused causal attention [1, 12, 1024, 64] forward in f32 and bf16 (PyTorch's sdpa);
greedy decoding of 128 tokens after a 16-token prompt, one request and eight (ndscope's engine,
transformers' batched `generate`).

The two sides alternate run by run (ndscope's runs in `benches/versus_pytorch.rs`, driven over a
pipe; PyTorch's in this process), each row's first run of each side untimed; the table shows medians,
the CPU's model and flags, and whether both sides computed the same loss or logits. Run from the
repository root (needs torch and transformers):

    python3 benches/versus_pytorch.py            # 2 threads a side, medians of 5
    python3 benches/versus_pytorch.py --runs 3 --no-compile --rows forward/128 decode/1
"""

import argparse
import os
import statistics
import subprocess
import sys
import time

ROWS = [
    "forward/128",
    "forward_backward/128",
    "forward/1024",
    "forward_backward/1024",
    "forward_bf16/128",
    "forward_backward_bf16/128",
    "forward_bf16/1024",
    "forward_backward_bf16/1024",
    "attention/f32",
    "attention/bf16",
    "decode/1",
    "decode/8",
]

FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
         "amx_tile", "amx_bf16", "amx_int8")


def cpu():
    """The CPU's model name, family/model and the flags that pick kernels, from /proc/cpuinfo."""
    fields = {}
    with open("/proc/cpuinfo") as f:
        for line in f:
            if not line.strip():
                break
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
    flags = set(fields.get("flags", "").split())
    return (f"{fields.get('model name', '?')} (family {fields.get('cpu family', '?')} model "
            f"{fields.get('model', '?')}), flags: {' '.join(f for f in FLAGS if f in flags) or 'none of'} "
            f"[of {', '.join(FLAGS)}]")


class Ndscope:
    """ndscope's side: the bench binary, one row per line."""

    def __init__(self, threads):
        env = dict(os.environ, RAYON_NUM_THREADS=str(threads))
        subprocess.run(["cargo", "bench", "--bench", "versus_pytorch", "--no-run", "-q"],
                       check=True, env=env)
        self.process = subprocess.Popen(
            ["cargo", "bench", "-q", "--bench", "versus_pytorch"], env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def run(self, row):
        self.process.stdin.write(row + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            sys.exit(f"ndscope's side ended at row {row} (its error is above)")
        name, seconds, value = line.split()
        assert name == row, f"asked for {row}, got {name}"
        return float(seconds), float(value)

    def close(self):
        self.process.stdin.close()
        self.process.wait()


class Pytorch:
    """PyTorch's side: the same checkpoint through transformers, eager or compiled."""

    def __init__(self, threads, compile_too):
        import torch
        from transformers import GPT2LMHeadModel

        torch.set_num_threads(threads)
        self.torch = torch
        self.model = GPT2LMHeadModel.from_pretrained("target/gpt2-small-random").eval()
        self.compiled = torch.compile(self.model) if compile_too else None
        generator = torch.Generator().manual_seed(3)
        self.qkv = [torch.randn(1, 12, 1024, 64, generator=generator) for _ in range(3)]

    def run(self, row, compiled=False):
        """One run of `row`: (seconds, value) as ndscope's side reports them."""
        torch = self.torch
        name, arg = row.split("/")
        model = self.compiled if compiled else self.model
        start = time.perf_counter()
        if name.startswith("forward"):
            n = int(arg)
            ids = (torch.arange(n) * 7919 % 50257).unsqueeze(0)
            autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=name.endswith("_bf16"))
            if name.startswith("forward_backward"):
                model.zero_grad(set_to_none=True)
                with autocast:
                    out = model(ids, labels=ids)
                out.loss.backward()
                value = out.loss.item()
            else:
                with torch.no_grad(), autocast:
                    value = model(ids).logits[0, -1].float().sum().item()
        elif name == "attention":
            dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[arg]
            q, k, v = (t.to(dtype) for t in self.qkv)
            start = time.perf_counter()
            with torch.no_grad():
                out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            value = out.float().sum().item()
        elif name == "decode":
            batch = int(arg)
            prompt = [(i * 7919 + 13) % 50257 for i in range(16)]
            ids = torch.tensor([[r] + prompt[1:] for r in range(batch)])
            with torch.inference_mode():
                out = self.model.generate(ids, attention_mask=torch.ones_like(ids),
                                          max_new_tokens=128, min_new_tokens=128,
                                          do_sample=False, pad_token_id=0)
            value = float((out.shape[1] - 16) * batch)
        else:
            raise ValueError(row)
        return time.perf_counter() - start, value


def agree(row, a, b):
    """Whether both sides computed the same (the loss or logits; the tokens' count)."""
    if row.startswith("attention"):
        return "(inputs differ)"
    if row.startswith("decode"):
        return "tokens: both 128 a request" if a == b else f"no: {a:.0f} vs {b:.0f} tokens"
    tol = 5e-2 if "bf16" in row else 1e-3
    return "yes" if abs(a - b) <= tol * max(1.0, abs(b)) else f"no: {a:.5g} vs {b:.5g}"


def cells(row, times, values, runs):
    """A row of the table from each side's times and last value."""
    median = {name: statistics.median(t) for name, t in times.items()}
    if row.startswith("decode"):
        # Rates: tokens/s, and the ratio of ndscope's rate to PyTorch's.
        rate = {name: values[name] / median[name] for name in median}
        out = [f"{rate['ndscope']:.1f} tok/s", f"{rate['eager']:.1f} tok/s",
               f"{rate['ndscope'] / rate['eager']:.2f}x the rate", "", ""]
    else:
        def fmt(side):
            s = median[side]
            text = f"{s * 1e3:.1f} ms" if median["ndscope"] < 0.1 else f"{s:.3f} s"
            n = len(times[side])
            return text + (f" ({n} run{'s' if n > 1 else ''})" if n < runs else "")

        out = [fmt("ndscope"), fmt("eager"), f"{median['ndscope'] / median['eager']:.2f}x"]
        if "compile" in median:
            out += [fmt("compile"), f"{median['ndscope'] / median['compile']:.2f}x"]
        else:
            out += ["", ""]
    return out + [agree(row, values["ndscope"], values["eager"])]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--rows", nargs="*", default=ROWS, choices=ROWS)
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile's column")
    parser.add_argument("--slow", type=float, default=60.0, metavar="SECONDS",
                        help="a side with a run longer than this is not run again, and its figure "
                             "says how many runs it is of (PyTorch's bf16 without AVX-512 BF16: minutes)")
    args = parser.parse_args()

    ndscope = Ndscope(args.threads)
    # The checkpoint is ndscope's to write: ask for a row that loads nothing more, then PyTorch.
    ndscope.run(args.rows[0])
    pytorch = Pytorch(args.threads, not args.no_compile)
    import torch
    import transformers

    print(f"CPU: {cpu()}")
    print(f"{args.threads} threads a side, medians of {args.runs}, sides alternating; PyTorch "
          f"{torch.__version__}, transformers {transformers.__version__}; {time.strftime('%Y-%m-%d %H:%M')}\n")
    print("| row | ndscope | PyTorch eager | ndscope / eager | torch.compile | ndscope / compile "
          "| same result |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for row in args.rows:
        compiled = pytorch.compiled is not None and row.startswith("forward") and "bf16" not in row
        sides = [("ndscope", ndscope.run), ("eager", pytorch.run)]
        if compiled:
            sides.append(("compile", lambda r: pytorch.run(r, compiled=True)))
        times = {name: [] for name, _ in sides}
        values, once = {}, set()
        for name, run in sides:
            # ndscope's side warms up before it answers. A compiled backward pass compiles again on
            # its second call (the gradients exist then): two warm-ups.
            for _ in range({"ndscope": 0, "eager": 1, "compile": 2}[name]):
                seconds, values[name] = run(row)
            if name != "ndscope" and seconds > args.slow:
                times[name].append(seconds)
                once.add(name)
        while any(len(times[name]) < args.runs for name, _ in sides if name not in once):
            for name, run in sides:
                if name not in once and len(times[name]) < args.runs:
                    seconds, values[name] = run(row)
                    times[name].append(seconds)
                    if seconds > args.slow:
                        once.add(name)
        print(f"| {row} | " + " | ".join(cells(row, times, values, args.runs)) + " |", flush=True)
    ndscope.close()


if __name__ == "__main__":
    main()
