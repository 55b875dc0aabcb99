// clover-impl.h - what the parts of libclover share (not installed; the API is clover.h).
//
//   clover-log.cpp       llama.cpp/ggml log capture, error strings, status names
//   clover-model.cpp     GGUF pre-checks, RPC devices, model loading, tokenizer calls
//   clover-context.cpp   the llama.cpp context and the committed-memory protocol (seq 0/1/2)
//   clover-sampling.cpp  candidates and confidences, unmask selection, draft acceptance
//   clover-extras.cpp    grammar-constrained decoding and log-probabilities (gen_extras)
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

// ---- timing (clover-planner.cpp)
double ms_since(std::chrono::steady_clock::time_point t0);

// ---- the rules of clover_generate's parameters (clover-params.cpp)
// CLOVER_BLOCK_SIZE_TRAIN: the model's training B (32 if unknown, 1 without a mask token), at most n_ctx
int32_t training_block_size(const clover_model * m, int32_t n_ctx);
// the rules that need no context (clover_generate_params_check): CLOVER_OK or CLOVER_ERR_INVALID_ARG + msg
int check_params(const clover_generate_params & gp, std::string & msg);
// check_params's part for llama.cpp's sampler chain (min_p ... samplers)
int check_chain_params(const clover_generate_params & gp, std::string & msg);
// clover_context_params' rules that need no model (clover_context_params_check, clover_context_new)
int check_context_params(const clover_context_params & cp, std::string & msg);
// the block expert coreset: its rule (>= 0 or CLOVER_CORESET_MODEL) and CLOVER_CORESET_MODEL resolved
// from the GGUF's clover.expert_coreset (clover_context_new, clover_set_coreset)
int     check_coreset(int32_t coreset, std::string & msg);
int32_t resolve_coreset(const clover_model * m, int32_t coreset);
// the model's routed experts per layer and per token (its GGUF keys <arch>.expert_count, expert_used_count)
void model_experts(const clover_model * m, int32_t & n_expert, int32_t & n_used);
// expert_stats: the sizes the counter needs, from the model's GGUF tensor infos (clover_context_new)
int load_expert_sizes(clover_context * c, std::string & msg);
// the counter's figures into stats (its four expert fields)
void report_experts(const clover_context * c, clover_stats * stats);
// clover_stats' rates from its counts and times: tokens_per_forward, tokens_per_second (clover_generate,
// clover_stats_cut)
void set_rates(clover_stats & s);
// one call's setup from its parameters: gp normalised (sampling, draft_self = auto resolved) and
// the block size it starts with
struct gen_setup {
    int32_t B            = 1;     // the block size the call starts with (1 for auto until the planner picks)
    bool    auto_B       = false; // block_size = auto plans B per block
    bool    ar_grammar   = false; // a grammar without draft-self: decoded at B = 1
    bool    no_diffusion = false; // a model without a block operator and no draft-self
    auto_modes modes;             // what block_size = auto may choose besides B = 1
};
gen_setup resolve_generate(const clover_context * ctx, clover_generate_params & gp);
// positions a generation of max_tokens after n_prompt needs at block size B (whole blocks unless draft-self)
int64_t positions_needed(const clover_generate_params & gp, int32_t B, int32_t n_prompt, int32_t max_tokens);
// the arguments of clover_generate that need the context (B: as resolve_generate gave it)
int check_generate_args(const clover_context * ctx, const clover_generate_params & gp, int32_t B,
                        const int32_t * prompt, int32_t n_prompt, const int32_t * out, int32_t out_cap,
                        std::string & msg);

} // namespace clover_impl

