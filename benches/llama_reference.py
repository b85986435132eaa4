"""transformers' and PyTorch's side of benches/llama.rs, on the CPU, on the same Llama-3.2-1B-shaped
directory (random weights):

    python3 benches/llama_reference.py make [DIR]   # writes the checkpoint (bf16, 2.5 GB), once
    python3 benches/llama_reference.py step [DIR]   # forward 512, forward+backward 256, generate
    python3 benches/llama_reference.py decode [DIR] # generate only

DIR defaults to target/llama-1b-random. Two threads (torch.set_num_threads(2)), batch 1, sdpa
attention, medians of 3 after a warm-up run, the same token ids as the Rust side; f32 and bf16 (the
model's weights in that dtype, as ndscope loads them). A third argument, `cuda`, runs the same work
(and draws `make`'s weights) on the GPU, beside `NDSCOPE_BENCH_DEVICE=cuda:0 cargo bench --features
cuda --bench llama`; each timing there ends in a synchronize. `generate` is greedy, 32 new tokens after a
16-token prompt (`min_new_tokens` 32), once per request and for 8 requests in one batch.
"""
import statistics
import sys
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

torch.set_num_threads(2)
RUNS = 3
DEVICE = torch.device(sys.argv[3] if len(sys.argv) > 3 else "cpu")


def ids(n):
    return torch.tensor([[(i * 7919 + 13) % 128_256 for i in range(n)]], device=DEVICE)


def synchronize():
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def make(path):
    config = LlamaConfig(
        vocab_size=128_256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=131_072,
        rms_norm_eps=1e-5,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500_000.0,
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        tie_word_embeddings=True,
        bos_token_id=128_000,
        eos_token_id=[128_001, 128_008, 128_009],
    )
    torch.manual_seed(7)
    # Drawn where the work runs: on a GPU the 1.2 billion draws take a second, not a minute (other
    # values than the host's draws, which no timing depends on).
    with DEVICE:
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    print(f"wrote {path}: {sum(p.numel() for p in model.parameters())} parameters")


def median(work):
    work()
    synchronize()
    times = []
    for _ in range(RUNS):
        start = time.perf_counter()
        work()
        synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def step(path, passes=True):
    for dtype, label in [(torch.float32, "f32"), (torch.bfloat16, "bf16")]:
        model = LlamaForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
        model.to(DEVICE)
        model.eval()
        if passes:
            forward_and_backward(model, label)
        decode(model, label)
        del model


def forward_and_backward(model, label):
    x = ids(512)

    def forward():
        with torch.no_grad():
            model(x).logits[0, -1].float().sum().item()

    print(f"torch llama_1b/forward_512/{label}: {median(forward):.3f} s")
    y = ids(257)

    def forward_backward():
        model.zero_grad(set_to_none=True)
        out = model(y[:, :256])
        loss = torch.nn.functional.cross_entropy(out.logits[0].float(), y[0, 1:])
        loss.backward()

    print(f"torch llama_1b/forward_backward_256/{label}: {median(forward_backward):.3f} s")
    model.zero_grad(set_to_none=True)


def decode(model, label):
    prompt = ids(16)

    def generate(batch):
        def run():
            with torch.no_grad():
                p = prompt.repeat(batch, 1)
                p[:, 0] = torch.arange(batch, device=DEVICE)
                model.generate(
                    p,
                    attention_mask=torch.ones_like(p),
                    max_new_tokens=32,
                    min_new_tokens=32,
                    do_sample=False,
                    pad_token_id=0,
                )
        return run

    one = median(generate(1))
    eight = median(generate(8))
    print(
        f"torch llama_1b/generate/{label}: one request 32 tokens in {one:.3f} s "
        f"({32 / one:.2f} tokens/s); 8 requests in {eight:.3f} s ({256 / eight:.2f} tokens/s, "
        f"{(256 / eight) / (32 / one):.2f}x)"
    )


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "step"
    path = sys.argv[2] if len(sys.argv) > 2 else "target/llama-1b-random"
    # `decode`: the generation timings alone (what `cargo bench --bench llama -- decode` measures).
    {"make": make, "step": step, "decode": lambda p: step(p, passes=False)}[what](path)
