"""transformers' side of benches/generate.rs, on the CPU with two threads:

    python3 benches/generate_reference.py

- the bundled tiny GPT-2 (data/gpt2-tiny): `generate` of 100 greedy tokens from the bench's 16-token
  prompt, one request and eight prompts batched;
- GPT-2 small's shape with random weights (target/gpt2-small-random, written by benches/gpt2.rs or
  benches/generate.rs): one decoded token against a cache of 128 tokens, batch 1 and 8 (the forward
  of one token with `past_key_values`, as `generate` runs it).

Medians of 7 after a warm-up run.
"""
import statistics
import time

import torch
from transformers import GPT2LMHeadModel

torch.set_num_threads(2)


def prompt(length, vocab):
    # The same ids as benches/generate.rs.
    return [(i * 7919 + 13) % vocab for i in range(length)]


def median_seconds(f, runs=7):
    f()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def tiny():
    model = GPT2LMHeadModel.from_pretrained("data/gpt2-tiny").eval()
    ids = torch.tensor([prompt(16, 1000)])
    batch = ids.repeat(8, 1)
    batch[:, 0] = torch.arange(8)
    kwargs = dict(max_new_tokens=100, min_new_tokens=100, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        one = median_seconds(lambda: model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs))
        eight = median_seconds(
            lambda: model.generate(batch, attention_mask=torch.ones_like(batch), **kwargs)
        )
    print(f"tiny GPT-2, generate 100 greedy tokens: 1 request {one * 1e3:.2f} ms "
          f"({100 / one:.0f} tokens/s); 8 batched {eight * 1e3:.2f} ms ({800 / eight:.0f} tokens/s)")


def small():
    model = GPT2LMHeadModel.from_pretrained("target/gpt2-small-random").eval()
    with torch.inference_mode():
        for batch in (1, 8):
            ids = torch.tensor([prompt(128, 50257)] * batch)
            past = model(ids, use_cache=True).past_key_values
            token = torch.arange(batch).unsqueeze(1)

            def step():
                # A copy of the cache each time would be timed too; DynamicCache grows in place, so
                # crop the token it added after each step instead.
                model(token, past_key_values=past, use_cache=True)
                past.crop(-1)

            t = median_seconds(step)
            print(f"GPT-2 small shape, one token at 128 cached, batch {batch}: {t * 1e3:.2f} ms "
                  f"({batch / t:.1f} tokens/s)")


if __name__ == "__main__":
    tiny()
    small()