// ---- sampling (clover-sampling.cpp) and a call's grammar / log-probabilities (clover-extras.cpp)
namespace clover_detail {

struct pick_work {
    std::vector<double>  p;
    std::vector<int32_t> idx;
};

// temperature / top_k / top_p as decoding uses them (a tiny temperature = greedy, top_k >= n_vocab = off)
void normalise_sampling(double & T, int32_t & top_k, double & top_p, int32_t n_vocab);
// the candidate token of one masked position and its confidence (spec/decoding.md)
void pick_candidate(const float * logits, int32_t V, int32_t mask, double T, int32_t top_k, double top_p,
                    std::mt19937_64 & rng, pick_work & w, int32_t & tok, double & conf);
// pick_candidate's token at temperature 0 without its confidence (the softmax over the vocabulary):
// for the rows whose confidence nothing reads (a verification, a step that unmasks every position)
int32_t greedy_candidate(const float * logits, int32_t V, int32_t mask);
// pick_candidate at temperature 0: the argmax and its softmax probability (a pure function of the row)
void greedy_pick(const float * logits, int32_t V, int32_t mask, int32_t & tok, double & conf);
// the softmax denominator of pick_candidate's greedy confidence (1 / this): e^(logit - bl) summed
// over the candidates, bl = the highest candidate logit (vectorized; about 2 ulp a term)
double greedy_exp_sum(const float * logits, int32_t V, int32_t mask, double bl);
// draft-self at temperature > 0: keep drafted token x (true) or draw `other` from the residual
bool accept_draft(const double * p, const float * q, int32_t V, int32_t x, std::mt19937_64 & rng, int32_t & other);
// which of n masked positions a denoising step unmasks (most confident first); returns the count
int32_t select_unmask(const double * conf, int32_t n, double threshold, int32_t max_steps, int32_t step,
                      int32_t * order_out);

// ---- llama.cpp's sampler chain (clover-sampling.cpp; spec/decoding.md, "Sampler chain")

// the samplers `samplers` may name, llama-server's names and llama-cli's letters
enum class chain_sampler { penalties, dry, top_n_sigma, top_k, typ_p, top_p, min_p, xtc, temperature };
// `samplers` (NULL / "" = llama-server's default order) -> order; false with msg on an unknown name
bool parse_samplers(const char * samplers, std::vector<chain_sampler> & order, std::string & msg);

// A call's sampler chain, built from clover_generate_params by llama.cpp's llama_sampler_init_*:
// the modifiers (logit_bias, penalties, DRY: they change logits and keep the token history) and
// the filters (the rest of the `samplers` order, and temperature; or Mirostat). choose() runs a
// row through both and picks with pick_candidate (double precision, our seeded draw) from what is
// left; Mirostat draws itself (llama.cpp's). Off (active() false): the callers use pick_candidate.
class sampler_chain {
  public:
    sampler_chain() = default;
    sampler_chain(const sampler_chain &) = delete;
    sampler_chain & operator=(const sampler_chain &) = delete;
    ~sampler_chain();
    // whether gp asks for the chain (at temperature 0: only what can change the argmax)
    static bool active(const clover_generate_params & gp);
    // Mirostat keeps a state per drawn token: the call decodes at block size 1
    static bool forces_ar(const clover_generate_params & gp);
    int  init(const clover_model * m, const clover_generate_params & gp, int32_t n_ctx, std::string & msg);
    bool on() const { return modifiers != nullptr; }
    // a committed token (the prompt's too): the penalties and DRY count it
    void accept(int32_t tok);
    // the history a block's step sees: the committed tokens then the canvas's unmasked ones (-1: masked)
    void begin_step(const std::vector<int32_t> & canvas_tok);
    // the candidate of a row and its confidence; in_step: with begin_step's history, else the committed one
    void choose(const float * row, bool in_step, const clover_generate_params & gp, std::mt19937_64 & rng,
                pick_work & w, int32_t & tok, double & conf);

