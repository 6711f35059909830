// The target hidden states llama.cpp hands an EAGLE3 draft, read through the same calls as
// common/speculative.cpp: llama_get_embeddings_layer_inp(ctx, l) for an id l < N and
// llama_get_embeddings_nextn(ctx) for id N. bench/integration/llamacpp.py compares them with the
// transformers hidden states h_0 .. h_N of the same model.
//
// usage: capture_probe MODEL.gguf "PROMPT" OUT.bin
// OUT.bin: int32 n_layer, n_tokens, n_embd; int32 token ids [n_tokens];
//          float32 states [n_layer + 1][n_tokens][n_embd] (rows 0..N-1: block inputs, row N: nextn)
#include "llama.h"
#include "llama-ext.h"

#include <cstdio>
#include <cstring>
#include <vector>

int main(int argc, char ** argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s MODEL.gguf PROMPT OUT.bin\n", argv[0]);
        return 2;
    }
    llama_backend_init();
    llama_model * model = llama_model_load_from_file(argv[1], llama_model_default_params());
    if (model == nullptr) {
        fprintf(stderr, "capture_probe: cannot load %s\n", argv[1]);
        return 1;
    }
    const llama_vocab * vocab = llama_model_get_vocab(model);
    const int n_layer = llama_model_n_layer(model);
    const int n_embd = llama_model_n_embd(model);

    std::vector<llama_token> ids(4096);
    const int n_tokens = llama_tokenize(vocab, argv[2], (int) strlen(argv[2]), ids.data(), (int) ids.size(), true, true);
    if (n_tokens <= 0) {
        fprintf(stderr, "capture_probe: cannot tokenize the prompt\n");
        return 1;
    }
    ids.resize(n_tokens);

    llama_context_params cparams = llama_context_default_params();
    cparams.n_ctx = 512;
    cparams.n_batch = 512;
    cparams.n_ubatch = 512;
    llama_context * ctx = llama_init_from_model(model, cparams);
    // What common_speculative_impl_draft_eagle3 turns on for ids 0..N-1 and for id N.
    for (int l = 0; l < n_layer; ++l) {
        llama_set_embeddings_layer_inp(ctx, (uint32_t) l, true);
    }
    llama_set_embeddings_nextn(ctx, true, /*masked*/ false);

    if (llama_decode(ctx, llama_batch_get_one(ids.data(), n_tokens)) != 0) {
        fprintf(stderr, "capture_probe: decode failed\n");
        return 1;
    }
    FILE * out = fopen(argv[3], "wb");
    const int header[3] = {n_layer, n_tokens, n_embd};
    fwrite(header, sizeof(int), 3, out);
    fwrite(ids.data(), sizeof(llama_token), n_tokens, out);
    for (int l = 0; l <= n_layer; ++l) {
        const float * rows = l < n_layer ? llama_get_embeddings_layer_inp(ctx, (uint32_t) l) : llama_get_embeddings_nextn(ctx);
        std::vector<float> zeros((size_t) n_tokens * n_embd, 0.0f);
        fwrite(rows ? rows : zeros.data(), sizeof(float), (size_t) n_tokens * n_embd, out);
    }
    fclose(out);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
