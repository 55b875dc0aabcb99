// clover-ops: print the ggml ops that a clover model's graph uses (a causal commit and a commit
// fused with a block pass), one per line. native/scripts/check_ops.py checks them against each backend's
// supports_op. With --export FILE it also writes every distinct node of those graphs (op, type,
// shape, op params, sources) in test-export-graph-ops' format, which `test-backend-ops
// --test-file FILE` runs: the clover graph's own cases instead of each op's full sweep.
#include "llama.h"
#include "ggml.h"

#include <cstdio>
#include <cstring>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

struct graph_ops {
    std::set<std::string> names;
    std::map<std::string, std::string> cases;  // a case without its node name -> the node name
};

// one line of tests/test-export-graph-ops.cpp's test_object::serialize, less the trailing name
static std::string test_case_line(const ggml_tensor * t) {
    std::ostringstream out;
    out << t->op << ' ' << t->type << ' ';
    for (int i = 0; i < 4; ++i) out << t->ne[i] << ' ';
    const int n_params = GGML_MAX_OP_PARAMS / sizeof(int32_t);
    out << n_params << ' ';
    for (int i = 0; i < n_params; ++i) out << t->op_params[i] << ' ';
    int n_src = 0;
    while (n_src < GGML_MAX_SRC && t->src[n_src]) ++n_src;
    out << n_src << ' ';
    for (int s = 0; s < n_src; ++s) {
        const ggml_tensor * src = t->src[s];
        out << src->type << ' ';
        for (int i = 0; i < 4; ++i) out << src->ne[i] << ' ';
        for (int i = 0; i < 4; ++i) out << src->nb[i] << ' ';
    }
    return out.str();
}

static bool collect(struct ggml_tensor * t, bool ask, void * user_data) {
    if (ask && t->op != GGML_OP_NONE) {
        auto * ops = static_cast<graph_ops *>(user_data);
        ops->names.insert(ggml_op_desc(t));
        switch (t->op) {
            case GGML_OP_VIEW: case GGML_OP_RESHAPE: case GGML_OP_PERMUTE: case GGML_OP_TRANSPOSE: break;
            default: {
                std::string name = t->name[0] ? t->name : "-";
                for (char & c : name) if (c == ' ') c = '_';  // the reader splits on whitespace
                ops->cases.emplace(test_case_line(t), name);
            }
        }
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
    const char * export_path = nullptr;
    std::vector<const char *> args;
    for (int i = 1; i < argc; ++i) {
        if (strcmp(argv[i], "--export") == 0 && i + 1 < argc) {
            export_path = argv[++i];
        } else {
            args.push_back(argv[i]);
        }
    }
    if (args.empty()) {
        fprintf(stderr, "usage: %s MODEL.gguf [block_size] [--export TEST_FILE]\n", argv[0]);
        return 2;
    }
    const int block = args.size() > 1 ? atoi(args[1]) : 8;
    llama_log_set([](ggml_log_level, const char *, void *) {}, nullptr);
    llama_backend_init();
    llama_model * model = llama_model_load_from_file(args[0], llama_model_default_params());
    if (!model) {
        fprintf(stderr, "error: cannot load %s\n", args[0]);
        return 1;
    }
    graph_ops ops;
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
    for (const auto & name : ops.names) {
        printf("%s\n", name.c_str());
    }
    if (ok && export_path) {
        FILE * f = fopen(export_path, "w");
        if (!f) {
            fprintf(stderr, "error: cannot write %s\n", export_path);
            ok = false;
        } else {
            for (const auto & [line, name] : ops.cases) {
                fprintf(f, "%s%s\n", line.c_str(), name.c_str());
            }
            ok = fclose(f) == 0;
        }
    }
    llama_free(ctx);
    llama_model_free(model);
    return ok ? 0 : 1;
}
