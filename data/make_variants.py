"""Makes data/qwen2-tiny, data/mistral-tiny and data/llama-dynamic-tiny: the Llama family's other
layouts and RoPE scalings, as Hugging Face directories with what transformers computes from them (the
oracles of tests/llama.rs).

    python3 data/make_variants.py [NAME...]   # transformers 5, torch, on the CPU; downloads nothing

Each model is seeded and randomly initialised (initializer_range 0.2, so that logits are not flat and
greedy steps are not near ties), saved with `save_pretrained` in float32, and given llama-tiny's
tokenizer files (vocabulary 1000). Then, as for llama-tiny:

- `input_ids` [2, 32] int64 (seeded); `logits` [2, 32, 1000] and `loss` [1] (mean next-token
  cross-entropy) with the model in float64 and eager attention; `grad/NAME` (float64) for every
  parameter `named_parameters` lists (a tied head's part is in `model.embed_tokens.weight`);
- `prompt0_ids`, `prompt1_ids` and `generated0_ids`, `generated1_ids` (the prompt and 24 greedy tokens
  from `generate` in float32, `min_new_tokens` 24), `step_logits0`, `step_logits1` [24, 1000] float32
  (the raw logits of each step); every step's top-2 margin is above 1e-4.

qwen2-tiny: `Qwen2ForCausalLM`, biases on q/k/v, a tied head, RoPE theta 1e6, and its config
rewritten to the top-level `rope_theta`/`rope_scaling` form the published Qwen2.5 checkpoints carry.
mistral-tiny: `MistralForCausalLM` with a sliding window of 16 positions (of 64), so the 32-token
inputs and the generations see the window; RoPE linear scaling (factor 2), kept in transformers 5's
`rope_parameters` form.
llama-dynamic-tiny: `LlamaForCausalLM` with dynamic NTK RoPE scaling (factor 4) over
`max_position_embeddings` 16, so the 32-token inputs and the generations (which cross position 16)
run on frequencies transformers recomputes for the sequence's length.
"""

import json
import shutil
import sys
from pathlib import Path

import tokenizers
import torch
import transformers
from safetensors.torch import save_file
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

DATA = Path(__file__).resolve().parent
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]
PROMPTS = ["A scope owns every tensor created in it", "def main():\n    return"]
COMMON = dict(
    vocab_size=1000,
    hidden_size=64,
    intermediate_size=176,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    initializer_range=0.2,
    bos_token_id=0,
    eos_token_id=[1, 4],
)


def legacy_rope(directory):
    """Moves `rope_parameters` to the top-level `rope_theta` and `rope_scaling`."""
    path = directory / "config.json"
    config = json.loads(path.read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = None if rope.get("rope_type") == "default" else rope
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def reference(directory, model_class, seed):
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"))
    out = {}
    model = model_class.from_pretrained(directory, dtype=torch.float64, attn_implementation="eager")
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (2, 32), generator=generator)
    result = model(ids, labels=ids)
    result.loss.backward()
    out["input_ids"] = ids
    out["logits"] = result.logits.detach()
    out["loss"] = result.loss.detach().reshape(1)
    for name, p in model.named_parameters():
        out[f"grad/{name}"] = p.grad.detach()
    model = model_class.from_pretrained(directory, dtype=torch.float32)
    texts = {}
    for i, prompt in enumerate(PROMPTS):
        prompt_ids = torch.tensor([tokenizer(prompt)["input_ids"]])
        generated = model.generate(
            prompt_ids,
            max_new_tokens=24,
            min_new_tokens=24,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=1,
        )
        logits = torch.cat(generated.logits, dim=0).float()
        top2 = logits.topk(2, dim=-1).values
        margin = (top2[:, 0] - top2[:, 1]).min().item()
        assert margin > 1e-4, f"{directory.name}: a greedy step is a near tie ({margin})"
        out[f"prompt{i}_ids"] = prompt_ids[0]
        out[f"generated{i}_ids"] = generated.sequences[0]
        out[f"step_logits{i}"] = logits
        texts[prompt] = tokenizer.decode(generated.sequences[0])
    save_file({k: v.contiguous() for k, v in out.items()}, directory / "reference.safetensors")
    facts = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "seed": seed,
        "loss": result.loss.item(),
        "parameters": sum(p.numel() for p in model.parameters()),
        "greedy": texts,
    }
    (directory / "reference.json").write_text(json.dumps(facts, indent=2) + "\n")


def make(name, config, model_class, seed, legacy=False):
    if len(sys.argv) > 1 and name not in sys.argv[1:]:
        return
    directory = DATA / name
    shutil.rmtree(directory, ignore_errors=True)
    torch.manual_seed(seed)
    model_class(config).save_pretrained(directory)
    for file in TOKENIZER_FILES:
        shutil.copy(DATA / "llama-tiny" / file, directory / file)
    if legacy:
        legacy_rope(directory)
    reference(directory, model_class, seed + 1)
    print(f"{directory}: done")


make(
    "qwen2-tiny",
    Qwen2Config(
        **COMMON,
        max_position_embeddings=128,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=True,
        use_sliding_window=False,
    ),
    Qwen2ForCausalLM,
    seed=20,
    legacy=True,
)
make(
    "mistral-tiny",
    MistralConfig(
        **COMMON,
        max_position_embeddings=64,
        sliding_window=16,
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10_000.0},
        tie_word_embeddings=False,
    ),
    MistralForCausalLM,
    seed=30,
)
make(
    "llama-dynamic-tiny",
    LlamaConfig(
        **COMMON,
        max_position_embeddings=16,
        rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10_000.0},
        tie_word_embeddings=False,
    ),
    LlamaForCausalLM,
    seed=40,
)
