/* Prints llama.cpp's logits for a token sequence, one line of floats per position, for the GGUF
 * fixtures of tests/gguf.rs (built and run by make_gguf.py):
 *
 *     llama_logits MODEL.gguf ID...
 *
 * One batch, every position's logits, one thread, flash attention off, an f32 KV cache: the plain
 * evaluation. */
#include <stdio.h>
#include <stdlib.h>

#include "llama.h"

static void quiet(enum ggml_log_level level, const char * text, void * data) {
    (void) level; (void) text; (void) data;
}

int main(int argc, char ** argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s MODEL.gguf ID...\n", argv[0]);
        return 2;
    }
    int n = argc - 2;
    llama_log_set(quiet, NULL);
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    struct llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) {
        fprintf(stderr, "cannot load %s\n", argv[1]);
        return 1;
    }
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = n;
    cp.n_batch = n;
    cp.n_ubatch = n;
    cp.n_threads = 1;
    cp.n_threads_batch = 1;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    cp.type_k = GGML_TYPE_F32; /* the cache defaults to f16, which would round every key */
    cp.type_v = GGML_TYPE_F32;
    struct llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) {
        fprintf(stderr, "cannot make a context\n");
        return 1;
    }
    struct llama_batch batch = llama_batch_init(n, 0, 1);
    for (int i = 0; i < n; i++) {
        batch.token[i] = atoi(argv[i + 2]);
        batch.pos[i] = i;
        batch.n_seq_id[i] = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i] = 1;
    }
    batch.n_tokens = n;
    if (llama_decode(ctx, batch) != 0) {
        fprintf(stderr, "llama_decode failed\n");
        return 1;
    }
    int vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    for (int i = 0; i < n; i++) {
        const float * l = llama_get_logits_ith(ctx, i);
        for (int j = 0; j < vocab; j++) {
            printf(j ? " %.9g" : "%.9g", l[j]);
        }
        printf("\n");
    }
    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
