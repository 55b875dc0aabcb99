// clover-impl.h - what the parts of libclover share: the model and context objects, errors, the
// context's memory (not installed; the API is clover.h). Each unit's own header says what else it
// offers: clover-planner.h, clover-calibration-cache.h, clover-params.h, clover-sampling.h,
// clover-grammar.h, clover-logprobs.h, clover-time.h (ms_since). One namespace: clover_impl.
//
//   clover-log.cpp       llama.cpp/ggml log capture, error strings, status names
//   clover-model.cpp     GGUF pre-checks, RPC devices, model loading, tokenizer calls
//   clover-context.cpp   the llama.cpp context and the committed-memory protocol (seq 0/1/2)
//   clover-sampling.cpp  candidates and confidences, unmask selection, draft acceptance
//   clover-grammar.cpp   the grammar check and grammar-constrained decoding (gen_grammar)
//   clover-logprobs.cpp  the output's log-probabilities (gen_logprobs)
//   clover-planner.cpp   block size auto: the cost curve and the per-block pick (clover_planner)
//   clover-calibration-cache.cpp  the cost curve kept on disk, its key
//   clover-generate.cpp  the decode loop (clover_generate)
//   clover-params.cpp    generate's parameter rules: defaults, ranges, block_size values, room
//   clover-stop.cpp      stop strings (clover_stop_matcher)
//   clover-abi.cpp       clover_api_version, clover_abi_query (what bindings check at load)
//   clover-json-schema.cpp  clover_json_schema_to_grammar: llama.cpp's converter behind a keyword check
#pragma once

#include "clover.h"
#include "clover-planner.h"

#include "gguf.h"
#include "llama.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <mutex>
#include <new>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <sys/stat.h>
#include <unistd.h>

// ------------------------------------------------------------------ objects

struct clover_model {
    std::string         path; // for the calibration cache key
    llama_model *       lm    = nullptr;
    const llama_vocab * vocab = nullptr;
    int32_t n_vocab     = 0;
    int32_t mask        = -1;
    int32_t eos         = -1;
    int32_t train_block = 0;
    bool    has_block_operator = true; // false: clover.block_operator = release-bd-softmax (no block diffusion)
    std::string causal_arch;           // "qwen35moe": llama.cpp's Qwen3.5-MoE graph, no canvas: block size 1 only
    bool     on_rpc           = false; // some layers live on RPC servers
    uint64_t rpc_failures_now = 0;     // rpc_failures() when loaded: more = a server was lost
    std::string placement;             // where the weights live (placement_key): in the calibration key
};

// clover_context_params.expert_stats: the routed experts of the block passes, read from llama.cpp's
// ffn_moe_topk-<il> tensors (build_moe_ffn's selection) by the graph scheduler's eval callback
struct expert_counter {
    std::vector<double> bytes_per_expert; // per layer: one routed expert's bytes (gate + up + down); 0 = none
    int32_t n_expert = 0, n_used = 0;     // the model's experts and experts per token (k)
    // the decode about to run (set_canvas): a canvas of n_canvas >= 2 rows after n_commit committed
    // ones, n_out_commit of which give logits; coreset: the canvas routes through the coreset
    bool    in_pass = false, coreset = false;
    int32_t n_commit = 0, n_canvas = 0, n_out_commit = 0;
    // since the last reset (clover_generate)
    int64_t n_passes = 0, n_layer_counts = 0;
    double  sum_distinct = 0.0, sum_bytes = 0.0;

    void   reset() { n_passes = n_layer_counts = 0; sum_distinct = sum_bytes = 0.0; }
    void   count(const struct ggml_tensor * topk); // one MoE layer's selection, during a pass
    double bytes_b1() const;                       // a B = 1 step's: k experts per layer
};

struct clover_context {
    clover_model *  model = nullptr;
    llama_context * lctx  = nullptr;
    llama_batch     batch{};
    bool            batch_ok    = false;
    int32_t         B           = 0;
    int32_t         U           = 0; // the llama.cpp context's n_ubatch
    int32_t         n_ctx       = 0;
    int32_t         n_threads   = 0;
    int32_t         flash_attn  = -1;
    int32_t         kv_f32      = 0;
    int32_t         coreset     = 0; // the block expert coreset of canvases (0 = off; clover_set_coreset)
    bool            coreset_auto = false; // coreset auto, not decided yet: the next generation decides it
    bool            expert_stats = false; // count the block passes' experts (clover_context_params.expert_stats)
    expert_counter  experts;
    int32_t         n_committed = 0;
    int64_t         n_graphs_reused = 0; // llama_decode calls that ran the previous graph again (stats)
    std::vector<int32_t> mem_tokens;  // the committed tokens (n_committed of them): prefix reuse
    std::vector<float>   last_logits; // L_last: the logits of the last committed token (empty: none)
    llama_seq_id    mem_seq     = 0; // the sequence that holds the memory (1 is the spare, see fused_commit_pass)
    clover_impl::clover_planner planner; // block_size = auto (clover-planner.h)
};

