"""The models of the serving load test (benches/serve_load.py), for ndscope-server and llama.cpp's
llama-server alike: GPT-2 small's and Llama-3.2-1B's shapes with random weights (target/
gpt2-small-random from `cargo bench --bench gpt2`, target/llama-1b-random from
`python3 benches/llama_reference.py make`).

    python3 benches/serve_models.py tokenizers           # a tokenizer.json for each directory
    python3 benches/serve_models.py gguf LLAMA_CPP_DIR   # each directory as GGUF, by llama.cpp's converter

Random weights come without a tokenizer, and both servers need one whose vocabulary covers the
model's: `tokenizers` writes a byte-level BPE tokenizer (GPT-2's pre-tokenizer and byte alphabet)
whose other tokens are lowercase ASCII strings, so that every token a random model draws reads as
text on its own, and each server streams one chunk per token. Its special tokens sit where the
checkpoints' configs put them (GPT-2's `<|endoftext|>` 50256; Llama 3's 128000-128255).

`gguf` runs LLAMA_CPP_DIR/convert_hf_to_gguf.py (with its requirements: torch, transformers,
sentencepiece) on both directories (f32 for GPT-2, bf16 for the
Llama, as each checkpoint is stored). The converter recognises a BPE pre-tokenizer by hashing its
tokens for a test text, which identifies published vocabularies only; this tokenizer's pre-tokenizer
is GPT-2's byte-level one, so the converter is told `gpt-2` instead of guessing.
"""

import json
import os
import string
import subprocess
import sys

MODELS = {
    "target/gpt2-small-random": {"specials": {50256: "<|endoftext|>"}, "bos": None, "outtype": "f32"},
    "target/llama-1b-random": {
        "specials": {
            128000: "<|begin_of_text|>",
            128001: "<|end_of_text|>",
            128008: "<|eom_id|>",
            128009: "<|eot_id|>",
        },
        "bos": 128000,
        "outtype": "bf16",
        "reserved_from": 128000,
    },
}


def bytes_to_unicode():
    """GPT-2's map from bytes to the printable characters byte-level BPE writes them as."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def tokenizer_json(vocab_size, specials, bos, reserved_from=None):
    vocab = {}
    for b, ch in sorted(bytes_to_unicode().items()):
        vocab[ch] = b
    merges = []
    letters = string.ascii_lowercase
    regular = reserved_from if reserved_from is not None else min(specials)
    frontier = list(letters)
    while len(vocab) < regular:
        grown = []
        for stem in frontier:
            for ch in letters:
                if len(vocab) >= regular:
                    break
                token = stem + ch
                vocab[token] = len(vocab)
                merges.append(f"{stem} {ch}")
                grown.append(token)
        frontier = grown
    added = []
    for i in range(regular, vocab_size):
        content = specials.get(i, f"<|reserved_special_token_{i - regular}|>")
        vocab[content] = i
        added.append({"id": i, "content": content, "single_word": False, "lstrip": False,
                      "rstrip": False, "normalized": False, "special": True})
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    if bos is None:
        post = byte_level
    else:
        name = specials[bos]
        post = {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": name, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": name, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {name: {"id": name, "ids": [bos], "tokens": [name]}},
        }
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": post,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False, "vocab": vocab, "merges": merges},
    }


def tokenizers():
    for path, m in MODELS.items():
        config = json.load(open(os.path.join(path, "config.json")))
        if config["model_type"] == "gpt2" and "n_ctx" not in config:
            # The published GPT-2 configs carry `n_ctx` beside `n_positions`, and llama.cpp's
            # converter reads it; transformers 5 no longer writes it.
            config["n_ctx"] = config["n_positions"]
            json.dump(config, open(os.path.join(path, "config.json"), "w"), indent=2)
        vocab_size = config["vocab_size"]
        t = tokenizer_json(vocab_size, m["specials"], m["bos"], m.get("reserved_from"))
        assert len(t["model"]["vocab"]) == vocab_size, (len(t["model"]["vocab"]), vocab_size)
        json.dump(t, open(os.path.join(path, "tokenizer.json"), "w"))
        eos = config.get("eos_token_id")
        eos = eos[0] if isinstance(eos, list) else eos
        json.dump({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": m["specials"].get(m["bos"]) if m["bos"] is not None else None,
            "eos_token": m["specials"].get(eos, "<|endoftext|>"),
            "model_max_length": config.get("max_position_embeddings", config.get("n_positions")),
            "add_bos_token": m["bos"] is not None,
        }, open(os.path.join(path, "tokenizer_config.json"), "w"), indent=1)
        print(f"{path}: tokenizer.json with {vocab_size} tokens")


def gguf(llama_cpp):
    script = f"""
import sys
sys.path.insert(0, {llama_cpp!r})
sys.argv = ["convert_hf_to_gguf.py"] + sys.argv[1:]
import convert_hf_to_gguf as convert
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
convert.main()
"""
    for path, m in MODELS.items():
        out = f"{path}-{m['outtype']}.gguf"
        subprocess.run([sys.executable, "-c", script, path, "--outfile", out, "--outtype", m["outtype"]],
                       check=True)
        print(f"{path}: {out}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["tokenizers"]:
        tokenizers()
    elif sys.argv[1:2] == ["gguf"] and len(sys.argv) == 3:
        gguf(sys.argv[2])
    else:
        sys.exit(__doc__)
