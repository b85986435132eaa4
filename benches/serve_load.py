"""A bounded load on an OpenAI-compatible server over loopback: REQUESTS streamed completions of mixed
prompt and output lengths, CONCURRENCY at a time; generated tokens per second, time to first token
and inter-token latency (p50, p99). The same seed sends the same requests (token-id prompts, greedy,
each output exactly its length: `min_tokens` for ndscope-server, `ignore_eos` for llama-server) to
any server, so ndscope-server and llama.cpp's llama-server are measured on one workload.

    python3 benches/serve_load.py URL MODEL [--requests 256] [--concurrency 32] [--prompt 16:256]
                                            [--output 16:128] [--vocab 1000] [--seed 0]

Time to first token: from sending a request to its first token's chunk. Inter-token latency: the
gaps between a request's consecutive token chunks (vLLM's benchmark's ITL; both servers send one
chunk per token here, see benches/serve_models.py). Only the standard library is used, so the client
costs both servers the same.
"""

import argparse
import http.client
import json
import queue
import random
import statistics
import threading
import time
import urllib.parse


def percentile(values, p):
    if not values:
        return float("nan")
    values = sorted(values)
    k = (len(values) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def workload(n, prompt, output, vocab, seed):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = rng.randint(*prompt)
        # Token ids past the byte alphabet and below the special tokens: plain text in both servers.
        ids = [rng.randint(256, vocab - 1) for _ in range(p)]
        out.append((ids, rng.randint(*output)))
    return out


def run_one(url, model, ids, max_tokens):
    """One streamed request: (sent, [times of token chunks], error)."""
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    body = {
        "model": model,
        "prompt": ids,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "min_tokens": max_tokens,
        "ignore_eos": True,
    }
    sent = time.perf_counter()
    times = []
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            return sent, times, f"HTTP {r.status}: {r.read()[:200]!r}"
        for line in r:
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                return sent, times, str(chunk["error"])
            if any(c.get("text") for c in chunk.get("choices", [])):
                times.append(time.perf_counter())
        return sent, times, None
    except Exception as e:  # noqa: BLE001 - reported with the figures
        return sent, times, repr(e)
    finally:
        conn.close()


def main():
    a = argparse.ArgumentParser()
    a.add_argument("url")
    a.add_argument("model")
    a.add_argument("--requests", type=int, default=256)
    a.add_argument("--concurrency", type=int, default=32)
    a.add_argument("--prompt", default="16:256")
    a.add_argument("--output", default="16:128")
    a.add_argument("--vocab", type=int, default=1000)
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--label", default="")
    args = a.parse_args()
    span = lambda s: tuple(int(x) for x in s.split(":"))  # noqa: E731
    jobs = workload(args.requests, span(args.prompt), span(args.output), args.vocab, args.seed)
    todo = queue.Queue()
    for j in jobs:
        todo.put(j)
    results = []
    lock = threading.Lock()

    def worker():
        while True:
            try:
                ids, n = todo.get_nowait()
            except queue.Empty:
                return
            r = run_one(args.url, args.model, ids, n)
            with lock:
                results.append((n, r))

    start = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(args.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    errors = [r[2] for _, r in results if r[2]]
    tokens = sum(len(r[1]) for _, r in results)
    wanted = sum(n for n, _ in results)
    ttft = [r[1][0] - r[0] for _, r in results if r[1]]
    itl = [b - a for _, r in results for a, b in zip(r[1], r[1][1:])]
    figures = {
        "label": args.label,
        "requests": args.requests,
        "concurrency": args.concurrency,
        "errors": len(errors),
        "tokens": tokens,
        "tokens_asked": wanted,
        "seconds": round(wall, 2),
        "tokens_per_s": round(tokens / wall, 1),
        "ttft_p50_ms": round(1e3 * percentile(ttft, 50), 1),
        "ttft_p99_ms": round(1e3 * percentile(ttft, 99), 1),
        "itl_p50_ms": round(1e3 * percentile(itl, 50), 1),
        "itl_p99_ms": round(1e3 * percentile(itl, 99), 1),
        "itl_mean_ms": round(1e3 * statistics.fmean(itl), 1) if itl else None,
    }
    print(json.dumps(figures))
    if errors:
        print("first errors:", errors[:3])


if __name__ == "__main__":
    main()
