// clover-context.cpp - the llama.cpp context of a clover_context and the committed-memory
// protocol: seq 0 or 1 holds the memory (the causal processing of the committed tokens, the
// same for every block size), seq 2 is the scratch copy a block pass runs on.

#include "clover-impl.h"
#include "clover-params.h"

// ---- expert_stats: the distinct routed experts of the block passes

// The graph scheduler's eval callback of a context with expert_stats: during a block pass it asks
// for the ffn_moe_topk-<il> nodes (which stops the graph there: a synchronisation per MoE layer)
// and counts them; everything else runs as without a callback.
static bool count_experts(ggml_tensor * t, bool ask, void * user_data) {
    expert_counter & x = static_cast<clover_context *>(user_data)->experts;
    if (!ask) { // (only the nodes asked for come back)
        x.count(t);
        return true;
    }
    return x.in_pass && strncmp(t->name, "ffn_moe_topk-", 13) == 0;
}

void expert_counter::count(const ggml_tensor * t) {
    const int     il = atoi(t->name + 13);
    const int64_t k = t->ne[0], R = t->ne[1];
    int64_t       first = 0; // t's first canvas row
    if (coreset) {
        // the canvas routes on its own with the coreset's bias (ffn_moe_probs_biased); the committed
        // rows' topk, without it, is another node of the same name
        const ggml_tensor * sel = t->src[0] ? t->src[0]->src[0] : nullptr;
        if (!sel || strncmp(sel->name, "ffn_moe_probs_biased", 20) != 0) {
            return;
        }
    } else { // every row of the ubatch, or (the last layer) its output rows only
        first = R == (int64_t) n_commit + n_canvas ? n_commit : n_out_commit;
    }
    // t is a view of the argsort over all experts: k ids per row, rows nb[1] bytes apart
    std::vector<uint8_t> raw(ggml_nbytes(t));
    ggml_backend_tensor_get(t, raw.data(), 0, raw.size());
    std::vector<char> seen(std::max<int64_t>(n_expert, t->src[0] ? t->src[0]->ne[0] : 0), 0);
    int64_t distinct = 0;
    for (int64_t r = first; r < R; ++r) {
        for (int64_t j = 0; j < k; ++j) {
            int32_t e;
            memcpy(&e, raw.data() + r * t->nb[1] + j * t->nb[0], sizeof(e));
            if (e >= 0 && e < (int64_t) seen.size() && !seen[e]) {
                seen[e] = 1;
                ++distinct;
            }
        }
    }
    sum_distinct += (double) distinct;
    ++n_layer_counts;
    if (il >= 0 && il < (int) bytes_per_expert.size()) {
        sum_bytes += distinct * bytes_per_expert[il];
    }
}

double expert_counter::bytes_b1() const {
    double b = 0.0;
    for (const double per : bytes_per_expert) {
        b += n_used * per;
    }
    return b;
}

