#!/usr/bin/env bash
# The serving load (benches/serve_load.py) against ndscope-server and llama.cpp's llama-server, one
# server at a time on this machine, same model, same requests, same threads and parallel slots.
#
#   python3 benches/serve_models.py tokenizers            # once: tokenizers for the random checkpoints
#   python3 benches/serve_models.py gguf LLAMA_CPP_DIR    # once: the same checkpoints as GGUF
#   bash benches/serve_versus_llama_cpp.sh LLAMA_CPP_DIR/build/bin/llama-server [gpt2|llama] ...
#
# llama.cpp comes from the sources vendored in the `llama-cpp-python` source distribution (see
# BENCHMARKS.md); build it with `cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF` and
# `cmake --build build --target llama-server`. Prints one JSON line per run.
set -euo pipefail
cd "$(dirname "$0")/.."

llama_server=$1
shift
models=("${@:-gpt2 llama}")
threads=${THREADS:-2}
port=8790
cargo build --release -p ndscope-server >/dev/null 2>&1

wait_ready() {
    for _ in $(seq 600); do
        curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && return 0
        sleep 0.5
    done
    echo "the server did not start" >&2
    return 1
}

# $1 label, $2 model name, $3 ids below, $4 requests, $5 concurrency, $6 prompt, $7 output, then the
# server's command line.
measure() {
    local label=$1 name=$2 vocab=$3 requests=$4 concurrency=$5 prompt=$6 output=$7
    shift 7
    "$@" >"target/serve-bench-$label.log" 2>&1 &
    local pid=$!
    wait_ready
    python3 benches/serve_load.py "http://127.0.0.1:$port" "$name" --label "$label" \
        --requests "$requests" --concurrency "$concurrency" --prompt "$prompt" --output "$output" \
        --vocab "$vocab"
    kill "$pid"
    wait "$pid" 2>/dev/null || true
}

for model in ${models[*]}; do
    case $model in
    gpt2)
        dir=target/gpt2-small-random gguf=target/gpt2-small-random-f32.gguf name=gpt2-small-random
        vocab=50256 requests=256 prompt=16:256 output=16:128 dtype=f32 context=384
        ;;
    llama)
        dir=target/llama-1b-random gguf=target/llama-1b-random-bf16.gguf name=llama-1b-random
        vocab=128000 requests=64 prompt=16:128 output=16:64 dtype=bf16 context=192
        ;;
    *)
        echo "unknown model $model (gpt2 or llama)" >&2
        exit 2
        ;;
    esac
    for c in 32 64; do
        measure "ndscope-$model-$c" "$name" "$vocab" "$requests" "$c" "$prompt" "$output" \
            env RAYON_NUM_THREADS="$threads" target/release/ndscope-server --model "$dir" \
            --port "$port" --dtype "$dtype" --batch "$c" --kv-tokens $((c * context))
        measure "llama.cpp-$model-$c" "$name" "$vocab" "$requests" "$c" "$prompt" "$output" \
            "$llama_server" -m "$gguf" --alias "$name" --port "$port" -t "$threads" -tb "$threads" \
            -np "$c" -c $((c * context)) --no-webui
    done
done