namespace clover_impl {

// ---- logging and errors (clover-log.cpp)
extern std::atomic<int>         g_verbosity;
extern thread_local std::string g_last_log_error; // last llama.cpp/ggml error line(s) on this thread
std::string rpc_error();
void ensure_init();
std::string trim(std::string s);
std::string last_log_error();
int set_err(char * err, size_t err_len, int code, const std::string & msg);
int clear_err(char * err, size_t err_len);
ggml_backend_reg_t rpc_backend();
uint64_t rpc_failures();

// An input a generation cannot go on with, found while it runs (a grammar whose parse ran away):
// CLOVER_ERR_INVALID_ARG with this message.
struct input_error : std::runtime_error {
    using std::runtime_error::runtime_error;
};

// Runs f() and turns C++ exceptions into status codes (never lets them cross the C ABI).
template <typename F>
int guarded(char * err, size_t err_len, F && f) {
    try {
        return f();
    } catch (const input_error & e) {
        return set_err(err, err_len, CLOVER_ERR_INVALID_ARG, e.what());
    } catch (const std::bad_alloc &) {
        return set_err(err, err_len, CLOVER_ERR_INTERNAL, "out of memory");
    } catch (const std::exception & e) {
        return set_err(err, err_len, CLOVER_ERR_INTERNAL, std::string("internal error: ") + e.what());
    } catch (...) {
        return set_err(err, err_len, CLOVER_ERR_INTERNAL, "internal error: unknown exception");
    }
}

// The C entry of a params check (clover_generate_params_check, clover_context_params_check): NULL
// refused, else the check's verdict with its one-line message in err.
template <typename P>
int check_entry(const P * params, int (*check)(const P &, std::string &), char * err, size_t err_len) {
    return guarded(err, err_len, [&]() -> int {
        clear_err(err, err_len);
        if (!params) {
            return set_err(err, err_len, CLOVER_ERR_INVALID_ARG, "params is NULL");
        }
        std::string msg;
        const int   rc = check(*params, msg);
        return rc == CLOVER_OK ? rc : set_err(err, err_len, rc, msg);
    });
}

// ---- the model (clover-model.cpp)
// CLOVER_OK, or CLOVER_ERR_INVALID_ARG and the one-line refusal when a decode at block size B would
// run block diffusion (B > 1 without draft-self) on a model without a block operator
int check_block_diffusion(const clover_model * m, int32_t B, std::string & msg);
// CLOVER_OK when the model has a mask token, else the one line saying `what` needs one and how to add it
int check_mask_token(const clover_model * m, const std::string & what, std::string & msg);

// ---- the llama.cpp context and the memory (clover-context.cpp)
constexpr llama_seq_id SCRATCH_SEQ = 2;
int check_tokens(const clover_context * c, const int32_t * tokens, int32_t n, std::string & msg);
void clear_memory(clover_context * c);
int block_pass_rows(clover_context * c, const int32_t * tokens, int32_t n, const std::vector<char> * want,
                    std::vector<const float *> & rows, std::string & msg);
int fused_commit_pass(clover_context * c, const int32_t * commit, int32_t n_commit, const int32_t * canvas, int32_t B,
                      const std::vector<char> * want, std::vector<const float *> & rows, std::string & msg);
int commit_impl(clover_context * c, const int32_t * tokens, int32_t n, float * all_logits, int32_t & n_calls,
                std::string & msg);
// the pieces of one llama_decode (draft-self's verification builds its own batch)
void add_to_batch(clover_context * c, const int32_t * tokens, int32_t n, int32_t pos0, llama_seq_id seq,
                  const std::vector<char> * want, bool logits);
void set_canvas(clover_context * c, int32_t n_canvas);
int run_decode(clover_context * c, const char * what, std::string & msg);
int read_rows(clover_context * c, int32_t first, int32_t n, const std::vector<char> * want,
              std::vector<const float *> & rows, const char * what, std::string & msg);
int keep_last_logits(clover_context * c, int32_t i, const char * what, std::string & msg);
bool ubatch_fits(const clover_context * c, int32_t B); // a commit of B fused with a pass of B fits one ubatch
int set_block_size_impl(clover_context * c, int32_t B, std::string & msg);
int switch_block_size_keep(clover_context * c, int32_t B, std::string & msg);

// expert_stats: the sizes the counter needs, from the model's GGUF tensor infos (clover_context_new)
int load_expert_sizes(clover_context * c, std::string & msg);
// the counter's figures into stats (its four expert fields)
void report_experts(const clover_context * c, clover_stats * stats);

} // namespace clover_impl