namespace clover_impl {

void free_lctx(clover_context * c) {
    if (c->batch_ok) {
        llama_batch_free(c->batch);
        c->batch_ok = false;
    }
    if (c->lctx) {
        llama_free(c->lctx);
        c->lctx = nullptr;
    }
    c->n_committed = 0;
    c->mem_tokens.clear();
    c->last_logits.clear();
}

// The ubatch size for block size B: room for a commit of B tokens fused with the next pass
// (2 B), about 512 tokens for the prompt. block_size = auto switches B up to 256 without a new
// context.
int32_t ubatch_for(int32_t B) {
    return std::max(512, 2 * B);
}

bool ubatch_fits(const clover_context * c, int32_t B) {
    return c->lctx && c->U >= 2 * B;
}

// llama.cpp's graph scheduler mallocs a context buffer that grows with n_ubatch (this
// architecture: 40 graph nodes a token, GGML_SCHED_MAX_SPLIT_INPUTS (30) x 2 tensors a node,
// about 20 KiB a token x 40) and aborts the process (GGML_ASSERT(ctx->mem_buffer != NULL) in
// ggml_init) when that malloc fails. A block size too large for the memory must be an error the
// caller sees: the same allocation is tried first (the other allocations of a new context, the
// KV cache and compute buffers, fail as errors in llama.cpp already).
static int check_sched_memory(const clover_context * c, int32_t U, int32_t B, std::string & msg) {
    const size_t nodes = (size_t) std::min<int64_t>(U, c->n_ctx) * 40;
    const size_t need  = nodes * 30 * 2 * sizeof(struct ggml_tensor) + ggml_graph_overhead_custom(nodes, false);
    void *       probe = malloc(need);
    if (!probe) {
        char gib[32];
        snprintf(gib, sizeof(gib), "%.1f", need / 1073741824.0);
        msg = "failed to create the llama.cpp context (n_ctx=" + std::to_string(c->n_ctx) + ", block_size=" +
              std::to_string(B) + "): out of memory (llama.cpp's graph scheduler needs " + gib +
              " GiB for a batch of " + std::to_string(std::min<int64_t>(U, c->n_ctx)) +
              " tokens); use a smaller block size";
        return CLOVER_ERR_LOAD;
    }
    free(probe);
    return CLOVER_OK;
}

// one routed expert's bytes per layer, from the GGUF's tensor infos (each file of a split model):
// the bytes of blk.<il>.ffn_{gate,up,down,gate_up}_exps over their expert count (ne[2])
int load_expert_sizes(clover_context * c, std::string & msg) {
    expert_counter & x = c->experts;
    model_experts(c->model, x.n_expert, x.n_used);
    x.bytes_per_expert.assign(llama_model_n_layer(c->model->lm), 0.0);
    std::vector<std::string> files{ c->model->path };
    char split_count[16];
    if (llama_model_meta_val_str(c->model->lm, "split.count", split_count, sizeof(split_count)) > 0 &&
        atoi(split_count) > 1) {
        const int n = atoi(split_count);
        char      prefix[4096], path[4096];
        if (llama_split_prefix(prefix, sizeof(prefix), c->model->path.c_str(), 0, n) > 0) {
            files.clear();
            for (int i = 0; i < n && llama_split_path(path, sizeof(path), prefix, i, n) > 0; ++i) {
                files.emplace_back(path);
            }
        }
    }
    for (const std::string & f : files) {
        ggml_context *   meta = nullptr;
        gguf_context *   g    = gguf_init_from_file(f.c_str(), { /*.no_alloc =*/ true, /*.ctx =*/ &meta });
        if (!g) {
            msg = "expert_stats: cannot read the tensor infos of " + f;
            return CLOVER_ERR_LOAD;
        }
        for (ggml_tensor * t = ggml_get_first_tensor(meta); t; t = ggml_get_next_tensor(meta, t)) {
            int il = -1, at = 0;
            if (sscanf(t->name, "blk.%d.%n", &il, &at) != 1 || il < 0 || il >= (int) x.bytes_per_expert.size() ||
                t->ne[2] <= 0) {
                continue;
            }
            const std::string part = t->name + at;
            if (part == "ffn_gate_exps.weight" || part == "ffn_up_exps.weight" || part == "ffn_down_exps.weight" ||
                part == "ffn_gate_up_exps.weight") {
                x.bytes_per_expert[il] += (double) ggml_nbytes(t) / (double) t->ne[2];
            }
        }
        gguf_free(g);
        ggml_free(meta);
    }
    return CLOVER_OK;
}

void report_experts(const clover_context * c, clover_stats * stats) {
    const expert_counter & x = c->experts;
    stats->n_expert_passes       = (int32_t) x.n_passes;
    stats->experts_per_pass      = x.n_layer_counts > 0 ? x.sum_distinct / x.n_layer_counts : 0.0;
    stats->expert_bytes_per_pass = x.n_passes > 0 ? x.sum_bytes / x.n_passes : 0.0;
    stats->expert_bytes_b1       = x.bytes_b1();
}

int make_lctx(clover_context * c, int32_t B, std::string & msg) {
    const int32_t U        = ubatch_for(B);
    if (const int rc = check_sched_memory(c, U, B, msg); rc != CLOVER_OK) {
        return rc; // before the old context is freed: a block size too large leaves it usable
    }
    free_lctx(c);
    llama_context_params p = llama_context_default_params();
    p.n_ctx                = (uint32_t) c->n_ctx;
    p.n_ubatch             = (uint32_t) U;
    p.n_batch              = (uint32_t) U;
    p.n_seq_max            = 3; // seq 0 or 1 = memory, seq 2 = scratch for block passes
    p.kv_unified           = true;
    p.n_threads            = c->n_threads;
    p.n_threads_batch      = c->n_threads;
    p.flash_attn_type      = c->flash_attn < 0   ? LLAMA_FLASH_ATTN_TYPE_AUTO :
                             c->flash_attn == 0 ? LLAMA_FLASH_ATTN_TYPE_DISABLED :
                                                  LLAMA_FLASH_ATTN_TYPE_ENABLED;
    p.no_perf              = true;
    p.embeddings           = false;
    if (c->expert_stats) {
        p.cb_eval           = count_experts;
        p.cb_eval_user_data = c;
    }
    if (c->kv_f32) {
        p.type_k = GGML_TYPE_F32;
        p.type_v = GGML_TYPE_F32;
    }
    g_last_log_error.clear();
    c->lctx = llama_init_from_model(c->model->lm, p);
    if (!c->lctx) {
        msg = "failed to create the llama.cpp context (n_ctx=" + std::to_string(c->n_ctx) +
              ", block_size=" + std::to_string(B) + ")";
        const std::string le = last_log_error();
        if (!le.empty()) {
            msg += ": " + le;
        }
        return CLOVER_ERR_LOAD;
    }
    llama_set_causal_attn(c->lctx, true);
    c->U        = (int32_t) llama_n_ubatch(c->lctx); // llama.cpp caps it at n_ctx
    c->batch    = llama_batch_init(c->U, 0, 1);
    c->batch_ok = true;
    c->B        = B;
    c->n_committed = 0;
    c->mem_tokens.clear();
    c->last_logits.clear();
    c->mem_seq     = 0;
    return CLOVER_OK;
}

int check_tokens(const clover_context * c, const int32_t * tokens, int32_t n, std::string & msg) {
    for (int32_t i = 0; i < n; ++i) {
        if (tokens[i] < 0 || tokens[i] >= c->model->n_vocab) {
            msg = "token id " + std::to_string(tokens[i]) + " at index " + std::to_string(i) +
                  " is outside the vocabulary [0, " + std::to_string(c->model->n_vocab) + ")";
            return CLOVER_ERR_INVALID_ARG;
        }
    }
    return CLOVER_OK;
}

// what: "a block pass" (max_n = B) or "a commit" (max_n = n_ctx)
int check_pass(const clover_context * c, const int32_t * tokens, int32_t n, int32_t max_n, const char * what,
               std::string & msg) {
    if (!c->lctx) {
        msg = "context has no llama.cpp context (a previous block-size change failed)";
        return CLOVER_ERR_INVALID_ARG;
    }
    if (!tokens || n < 1 || n > max_n) {
        msg = std::string(what) + " takes 1.." + std::to_string(max_n) + " tokens, got " + std::to_string(n);
        return CLOVER_ERR_INVALID_ARG;
    }
    if ((int64_t) c->n_committed + n > c->n_ctx) {
        msg = "context full: " + std::to_string(c->n_committed) + " committed + " + std::to_string(n) +
              " tokens > n_ctx=" + std::to_string(c->n_ctx);
        return CLOVER_ERR_CONTEXT_FULL;
    }
    return check_tokens(c, tokens, n, msg);
}

// Appends n tokens at positions pos0.. to the batch.
void add_to_batch(clover_context * c, const int32_t * tokens, int32_t n, int32_t pos0, llama_seq_id seq,
                  const std::vector<char> * want, bool logits) {
    llama_batch & b = c->batch;
    for (int32_t i = 0; i < n; ++i) {
        const int32_t at = b.n_tokens++;
        b.token[at]     = tokens[i];
        b.pos[at]       = pos0 + i;
        b.n_seq_id[at]  = 1;
        b.seq_id[at][0] = seq;
        b.logits[at]    = logits && (!want || (*want)[i]) ? 1 : 0;
    }
}

// rows[i] = logits of batch row first + i for the rows asked for (want), valid until the next decode
int read_rows(clover_context * c, int32_t first, int32_t n, const std::vector<char> * want,
              std::vector<const float *> & rows, const char * what, std::string & msg) {
    rows.assign(n, nullptr);
    for (int32_t i = 0; i < n; ++i) {
        if (want && !(*want)[i]) {
            continue;
        }
        rows[i] = llama_get_logits_ith(c->lctx, first + i);
        if (!rows[i]) {
            msg = std::string(what) + ": no logits for token " + std::to_string(i);
            return CLOVER_ERR_DECODE;
        }
    }
    return CLOVER_OK;
}

int decode_status(int rc, const char * what, std::string & msg) {
    msg = std::string(what) + ": llama_decode returned " + std::to_string(rc);
    const std::string le = last_log_error();
    if (!le.empty()) {
        msg += " (" + le + ")";
    }
    return rc == 1 ? CLOVER_ERR_CONTEXT_FULL : CLOVER_ERR_DECODE;
}

// A server lost mid-decode leaves zeros where its results should be: the decode fails, and so
// does every later one on this model (its layers are gone with the server) until a reload.
int rpc_lost(const clover_context * c, const char * what, std::string & msg) {
    if (!c->model->on_rpc || rpc_failures() == c->model->rpc_failures_now) {
        return CLOVER_OK;
    }
    const std::string le = rpc_error(); // "RPC server HOST:PORT: connection lost"
    msg = std::string(what) + ": " + (le.empty() ? "an RPC server was lost" : le) + "; reload the model";
    return CLOVER_ERR_DECODE;
}

int run_decode(clover_context * c, const char * what, std::string & msg) {
    g_last_log_error.clear();
    const int32_t reused_before = llama_perf_context(c->lctx).n_reused;
    const int rc = llama_decode(c->lctx, c->batch);
    if (c->experts.in_pass) {
        ++c->experts.n_passes;
        c->experts.in_pass = false;
    }
    c->n_graphs_reused += llama_perf_context(c->lctx).n_reused - reused_before;
    const int lost = rpc_lost(c, what, msg);
    if (lost != CLOVER_OK) {
        return lost;
    }
    return rc == 0 ? CLOVER_OK : decode_status(rc, what, msg);
}

// the next decode: n_canvas trailing tokens form a canvas of block size B (0 = a causal commit)
void set_canvas(clover_context * c, int32_t n_canvas) {
    llama_set_canvas(c->lctx, n_canvas, c->B);
    llama_set_expert_coreset(c->lctx, c->coreset); // read for canvases only (spec/model.md, "MoE")
    if (c->expert_stats) { // the rows of the decode the counter sees (the batch is complete here)
        expert_counter & x = c->experts;
        x.in_pass          = n_canvas >= 2;
        x.n_canvas         = n_canvas;
        x.n_commit         = c->batch.n_tokens - n_canvas;
        x.n_out_commit     = (int32_t) std::count_if(c->batch.logits, c->batch.logits + x.n_commit,
                                                     [](int8_t l) { return l != 0; });
        // as the graph decides it (models/clover.cpp, coreset_of): a C below k is k, C >= E is off
        x.coreset = c->coreset > 0 && std::max(c->coreset, x.n_used) < x.n_expert;
    }
}

// the logits of batch row i become L_last, the prediction of the next position
int keep_last_logits(clover_context * c, int32_t i, const char * what, std::string & msg) {
    const float * row = llama_get_logits_ith(c->lctx, i);
    if (!row) {
        msg = std::string(what) + ": no logits for the last committed token";
        return CLOVER_ERR_DECODE;
    }
    c->last_logits.assign(row, row + c->model->n_vocab);
    return CLOVER_OK;
}

void clear_memory(clover_context * c) {
    llama_memory_clear(llama_get_memory(c->lctx), true);
    c->n_committed = 0;
    c->mem_tokens.clear();
    c->last_logits.clear();
    c->mem_seq     = 0;
}

// block pass: the scratch sequence = copy of the memory, decode there, read logits, drop it.
// want: which rows to compute (nullptr = all); rows[i] = the logits of token i (nullptr
// where not wanted), valid until the next llama_decode on this context.
int block_pass_rows(clover_context * c, const int32_t * tokens, int32_t n, const std::vector<char> * want,
                    std::vector<const float *> & rows, std::string & msg) {
    llama_memory_t mem = llama_get_memory(c->lctx);
    llama_memory_seq_rm(mem, SCRATCH_SEQ, -1, -1);
    llama_memory_seq_cp(mem, c->mem_seq, SCRATCH_SEQ, -1, -1);
    c->batch.n_tokens = 0;
    add_to_batch(c, tokens, n, c->n_committed, SCRATCH_SEQ, want, true);
    set_canvas(c, n);
    const int rc = run_decode(c, "block pass", msg);
    llama_memory_seq_rm(mem, SCRATCH_SEQ, -1, -1);
    if (rc != CLOVER_OK) {
        return rc;
    }
    return read_rows(c, 0, n, want, rows, "block pass", msg);
}

// One llama_decode that commits n_commit tokens causally (L_last from the last of them) and
// runs the first pass of the next block (canvas, B tokens) against the memory including them
// (the graph leaves the GDN state at the committed tokens). The canvas's KV cells must then go,
// but llama.cpp cannot cut the end off a recurrent sequence, so the memory moves to the other
// sequence (the committed KV cells and the shared recurrent cell), the old sequence is dropped
// with the canvas, and the memory comes back. The recurrent cell keeps the canvas's last
// position, which no check reads (the hybrid memory's last position is the lower of the two).
// rows: the canvas's logits (want).
int fused_commit_pass(clover_context * c, const int32_t * commit, int32_t n_commit, const int32_t * canvas, int32_t B,
                      const std::vector<char> * want, std::vector<const float *> & rows, std::string & msg) {
    const int32_t      P     = c->n_committed;
    const llama_seq_id cur   = c->mem_seq, other = 1 - c->mem_seq;
    llama_memory_t     mem   = llama_get_memory(c->lctx);
    c->batch.n_tokens = 0;
    add_to_batch(c, commit, n_commit, P, cur, nullptr, false);
    c->batch.logits[n_commit - 1] = 1;
    add_to_batch(c, canvas, B, P + n_commit, cur, want, true);
    set_canvas(c, B);
    int rc = run_decode(c, "commit + block pass", msg);
    if (rc == CLOVER_OK) {
        rc = keep_last_logits(c, n_commit - 1, "commit + block pass", msg);
    }
    if (rc != CLOVER_OK) {
        return rc;
    }
    llama_memory_seq_rm(mem, other, -1, -1);
    llama_memory_seq_cp(mem, cur, other, -1, P + n_commit);
    llama_memory_seq_rm(mem, cur, -1, -1);
    // and back, so that the next call has the same sequence id (llama.cpp reuses a graph
    // only for the same sequences)
    llama_memory_seq_cp(mem, other, cur, -1, -1);
    llama_memory_seq_rm(mem, other, -1, -1);
    c->n_committed += n_commit;
    c->mem_tokens.insert(c->mem_tokens.end(), commit, commit + n_commit);
    return read_rows(c, n_commit, B, want, rows, "commit + block pass", msg);
}

int block_pass_impl(clover_context * c, const int32_t * tokens, int32_t n, float * out, std::string & msg) {
    std::vector<const float *> rows;
    const int rc = block_pass_rows(c, tokens, n, nullptr, rows, msg);
    if (rc != CLOVER_OK) {
        return rc;
    }
    const size_t V = (size_t) c->model->n_vocab;
    for (int32_t i = 0; i < n; ++i) {
        memcpy(out + i * V, rows[i], V * sizeof(float));
    }
    return CLOVER_OK;
}

// Commits tokens[0..n) causally: one llama_decode per ubatch, each token as a block of one (the
// numbers are those of one-by-one commits). Keeps L_last; all_logits (n * n_vocab, may be NULL)
// receives the logits of every committed position. n_calls: the llama_decode calls made.
int commit_impl(clover_context * c, const int32_t * tokens, int32_t n, float * all_logits, int32_t & n_calls,
                std::string & msg) {
    const int32_t U = (int32_t) llama_n_ubatch(c->lctx);
    const size_t  V = (size_t) c->model->n_vocab;
    n_calls = 0;
    for (int32_t s = 0; s < n; s += U) {
        const int32_t m = std::min(U, n - s);
        c->batch.n_tokens = 0;
        add_to_batch(c, tokens + s, m, c->n_committed, c->mem_seq, nullptr, all_logits != nullptr);
        c->batch.logits[m - 1] = 1;
        set_canvas(c, 0);
        int rc = run_decode(c, "commit", msg);
        ++n_calls;
        if (rc == CLOVER_OK && all_logits) {
            std::vector<const float *> rows;
            rc = read_rows(c, 0, m, nullptr, rows, "commit", msg);
            for (int32_t i = 0; rc == CLOVER_OK && i < m; ++i) {
                memcpy(all_logits + (s + i) * V, rows[i], V * sizeof(float));
            }
        }
        if (rc == CLOVER_OK) {
            rc = keep_last_logits(c, m - 1, "commit", msg);
        }
        if (rc != CLOVER_OK) {
            return rc;
        }
        c->n_committed += m;
        c->mem_tokens.insert(c->mem_tokens.end(), tokens + s, tokens + s + m);
    }
    return CLOVER_OK;
}

int set_block_size_impl(clover_context * c, int32_t B, std::string & msg) {
    if (B < 1 || B > c->n_ctx) {
        msg = "block size must be in [1, n_ctx=" + std::to_string(c->n_ctx) + "], got " + std::to_string(B);
        return CLOVER_ERR_INVALID_ARG;
    }
    if (B > 1 && check_mask_token(c->model, "block size " + std::to_string(B), msg) != CLOVER_OK) {
        return CLOVER_ERR_INVALID_ARG;
    }
    if (B == c->B && c->lctx) {
        return CLOVER_OK;
    }
    if (ubatch_fits(c, B)) {
        clear_memory(c);
        c->B = B;
        return CLOVER_OK;
    }
    return make_lctx(c, B, msg);
}

// Change B keeping the committed memory: seq 0's state (GDN states, conv tails, KV) is
// saved, the llama.cpp context is rebuilt for the new n_ubatch, and the state restored.
int switch_block_size_keep(clover_context * c, int32_t B, std::string & msg) {
    if (B == c->B) {
        return CLOVER_OK;
    }
    if (ubatch_fits(c, B)) { // the same context: only the canvas's block size changes
        c->B = B;
        return CLOVER_OK;
    }
    const int32_t        nc = c->n_committed;
    std::vector<int32_t> toks = c->mem_tokens;
    std::vector<float>   last = c->last_logits;
    std::vector<uint8_t> state;
    if (nc > 0) {
        state.resize(llama_state_seq_get_size(c->lctx, c->mem_seq));
        if (llama_state_seq_get_data(c->lctx, state.data(), state.size(), c->mem_seq) != state.size()) {
            msg = "block-size switch: could not save the memory";
            return CLOVER_ERR_INTERNAL;
        }
    }
    int rc = make_lctx(c, B, msg);
    if (rc != CLOVER_OK) {
        return rc;
    }
    if (nc > 0 && llama_state_seq_set_data(c->lctx, state.data(), state.size(), 0) != state.size()) {
        msg = "block-size switch: could not restore the memory";
        return CLOVER_ERR_INTERNAL;
    }
    rc = rpc_lost(c, "block-size switch", msg);
    if (rc != CLOVER_OK) {
        return rc;
    }
    c->n_committed = nc;
    c->mem_tokens  = std::move(toks);
    c->last_logits = std::move(last);
    return CLOVER_OK;
}


} // namespace clover_impl