  private:
    void run(llama_sampler * s, std::vector<float> & row);
    const clover_model *          model     = nullptr;
    llama_sampler *               modifiers = nullptr; // logit_bias, penalties, DRY; accepts the committed tokens
    llama_sampler *               step      = nullptr; // a clone of modifiers with the step's canvas accepted
    llama_sampler *               filters   = nullptr; // the rest of the order (temperature last by default)
    bool                          mirostat  = false;
    std::vector<llama_token_data> cur;
    std::vector<float>            proc;
};

// A GBNF grammar checked before llama.cpp's grammar engine gets it (clover-extras.cpp): true, or
// false with msg one line naming the rule ("invalid grammar: ..."): size, nesting and rule count,
// a repetition whose minimum is above its maximum, the size once repetitions are written out, left
// recursion (through rules that can match nothing too, as ("a"?)*), and ambiguity past what the
// engine can follow (it keeps one parse stack per reading of the text so far); a syntax error in
// llama.cpp's parser's words. vocab: for <token> references (NULL: none). A missing root passes
// (llama_sampler_init_grammar says so).
bool grammar_check(const char * grammar, const char * root, const llama_vocab * vocab, std::string & msg);

// Grammar (constrained decoding) and log-probabilities of one clover_generate call, for the decode
// loop (spec/decoding.md, "Grammar"; clover.h, clover_generate_params). Without a grammar and
// logprob buffers every hook is a no-op and pick() is pick_candidate().
class gen_extras {
  public:
    gen_extras() = default;
    gen_extras(const gen_extras &) = delete;
    gen_extras & operator=(const gen_extras &) = delete;
    ~gen_extras();
    // a grammar without draft-self, or Mirostat: the call decodes at block size 1
    static bool forces_ar(const clover_generate_params & gp);
    // parse the grammar, build the sampler chain (its penalties see the prompt), check the logprob
    // buffers: CLOVER_OK or CLOVER_ERR_INVALID_ARG + msg
    int init(const clover_context * ctx, const clover_generate_params & gp, const int32_t * prompt, int32_t n_prompt,
             std::string & msg);
    // the candidate of a position; next = it is the next output position (the grammar applies)
    void pick(const float * row, bool next, const clover_generate_params & gp, std::mt19937_64 & rng,
              pick_work & w, int32_t & tok, double & conf);
    // pick() for canvas position p of a block: draft-self constrains a draft position whose left
    // neighbours are all drafted, with the grammar run over them (a clone)
    void pick_at(const float * row, int32_t p, const clover_generate_params & gp, std::mt19937_64 & rng,
                 pick_work & w, int32_t & tok, double & conf);
    // a denoising step unmasked canvas position p (tok, predicted by row)
    void unmasked(int32_t p, const float * row, int32_t tok);
    // the finished block's output is canvas[0, n)
    void block_from_canvas(int32_t n);
    // draft-self: the verification's output is rebuilt token by token (the grammar accepts each)
    void verify_begin();
    void verified(const float * row, int32_t tok);
    // the block's output joins the generation's (the grammar accepts it, unless a verification did)
    void take_block();
    // the records of output tokens [from, to) into gp's logprob buffers (each block's as it is
    // committed, before the block callback: clover.h)
    void publish(const clover_generate_params & gp, int32_t from, int32_t to) const;
    // stats->grammar_mode
    void report(clover_stats * stats) const;

  private:
    bool allows(llama_sampler * g, int32_t tok) const;
    void pick_in(llama_sampler * g, const float * row, const clover_generate_params & gp, std::mt19937_64 & rng,
                 pick_work & w, int32_t & tok, double & conf);
    void accept(int32_t tok);
    // a candidate from a row: the sampler chain's when on, else pick_candidate's
    void choose(const float * row, const clover_generate_params & gp, std::mt19937_64 & rng, pick_work & w,
                int32_t & tok, double & conf);
    sampler_chain chain;
    bool          step_stale = true;  // the canvas or the committed tokens changed since chain.begin_step
    bool          verifying  = false; // draft-self: a verification chooses from the committed history
    void record(const float * row, int32_t tok, float & lp, int32_t * top_tok, float * top_lp);
    const clover_model * model = nullptr;
    llama_sampler *      smpl  = nullptr;
    llama_sampler *      draft = nullptr; // draft-self: the grammar over the drafted prefix (draft_n tokens)
    int32_t              draft_n    = 0;
    bool                 draft_dead = false;
    std::vector<int32_t> step_cand;        // draft-self: this step's candidate per canvas position
    void note_candidate(int32_t p, int32_t tok);
    bool    draft_self = false;
    bool    want_lp    = false;
    int32_t n_top      = 0;
    std::vector<llama_token_data> cur;       // the grammar's candidates
    std::vector<float>            constrained;
    std::vector<int32_t>          idx;       // top-n selection
    std::vector<int32_t> canvas_tok, block_tok; // the canvas's unmasked tokens, the block's output
    bool                 block_verified = false; // the block's tokens came from a verification (accepted there)
    std::vector<float>   canvas_lp, block_lp, gen_lp;           // per position / output token
    std::vector<int32_t> canvas_top_tok, block_top_tok, gen_top_tok; // n_top per position / token
    std::vector<float>   canvas_top_lp, block_top_lp, gen_top_lp;
};

} // namespace clover_detail
