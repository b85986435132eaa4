"""Writes the GGUF files of benches/gguf.rs to target/: the Llama-3.2-1B-shaped model
(target/llama-1b-random, from `python3 benches/llama_reference.py make`) and GPT-2 small's shape
(target/gpt2-small-random, from `cargo bench --bench gpt2`), both random weights, converted by
llama.cpp's own converter (bf16 and f32) and quantized by its `llama-quantize` to Q8_0, Q4_0,
Q4_K_M and Q5_K_M -- the same files `llama-bench` is given in BENCHMARKS.md.

    python3 benches/serve_models.py tokenizers   # first: random weights come without a tokenizer
    python3 benches/gguf_files.py LLAMA_CPP_DIR

LLAMA_CPP_DIR is a llama.cpp source tree built with cmake, as for data/gguf/make_gguf.py (whose
converter wrapper this uses: the pre-tokenizer named `gpt-2`, GPT-2's `n_ctx` added in a copy).
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
TARGET = os.path.join(HERE, "..", "target")
sys.path.insert(0, os.path.join(HERE, "..", "data", "gguf"))
from make_gguf import CONVERT  # noqa: E402


def convert(llama_cpp, model, outtype, name):
    src = os.path.join(TARGET, model)
    if not os.path.isfile(os.path.join(src, "config.json")):
        sys.exit(f"no {src}: see this script's docstring for how to make it")
    base = os.path.join(TARGET, f"{name}-{outtype}.gguf")
    with tempfile.TemporaryDirectory() as tmp:
        copy = os.path.join(tmp, model)
        shutil.copytree(src, copy)
        config_path = os.path.join(copy, "config.json")
        config = json.load(open(config_path))
        if config["model_type"] == "gpt2" and "n_ctx" not in config:
            config["n_ctx"] = config["n_positions"]
            json.dump(config, open(config_path, "w"), indent=1)
        subprocess.run([sys.executable, "-c", CONVERT, llama_cpp, copy, "--outfile", base,
                        "--outtype", outtype], check=True)
    for kind in ["Q8_0", "Q4_0", "Q4_K_M", "Q5_K_M"]:
        out = os.path.join(TARGET, f"{name}-{kind}.gguf")
        subprocess.run([os.path.join(llama_cpp, "build", "bin", "llama-quantize"), base, out, kind,
                        "2"], check=True)
        print(out)


def main(llama_cpp):
    convert(llama_cpp, "llama-1b-random", "bf16", "llama-1b")
    convert(llama_cpp, "gpt2-small-random", "f32", "gpt2-small")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