using namespace clover_impl;

extern "C" {

int clover_context_params_check(const clover_context_params * params, char * err, size_t err_len) {
    return check_entry(params, check_context_params, err, err_len);
}

clover_context_params clover_context_default_params(void) {
    clover_context_params p;
    p.n_ctx      = 4096;
    p.n_threads  = 4;
    p.block_size = CLOVER_BLOCK_SIZE_TRAIN;
    p.flash_attn = -1;
    p.kv_f32     = 0;
    p.calib_cache = 1;
    p.coreset    = CLOVER_CORESET_MODEL;
    p.expert_stats = 0;
    return p;
}

static int32_t default_threads(int32_t n) {
    if (n > 0) {
        return n;
    }
    const unsigned hw = std::thread::hardware_concurrency();
    return hw == 0 ? 4 : (int32_t) std::min(hw, 16u);
}

clover_context * clover_context_new(clover_model * model, const clover_context_params * params, char * err,
                                    size_t err_len) {
    clover_context * result = nullptr;
    guarded(err, err_len, [&]() -> int {
        ensure_init();
        clear_err(err, err_len);
        if (!model) {
            return set_err(err, err_len, CLOVER_ERR_INVALID_ARG, "model is NULL");
        }
        clover_context_params cp = params ? *params : clover_context_default_params();
        std::string           pmsg;
        if (cp.n_ctx == 0) { // the model's training context, as llama.cpp's n_ctx = 0
            cp.n_ctx = std::max(3, llama_model_n_ctx_train(model->lm));
        }
        if (check_context_params(cp, pmsg) != CLOVER_OK) {
            return set_err(err, err_len, CLOVER_ERR_INVALID_ARG, pmsg);
        }
        const int32_t B = cp.block_size == CLOVER_BLOCK_SIZE_TRAIN ? training_block_size(model, cp.n_ctx) : cp.block_size;
        std::string mmsg;
        if (B > 1 && check_mask_token(model, "block size " + std::to_string(B), mmsg) != CLOVER_OK) {
            return set_err(err, err_len, CLOVER_ERR_INVALID_ARG, mmsg);
        }
        auto * c       = new clover_context();
        c->model       = model;
        c->n_ctx       = cp.n_ctx;
        c->n_threads   = default_threads(cp.n_threads);
        c->flash_attn  = cp.flash_attn;
        c->kv_f32      = cp.kv_f32 != 0;
        c->planner.use_cache = cp.calib_cache != 0;
        set_coreset_rule(c, cp.coreset);
        c->expert_stats = cp.expert_stats != 0;
        std::string msg;
        int rc = c->expert_stats ? load_expert_sizes(c, msg) : CLOVER_OK;
        if (rc == CLOVER_OK) {
            rc = make_lctx(c, B, msg);
        }
        if (rc != CLOVER_OK) {
            free_lctx(c);
            delete c;
            return set_err(err, err_len, rc, msg);
        }
        result = c;
        return CLOVER_OK;
    });
    return result;
}

void clover_context_free(clover_context * ctx) {
    if (!ctx) {
        return;
    }
    free_lctx(ctx);
    delete ctx;
}

int32_t clover_block_size(const clover_context * ctx) { return ctx ? ctx->B : 0; }
int32_t clover_n_ctx(const clover_context * ctx) { return ctx ? ctx->n_ctx : 0; }
int32_t clover_n_committed(const clover_context * ctx) { return ctx ? ctx->n_committed : 0; }

int32_t clover_committed_tokens(const clover_context * ctx, int32_t * out, int32_t n_max) {
    if (!ctx) {
        return 0;
    }
    const int32_t n = std::min<int32_t>(ctx->n_committed, (int32_t) ctx->mem_tokens.size());
    if (out && n_max > 0) {
        std::copy(ctx->mem_tokens.begin(), ctx->mem_tokens.begin() + std::min(n, n_max), out);
    }
    return n;
}

int clover_set_block_size(clover_context * ctx, int32_t block_size, char * err, size_t err_len) {
    return guarded(err, err_len, [&]() -> int {
        clear_err(err, err_len);
        if (!ctx) {
            return set_err(err, err_len, CLOVER_ERR_INVALID_ARG, "context is NULL");
        }
        std::string msg;
        const int rc = set_block_size_impl(ctx, block_size, msg);
        return rc == CLOVER_OK ? rc : set_err(err, err_len, rc, msg);
    });
}

int clover_set_n_threads(clover_context * ctx, int32_t n_threads) {
    if (!ctx || !ctx->lctx) {
        return CLOVER_ERR_INVALID_ARG;
    }
    ctx->n_threads = default_threads(n_threads);
    llama_set_n_threads(ctx->lctx, ctx->n_threads, ctx->n_threads);
    return CLOVER_OK;
}

int clover_reset(clover_context * ctx) {
    if (!ctx || !ctx->lctx) {
        return CLOVER_ERR_INVALID_ARG;
    }
    clear_memory(ctx);
    return CLOVER_OK;
}

int clover_block_pass(clover_context * ctx, const int32_t * tokens, int32_t n, float * logits_out, char * err,
                      size_t err_len) {
    return guarded(err, err_len, [&]() -> int {
        clear_err(err, err_len);
        if (!ctx || !logits_out) {
            return set_err(err, err_len, CLOVER_ERR_INVALID_ARG, "context or logits_out is NULL");
        }
        std::string msg;
        int         rc = check_mask_token(ctx->model, "a block pass", msg);
        if (rc == CLOVER_OK) {
            rc = check_pass(ctx, tokens, n, ctx->B, "a block pass", msg);
        }
        if (rc == CLOVER_OK) {
            rc = block_pass_impl(ctx, tokens, n, logits_out, msg);
        }
        return rc == CLOVER_OK ? rc : set_err(err, err_len, rc, msg);
    });
}

int clover_commit_logits(clover_context * ctx, const int32_t * tokens, int32_t n, float * logits_out, char * err,
                         size_t err_len) {
    return guarded(err, err_len, [&]() -> int {
        clear_err(err, err_len);
        if (!ctx) {
            return set_err(err, err_len, CLOVER_ERR_INVALID_ARG, "context is NULL");
        }
        std::string msg;
        int         rc = check_pass(ctx, tokens, n, ctx->n_ctx, "a commit", msg);
        if (rc == CLOVER_OK) {
            int32_t n_calls = 0;
            rc = commit_impl(ctx, tokens, n, logits_out, n_calls, msg);
            if (rc != CLOVER_OK) {
                clear_memory(ctx); // a failed commit may leave the memory half written
            }
        }
        return rc == CLOVER_OK ? rc : set_err(err, err_len, rc, msg);
    });
}

int clover_commit(clover_context * ctx, const int32_t * tokens, int32_t n, char * err, size_t err_len) {
    return clover_commit_logits(ctx, tokens, n, nullptr, err, err_len);
}

int clover_expert_stats(clover_context * ctx, clover_stats * stats) {
    if (!ctx || !stats || !ctx->expert_stats) {
        return CLOVER_ERR_INVALID_ARG;
    }
    report_experts(ctx, stats);
    ctx->experts.reset();
    return CLOVER_OK;
}

int clover_last_logits(const clover_context * ctx, float * logits_out) {
    if (!ctx || !logits_out || ctx->n_committed == 0 || ctx->last_logits.empty()) {
        return CLOVER_ERR_INVALID_ARG;
    }
    std::copy(ctx->last_logits.begin(), ctx->last_logits.end(), logits_out);
    return CLOVER_OK;
}

} // extern "C"

