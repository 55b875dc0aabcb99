// clover-ops: print the ggml ops that a clover model's graph uses (a causal commit and a commit
// fused with a block pass), one per line. native/check_ops.py checks them against each backend's supports_op.
#include "llama.h"
#include "ggml.h"

#include <cstdio>
#include <set>
#include <string>
#include <vector>

static bool collect(struct ggml_tensor * t, bool ask, void * user_data) {
    if (ask && t->op != GGML_OP_NONE) {
        static_cast<std::set<std::string> *>(user_data)->insert(ggml_op_desc(t));
    }
    return false;  // we only need the op, never the data
}

static bool decode(llama_context * ctx, const std::vector<llama_token> & toks, llama_pos pos0, llama_seq_id seq, bool logits) {
    llama_batch b = llama_batch_init((int32_t) toks.size(), 0, 1);
    for (size_t i = 0; i < toks.size(); ++i) {
        b.token[i] = toks[i]; b.pos[i] = pos0 + (llama_pos) i;
        b.n_seq_id[i] = 1; b.seq_id[i][0] = seq; b.logits[i] = logits;
    }
    b.n_tokens = (int32_t) toks.size();
    const bool ok = llama_decode(ctx, b) == 0;
    llama_batch_free(b);
    return ok;
}

int main(int argc, char ** argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s MODEL.gguf [block_size]\n", argv[0]);
        return 2;
    }
    const int block = argc > 2 ? atoi(argv[2]) : 8;
    llama_log_set([](ggml_log_level, const char *, void *) {}, nullptr);
    llama_backend_init();
    llama_model * model = llama_model_load_from_file(argv[1], llama_model_default_params());
    if (!model) {
        fprintf(stderr, "error: cannot load %s\n", argv[1]);
        return 1;
    }
    std::set<std::string> ops;
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 256; cp.n_batch = 64; cp.n_ubatch = block; cp.n_seq_max = 2; cp.kv_unified = true;
    cp.cb_eval = collect; cp.cb_eval_user_data = &ops;
    llama_context * ctx = llama_init_from_model(model, cp);
    std::vector<llama_token> toks(block, 1);
    bool ok = ctx && decode(ctx, toks, 0, 0, false);            // a causal commit
    if (ok) {                                                   // a commit fused with a block pass
        llama_set_canvas(ctx, block / 2 > 0 ? block / 2 : 1, block);
        llama_set_expert_coreset(ctx, 1); // the canvas's expert coreset ops too (spec/model.md, "MoE")
        ok = decode(ctx, toks, block, 0, true);
    }
    for (const auto & op : ops) {
        printf("%s\n", op.c_str());
    }
    llama_free(ctx);
    llama_model_free(model);
    return ok ? 0 : 1;
}