// ---------------------------------------------------------------- state (clover_state_*)
// The bytes: a header (what must match for the memory to mean the same on load), the committed
// tokens, L_last, then llama.cpp's state of the memory sequence (llama_state_seq_get_data), with
// an FNV-1a checksum over all of it after the magic so that damaged bytes are refused before
// llama.cpp reads them.

namespace clover_impl {
namespace {

constexpr char     k_state_magic[8]   = { 'C', 'L', 'O', 'V', 'S', 'T', 'A', 'T' };
constexpr uint32_t k_state_version    = 1;

struct state_header {
    char     magic[8];
    uint32_t version;
    int32_t  n_vocab, n_embd, n_layer, kv_f32;
    uint64_t n_params, model_size; // (two files of one architecture and shape differ in these)
    int32_t  n_committed, has_logits;
    uint64_t seq_size;   // llama.cpp's bytes of the memory sequence
    uint64_t checksum;   // FNV-1a 64 of everything after this header
};

uint64_t fnv1a(const uint8_t * p, size_t n) {
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; ++i) {
        h = (h ^ p[i]) * 1099511628211ull;
    }
    return h;
}

// the header of c's memory; seq: with the size of llama.cpp's bytes of it (a dry run of the write)
state_header header_of(clover_context * c, bool seq) {
    state_header h{};
    memcpy(h.magic, k_state_magic, sizeof(h.magic));
    h.version     = k_state_version;
    h.n_vocab     = c->model->n_vocab;
    h.n_embd      = llama_model_n_embd(c->model->lm);
    h.n_layer     = llama_model_n_layer(c->model->lm);
    h.kv_f32      = c->kv_f32;
    h.n_params    = llama_model_n_params(c->model->lm);
    h.model_size  = llama_model_size(c->model->lm);
    h.n_committed = c->n_committed;
    h.has_logits  = c->last_logits.empty() ? 0 : 1;
    h.seq_size    = seq && c->n_committed > 0 ? llama_state_seq_get_size(c->lctx, c->mem_seq) : 0;
    return h;
}

size_t body_size(const state_header & h) {
    return (size_t) h.n_committed * sizeof(int32_t) + (h.has_logits ? (size_t) h.n_vocab * sizeof(float) : 0) +
           h.seq_size;
}

// why a state of header h cannot be this context's ("" = it can)
std::string state_mismatch(clover_context * c, const state_header & h, size_t size) {
    const state_header mine = header_of(c, false);
    if (h.version != k_state_version) {
        return "state format version " + std::to_string(h.version) + ", this libclover reads version " +
               std::to_string(k_state_version);
    }
    if (h.n_vocab != mine.n_vocab || h.n_embd != mine.n_embd || h.n_layer != mine.n_layer ||
        h.n_params != mine.n_params || h.model_size != mine.model_size) {
        return "the state is another model's (n_vocab " + std::to_string(h.n_vocab) + ", n_embd " +
               std::to_string(h.n_embd) + ", n_layer " + std::to_string(h.n_layer) + ", " +
               std::to_string(h.n_params) + " parameters; this model: " + std::to_string(mine.n_vocab) + ", " +
               std::to_string(mine.n_embd) + ", " + std::to_string(mine.n_layer) + ", " +
               std::to_string(mine.n_params) + ")";
    }
    if (h.kv_f32 != mine.kv_f32) {
        return std::string("the state's KV cache is ") + (h.kv_f32 ? "f32" : "f16") + ", this context's " +
               (mine.kv_f32 ? "f32" : "f16");
    }
    if (h.n_committed < 0 || h.n_committed > c->n_ctx) {
        return "the state holds " + std::to_string(h.n_committed) + " tokens, this context takes 0.." +
               std::to_string(c->n_ctx);
    }
    if (h.has_logits != (h.n_committed > 0 ? 1 : 0) || (h.n_committed > 0) != (h.seq_size > 0)) {
        return "the state's header is damaged";
    }
    if (h.seq_size > size || size - sizeof(state_header) != body_size(h)) {
        return "the state is " + std::to_string(size) + " bytes, its header says " +
               std::to_string(sizeof(state_header) + body_size(h)) + " (truncated or damaged)";
    }
    return "";
}

} // namespace

size_t state_size(clover_context * c) {
    return sizeof(state_header) + body_size(header_of(c, true));
}

int state_save(clover_context * c, uint8_t * dst, size_t size, size_t & n_written, std::string & msg) {
    state_header h    = header_of(c, true);
    const size_t need = sizeof(state_header) + body_size(h);
    if (size < need) {
        msg = "state buffer of " + std::to_string(size) + " bytes, the state takes " + std::to_string(need);
        return CLOVER_ERR_BUFFER_TOO_SMALL;
    }
    uint8_t * p = dst + sizeof(state_header);
    memcpy(p, c->mem_tokens.data(), (size_t) h.n_committed * sizeof(int32_t));
    p += (size_t) h.n_committed * sizeof(int32_t);
    if (h.has_logits) {
        memcpy(p, c->last_logits.data(), (size_t) h.n_vocab * sizeof(float));
        p += (size_t) h.n_vocab * sizeof(float);
    }
    if (h.seq_size > 0 && llama_state_seq_get_data(c->lctx, p, h.seq_size, c->mem_seq) != h.seq_size) {
        msg = "state: llama.cpp could not write the memory";
        return CLOVER_ERR_INTERNAL;
    }
    h.checksum = fnv1a(dst + sizeof(state_header), need - sizeof(state_header));
    memcpy(dst, &h, sizeof(h));
    n_written = need;
    return CLOVER_OK;
}

// Checks every part before the memory changes: a refused state leaves it as it was; one that
// llama.cpp refuses after that leaves it empty.
int state_load(clover_context * c, const uint8_t * src, size_t size, std::string & msg) {
    state_header h{};
    if (size < sizeof(h) || memcmp(src, k_state_magic, sizeof(k_state_magic)) != 0) {
        msg = "state: not a libclover state (" + std::to_string(size) + " bytes without libclover's header)";
        return CLOVER_ERR_INVALID_ARG;
    }
    memcpy(&h, src, sizeof(h));
    msg = state_mismatch(c, h, size);
    if (msg.empty() && fnv1a(src + sizeof(h), size - sizeof(h)) != h.checksum) {
        msg = "the state's bytes are damaged (checksum mismatch)";
    }
    const uint8_t * p    = src + sizeof(h);
    const int32_t * toks = nullptr;
    std::vector<int32_t> tokens;
    if (msg.empty()) {
        tokens.resize(h.n_committed);
        memcpy(tokens.data(), p, tokens.size() * sizeof(int32_t));
        p += tokens.size() * sizeof(int32_t);
        toks = tokens.data();
        if (check_tokens(c, toks, h.n_committed, msg) != CLOVER_OK) {
            msg = "the state's " + msg;
        }
    }
    if (!msg.empty()) {
        msg = "state: " + msg;
        return CLOVER_ERR_INVALID_ARG;
    }
    std::vector<float> last;
    if (h.has_logits) {
        last.resize(h.n_vocab);
        memcpy(last.data(), p, last.size() * sizeof(float));
        p += last.size() * sizeof(float);
    }
    clear_memory(c);
    if (h.seq_size == 0) {
        return CLOVER_OK;
    }
    g_last_log_error.clear();
    llama_memory_t mem = llama_get_memory(c->lctx);
    if (llama_state_seq_set_data(c->lctx, p, h.seq_size, 0) != h.seq_size ||
        llama_memory_seq_pos_max(mem, 0) != h.n_committed - 1) {
        clear_memory(c);
        const std::string le = last_log_error();
        msg = "state: llama.cpp refused the memory" + (le.empty() ? std::string() : ": " + le);
        return CLOVER_ERR_INVALID_ARG;
    }
    c->n_committed = h.n_committed;
    c->mem_tokens  = std::move(tokens);
    c->last_logits = std::move(last);
    return rpc_lost(c, "state", msg);
}

} // namespace clover_impl

extern "C" {

size_t clover_state_size(clover_context * ctx) {
    size_t n = 0;
    guarded(nullptr, 0, [&]() -> int {
        n = ctx && ctx->lctx ? state_size(ctx) : 0;
        return CLOVER_OK;
    });
    return n;
}

int clover_state_save(clover_context * ctx, uint8_t * dst, size_t size, size_t * n_written, char * err,
                      size_t err_len) {
    return guarded(err, err_len, [&]() -> int {
        clear_err(err, err_len);
        if (n_written) {
            *n_written = 0;
        }
        if (!ctx || !ctx->lctx || !dst) {
            return set_err(err, err_len, CLOVER_ERR_INVALID_ARG, "context or dst is NULL");
        }
        std::string msg;
        size_t      n  = 0;
        const int   rc = state_save(ctx, dst, size, n, msg);
        if (n_written) {
            *n_written = n;
        }
        return rc == CLOVER_OK ? rc : set_err(err, err_len, rc, msg);
    });
}

int clover_state_load(clover_context * ctx, const uint8_t * src, size_t size, char * err, size_t err_len) {
    return guarded(err, err_len, [&]() -> int {
        clear_err(err, err_len);
        if (!ctx || !ctx->lctx || !src) {
            return set_err(err, err_len, CLOVER_ERR_INVALID_ARG, "context or src is NULL");
        }
        std::string msg;
        const int   rc = state_load(ctx, src, size, msg);
        return rc == CLOVER_OK ? rc : set_err(err, err_len, rc, msg);
    });
}

} // extern "C"
