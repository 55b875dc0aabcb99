// clover.cpp - block-diffusion decoding of Clover models on llama.cpp (see clover.h).

#include "clover.h"

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

// ------------------------------------------------------------------ logging / errors

namespace {

std::atomic<int> g_verbosity{0};
thread_local std::string g_last_log_error; // last llama.cpp/ggml error line(s) on this thread
thread_local int g_last_level = GGML_LOG_LEVEL_NONE;
std::mutex       g_rpc_error_mutex;
std::string      g_rpc_error; // the RPC backend logs a lost server from its own thread

std::string rpc_error() {
    std::lock_guard<std::mutex> lock(g_rpc_error_mutex);
    return g_rpc_error;
}

void log_callback(ggml_log_level level, const char * text, void * /*user*/) {
    int eff = level == GGML_LOG_LEVEL_CONT ? g_last_level : (int) level;
    if (level != GGML_LOG_LEVEL_CONT) {
        g_last_level = level;
    }
    if (eff == GGML_LOG_LEVEL_ERROR && text && strncmp(text, "RPC server ", 11) == 0) {
        std::lock_guard<std::mutex> lock(g_rpc_error_mutex);
        g_rpc_error = text;
        while (!g_rpc_error.empty() && isspace((unsigned char) g_rpc_error.back())) {
            g_rpc_error.pop_back();
        }
    }
    if (eff == GGML_LOG_LEVEL_ERROR && text) {
        // keep every error line since the last clear: the first one usually names the cause
        if (level != GGML_LOG_LEVEL_CONT && !g_last_log_error.empty()) {
            g_last_log_error += "; ";
        }
        g_last_log_error += text;
        if (g_last_log_error.size() > 2000) {
            g_last_log_error.erase(0, g_last_log_error.size() - 2000);
        }
    }
    const int v = g_verbosity.load();
    if (text && (v >= 2 || (v >= 1 && eff >= GGML_LOG_LEVEL_WARN))) {
        fputs(text, stderr);
        fflush(stderr);
    }
}

std::once_flag g_init_once;

void ensure_init() {
    std::call_once(g_init_once, [] {
        llama_log_set(log_callback, nullptr);
        llama_backend_init();
    });
}

std::string trim(std::string s) {
    while (!s.empty() && (s.back() == '\n' || s.back() == '\r' || s.back() == ' ')) {
        s.pop_back();
    }
    std::replace(s.begin(), s.end(), '\n', ' ');
    for (size_t at; (at = s.find(" ; ")) != std::string::npos;) {
        s.erase(at, 1);
    }
    return s;
}

// The generic llama.cpp loader GGML_ASSERTs (aborts) on some counts; check them first.
std::string check_hparams(const gguf_context * g) {
    auto get_u32 = [&](const char * key, int64_t & out) {
        const int64_t id = gguf_find_key(g, key);
        if (id < 0) {
            return false;
        }
        switch (gguf_get_kv_type(g, id)) {
            case GGUF_TYPE_UINT32: out = gguf_get_val_u32(g, id); return true;
            case GGUF_TYPE_INT32:  out = gguf_get_val_i32(g, id); return true;
            default:               return false;
        }
    };
    int64_t n_layer = 0, n_expert = 0, n_used = 0;
    if (!get_u32("clover.block_count", n_layer) || n_layer < 1 || n_layer > 512) {
        return "clover.block_count must be a u32 in [1, 512]";
    }
    if (!get_u32("clover.expert_count", n_expert) || n_expert < 1 || n_expert > 1024) {
        return "clover.expert_count must be a u32 in [1, 1024]";
    }
    if (!get_u32("clover.expert_used_count", n_used) || n_used < 1 || n_used > n_expert) {
        return "clover.expert_used_count must be a u32 in [1, clover.expert_count]";
    }
    // values llama.cpp asserts on (or loops forever on) must be refused here, with a message
    const struct { const char * key; int64_t lo, hi; } sizes[] = {
        {"clover.embedding_length", 1, 1 << 20},        {"clover.attention.head_count", 1, 4096},
        {"clover.attention.head_count_kv", 1, 4096},     {"clover.attention.key_length", 1, 65536},
        {"clover.attention.value_length", 1, 65536},     {"clover.ssm.conv_kernel", 1, 64},
        {"clover.ssm.state_size", 1, 65536},            {"clover.ssm.group_count", 1, 65536},
        {"clover.ssm.time_step_rank", 1, 65536},        {"clover.ssm.inner_size", 1, 1 << 24},
        {"clover.context_length", 1, 1 << 24},
    };
    for (const auto & sz : sizes) {
        int64_t v = 0;
        if (gguf_find_key(g, sz.key) >= 0 && (!get_u32(sz.key, v) || v < sz.lo || v > sz.hi)) {
            return std::string(sz.key) + " must be a u32 in [" + std::to_string(sz.lo) + ", " + std::to_string(sz.hi) + "]";
        }
    }
    int64_t n_head = 0, n_head_kv = 0, n_rot = 0, head_k = 0;
    if (get_u32("clover.attention.head_count", n_head) && get_u32("clover.attention.head_count_kv", n_head_kv) &&
        n_head % n_head_kv != 0) {
        return "clover.attention.head_count must be a multiple of clover.attention.head_count_kv";
    }
    if (gguf_find_key(g, "clover.rope.dimension_count") >= 0) {
        get_u32("clover.attention.key_length", head_k);
        if (!get_u32("clover.rope.dimension_count", n_rot) || n_rot < 2 || n_rot % 2 != 0 ||
            (head_k > 0 && n_rot > head_k)) {
            return "clover.rope.dimension_count must be an even u32 in [2, clover.attention.key_length]";
        }
    }
    for (const char * key : {"clover.attention.layer_norm_rms_epsilon", "clover.rope.freq_base"}) {
        const int64_t id = gguf_find_key(g, key);
        if (id < 0) {
            continue;
        }
        const bool  f32 = gguf_get_kv_type(g, id) == GGUF_TYPE_FLOAT32;
        const float v   = f32 ? gguf_get_val_f32(g, id) : 0.0f;
        const bool  eps = strstr(key, "epsilon") != nullptr;
        if (!f32 || !std::isfinite(v) || v <= 0.0f || (eps && v >= 1.0f)) {
            return std::string(key) + (eps ? " must be an f32 in (0, 1)" : " must be a finite f32 > 0");
        }
    }
    // the graph reads these as F32 (ggml's norm, ssm_conv and elementwise ops assert on others)
    for (int64_t i = 0; i < gguf_get_n_tensors(g); ++i) {
        const std::string name = gguf_get_tensor_name(g, i);
        auto ends = [&](const char * suffix) {
            const size_t n = strlen(suffix);
            return name.size() >= n && name.compare(name.size() - n, n, suffix) == 0;
        };
        const bool must_f32 = ends("norm.weight") || ends("ssm_conv1d.weight") || ends("ssm_conv1d_look.weight") ||
                              ends("ssm_dt.bias") || ends("ssm_a") || ends("ssm_block_calib");
        if (must_f32 && gguf_get_tensor_type(g, i) != GGML_TYPE_F32) {
            return "tensor '" + name + "' must be F32, not " + ggml_type_name(gguf_get_tensor_type(g, i));
        }
    }
    return "";
}

std::string last_log_error() {
    return trim(g_last_log_error);
}

int set_err(char * err, size_t err_len, int code, const std::string & msg) {
    if (err && err_len > 0) {
        snprintf(err, err_len, "%s", msg.c_str());
    }
    return code;
}

int clear_err(char * err, size_t err_len) {
    if (err && err_len > 0) {
        err[0] = '\0';
    }
    return CLOVER_OK;
}

// Runs f() and turns C++ exceptions into status codes (never lets them cross the C ABI).
template <typename F>
int guarded(char * err, size_t err_len, F && f) {
    try {
        return f();
    } catch (const std::bad_alloc &) {
        return set_err(err, err_len, CLOVER_ERR_INTERNAL, "out of memory");
    } catch (const std::exception & e) {
        return set_err(err, err_len, CLOVER_ERR_INTERNAL, std::string("internal error: ") + e.what());
    } catch (...) {
        return set_err(err, err_len, CLOVER_ERR_INTERNAL, "internal error: unknown exception");
    }
}

struct status_error {
    int         code;
    std::string msg;
};

// llama.cpp's RPC backend, when built in (GGML_RPC). The patched backend (patch 0006) counts lost
// connections instead of aborting the process; a model on RPC devices checks the count.
ggml_backend_reg_t rpc_backend() {
    return ggml_backend_reg_by_name("RPC");
}

uint64_t rpc_failures() {
    static uint64_t (*n_failures)(void) = nullptr;
    static std::once_flag once;
    std::call_once(once, [] {
        if (ggml_backend_reg_t reg = rpc_backend()) {
            n_failures = (uint64_t (*)(void)) ggml_backend_reg_get_proc_address(reg, "ggml_backend_rpc_n_failures");
        }
    });
    return n_failures ? n_failures() : 0;
}

} // namespace

// ------------------------------------------------------------------ objects

struct clover_model {
    std::string         path; // for the calibration cache key
    llama_model *       lm    = nullptr;
    const llama_vocab * vocab = nullptr;
    int32_t n_vocab     = 0;
    int32_t mask        = -1;
    int32_t eos         = -1;
    int32_t train_block = 0;
    bool     on_rpc           = false; // some layers live on RPC servers
    uint64_t rpc_failures_now = 0;     // rpc_failures() when loaded: more = a server was lost
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
    int32_t         n_committed = 0;
    std::vector<int32_t> mem_tokens; // the committed tokens (n_committed of them): prefix reuse
    int32_t              mem_B = -1; // the block size of every committed block (-1: none committed, 0: mixed)
    llama_seq_id    mem_seq     = 0; // the sequence that holds the memory (1 is the spare, see fused_commit_pass)
    // block_size = auto: the cost of a block pass per candidate B (ms; measured by
    // clover_calibrate or set by clover_set_cost_curve) and the running tokens per pass
    // (EMA over finished decode blocks; < 0 = not seen yet), per candidate and overall
    std::vector<int32_t> auto_sizes;
    std::vector<double>  auto_ms;       // a block pass of B tokens
    std::vector<double>  auto_ms_fused; // a commit of B tokens fused with the next block's first pass
    std::vector<double>  auto_tpf;
    double               auto_tpf_any = -1.0;
    int32_t              use_calib_cache = 1;
    int32_t              last_calibration = 0; // 0 none, 1 measured, 2 from the disk cache (per generate)
};

// ------------------------------------------------------------------ pure decoding pieces

namespace clover_detail {

// uniform double in [0, 1) from 53 random bits (the same on every platform)
static double uniform01(std::mt19937_64 & rng) {
    return (double) (rng() >> 11) * (1.0 / 9007199254740992.0);
}

struct pick_work {
    std::vector<double>  p;
    std::vector<int32_t> idx;
};

static void pick_candidate(const float * logits, int32_t V, int32_t mask, double T, int32_t top_k, double top_p,
                           std::mt19937_64 & rng, pick_work & w, int32_t & tok, double & conf) {
    const double NEG_INF = -std::numeric_limits<double>::infinity();
    if (T == 0.0) {
        int32_t best = -1;
        double  bl   = NEG_INF;
        for (int32_t i = 0; i < V; ++i) {
            if (i == mask) {
                continue;
            }
            const double l = logits[i];
            if (l > bl) { // strict: lowest id wins ties; NaN never wins
                bl   = l;
                best = i;
            }
        }
        if (best < 0) { // every candidate is -inf/NaN: degenerate, pick the lowest non-mask id
            tok  = mask == 0 && V > 1 ? 1 : 0;
            conf = 0.0;
            return;
        }
        double sum = 0.0;
        for (int32_t i = 0; i < V; ++i) {
            if (i == mask) {
                continue;
            }
            const double l = logits[i];
            if (l == l) {
                sum += std::exp(l - bl);
            }
        }
        tok  = best;
        conf = 1.0 / sum;
        return;
    }

    // sampling: z = logits / T
    w.p.resize(V);
    double * z = w.p.data();
    for (int32_t i = 0; i < V; ++i) {
        const double l = logits[i];
        z[i]           = (i == mask || l != l) ? NEG_INF : l / T;
    }
    auto by_z = [z](int32_t a, int32_t b) { return z[a] > z[b] || (z[a] == z[b] && a < b); };
    if (top_k > 0 && top_k < V) {
        w.idx.resize(V);
        for (int32_t i = 0; i < V; ++i) {
            w.idx[i] = i;
        }
        std::nth_element(w.idx.begin(), w.idx.begin() + top_k, w.idx.end(), by_z);
        for (int32_t j = top_k; j < V; ++j) {
            z[w.idx[j]] = NEG_INF;
        }
    }
    double zmax = NEG_INF;
    for (int32_t i = 0; i < V; ++i) {
        zmax = std::max(zmax, z[i]);
    }
    if (zmax == NEG_INF) { // degenerate
        tok  = mask == 0 && V > 1 ? 1 : 0;
        conf = 0.0;
        return;
    }
    double sum = 0.0;
    for (int32_t i = 0; i < V; ++i) {
        const double e = z[i] == NEG_INF ? 0.0 : std::exp(z[i] - zmax);
        z[i]           = e;
        sum += e;
    }
    double * p = z;
    for (int32_t i = 0; i < V; ++i) {
        p[i] /= sum;
    }
    if (top_p < 1.0) {
        // smallest prefix of the sorted distribution (p desc, id asc) with cum >= top_p
        w.idx.clear();
        for (int32_t i = 0; i < V; ++i) {
            if (p[i] > 0.0) {
                w.idx.push_back(i);
            }
        }
        const size_t npos = w.idx.size();
        auto by_p = [p](int32_t a, int32_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); };
        size_t m    = std::min<size_t>(64, npos);
        size_t keep = npos;
        while (true) {
            std::partial_sort(w.idx.begin(), w.idx.begin() + m, w.idx.end(), by_p);
            double cum   = 0.0;
            bool   found = false;
            for (size_t j = 0; j < m; ++j) {
                cum += p[w.idx[j]];
                if (cum >= top_p) {
                    keep  = j + 1;
                    found = true;
                    break;
                }
            }
            if (found || m == npos) {
                break;
            }
            m = std::min(npos, m * 4);
        }
        double kept = 0.0;
        for (size_t j = 0; j < keep; ++j) {
            kept += p[w.idx[j]];
        }
        for (size_t j = keep; j < npos; ++j) {
            p[w.idx[j]] = 0.0;
        }
        for (size_t j = 0; j < keep; ++j) {
            p[w.idx[j]] /= kept;
        }
    }
    // inverse-CDF sample in id order
    double total = 0.0;
    for (int32_t i = 0; i < V; ++i) {
        total += p[i];
    }
    const double target = uniform01(rng) * total;
    double       cdf    = 0.0;
    int32_t      pick   = -1;
    int32_t      last   = -1;
    for (int32_t i = 0; i < V; ++i) {
        if (p[i] <= 0.0) {
            continue;
        }
        last = i;
        cdf += p[i];
        if (cdf > target) {
            pick = i;
            break;
        }
    }
    if (pick < 0) {
        pick = last;
    }
    tok  = pick;
    conf = p[pick];
}

// Returns how many to unmask; order_out = ranking (conf desc, index asc).
static int32_t select_unmask(const double * conf, int32_t n, double threshold, int32_t max_steps, int32_t step,
                             int32_t * order_out) {
    std::vector<double> c(conf, conf + n);
    for (auto & x : c) {
        if (x != x) {
            x = -1.0; // NaN never ranks first
        }
    }
    for (int32_t i = 0; i < n; ++i) {
        order_out[i] = i;
    }
    std::stable_sort(order_out, order_out + n, [&c](int32_t a, int32_t b) { return c[a] > c[b]; });
    int32_t k = 0;
    for (int32_t i = 0; i < n; ++i) {
        if (c[i] >= threshold) {
            ++k;
        }
    }
    k = std::max<int32_t>(k, 1);
    if (max_steps > 0) {
        const int32_t left = max_steps - step;
        const int32_t need = left <= 0 ? n : (n + left - 1) / left;
        k                  = std::max(k, need);
    }
    return std::min(k, n);
}

} // namespace clover_detail

// ------------------------------------------------------------------ internal helpers

namespace {

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
    c->mem_B = -1;
}

// The ubatch size for block size B: whole blocks, at least two (a commit fused with the next
// pass), about 512 tokens for the prefill. Any power of two up to 256 divides 512, so
// block_size = auto switches B without a new context.
int32_t ubatch_for(int32_t B) {
    return B * std::max(2, (512 + B - 1) / B);
}

bool ubatch_fits(const clover_context * c, int32_t B) {
    return c->lctx && c->U % B == 0 && c->U >= 2 * B;
}

int make_lctx(clover_context * c, int32_t B, std::string & msg) {
    free_lctx(c);
    const int32_t U        = ubatch_for(B);
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
    // block-causal: a token sees its own block and the earlier ones; the graph reads B from it
    llama_set_causal_attn(c->lctx, true);
    llama_set_block_causal(c->lctx, B);
    c->batch    = llama_batch_init(U, 0, 1);
    c->batch_ok = true;
    c->B        = B;
    c->U        = U;
    c->n_committed = 0;
    c->mem_tokens.clear();
    c->mem_B = -1;
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

int check_pass(const clover_context * c, const int32_t * tokens, int32_t n, std::string & msg) {
    if (!c->lctx) {
        msg = "context has no llama.cpp context (a previous block-size change failed)";
        return CLOVER_ERR_INVALID_ARG;
    }
    if (!tokens || n < 1 || n > c->B) {
        msg = "a block pass or commit takes 1.." + std::to_string(c->B) + " tokens (block size), got " +
              std::to_string(n);
        return CLOVER_ERR_INVALID_ARG;
    }
    if (c->n_committed % c->B != 0) {
        msg = "n_committed=" + std::to_string(c->n_committed) + " is not a multiple of the block size " +
              std::to_string(c->B) + " (a partial block was committed)";
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

void fill_batch(clover_context * c, const int32_t * tokens, int32_t n, bool logits) {
    c->batch.n_tokens = 0;
    add_to_batch(c, tokens, n, c->n_committed, c->mem_seq, nullptr, logits);
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
    const int rc = llama_decode(c->lctx, c->batch);
    const int lost = rpc_lost(c, what, msg);
    if (lost != CLOVER_OK) {
        return lost;
    }
    return rc == 0 ? CLOVER_OK : decode_status(rc, what, msg);
}

constexpr llama_seq_id SCRATCH_SEQ = 2;

// after a commit: the block size all committed blocks share (-1 while empty, 0 when mixed)
void note_blocks(clover_context * c) {
    c->mem_B = c->mem_B == -1 || c->mem_B == c->B ? c->B : 0;
}

void clear_memory(clover_context * c) {
    llama_memory_clear(llama_get_memory(c->lctx), true);
    c->n_committed = 0;
    c->mem_tokens.clear();
    c->mem_B = -1;
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
    const int rc = run_decode(c, "block pass", msg);
    llama_memory_seq_rm(mem, SCRATCH_SEQ, -1, -1);
    if (rc != CLOVER_OK) {
        return rc;
    }
    return read_rows(c, 0, n, want, rows, "block pass", msg);
}

// One llama_decode that commits the B final tokens of the current block and runs the first
// pass of the next block (canvas, B tokens) against the memory including them (the graph
// leaves the GDN state at the committed block). The canvas's KV cells must then go, but
// llama.cpp cannot cut the end off a recurrent sequence, so the memory moves to the other
// sequence (the committed KV cells and the shared recurrent cell), the old sequence is dropped
// with the canvas, and the memory comes back. The recurrent cell keeps the canvas's last
// position, which no check reads (the hybrid memory's last position is the lower of the two).
// rows: the canvas's logits (want).
int fused_commit_pass(clover_context * c, const int32_t * final_tokens, const int32_t * canvas, int32_t B,
                      const std::vector<char> * want, std::vector<const float *> & rows, std::string & msg) {
    const int32_t      P     = c->n_committed;
    const llama_seq_id cur   = c->mem_seq, other = 1 - c->mem_seq;
    llama_memory_t     mem   = llama_get_memory(c->lctx);
    c->batch.n_tokens = 0;
    add_to_batch(c, final_tokens, B, P, cur, nullptr, false);
    add_to_batch(c, canvas, B, P + B, cur, want, true);
    const int rc = run_decode(c, "commit + block pass", msg);
    if (rc != CLOVER_OK) {
        return rc;
    }
    llama_memory_seq_rm(mem, other, -1, -1);
    llama_memory_seq_cp(mem, cur, other, -1, P + B);
    llama_memory_seq_rm(mem, cur, -1, -1);
    // and back, so that the next call has the same sequence id (llama.cpp reuses a graph
    // only for the same sequences)
    llama_memory_seq_cp(mem, other, cur, -1, -1);
    llama_memory_seq_rm(mem, other, -1, -1);
    c->n_committed += B;
    c->mem_tokens.insert(c->mem_tokens.end(), final_tokens, final_tokens + B);
    note_blocks(c);
    return read_rows(c, B, B, want, rows, "commit + block pass", msg);
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

int commit_impl(clover_context * c, const int32_t * tokens, int32_t n, std::string & msg) {
    fill_batch(c, tokens, n, false);
    const int rc = run_decode(c, "commit", msg);
    if (rc != CLOVER_OK) {
        return rc;
    }
    c->n_committed += n;
    c->mem_tokens.insert(c->mem_tokens.end(), tokens, tokens + n);
    note_blocks(c);
    return CLOVER_OK;
}

// Commits the complete blocks of tokens[0..n): one llama_decode per ubatch of whole blocks
// (block-causal attention across them; the numbers are those of one commit per block).
int prefill_impl(clover_context * c, const int32_t * tokens, int32_t n, int32_t & n_blocks, int32_t & n_calls,
                 std::string & msg) {
    const int32_t B = c->B;
    const int32_t U = (int32_t) llama_n_ubatch(c->lctx) / B * B;
    const int32_t n_full = n / B * B;
    n_blocks = n_calls = 0;
    for (int32_t s = 0; s < n_full; s += U) {
        const int32_t m = std::min(U, n_full - s);
        const int rc = commit_impl(c, tokens + s, m, msg);
        if (rc != CLOVER_OK) {
            return rc;
        }
        n_blocks += m / B;
        ++n_calls;
    }
    return CLOVER_OK;
}

int set_block_size_impl(clover_context * c, int32_t B, std::string & msg) {
    if (B < 1 || B > c->n_ctx) {
        msg = "block size must be in [1, n_ctx=" + std::to_string(c->n_ctx) + "], got " + std::to_string(B);
        return CLOVER_ERR_INVALID_ARG;
    }
    if (B == c->B && c->lctx) {
        return CLOVER_OK;
    }
    if (ubatch_fits(c, B)) {
        clear_memory(c);
        llama_set_block_causal(c->lctx, B);
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
    if (ubatch_fits(c, B)) { // the same context: only the block size of mask and graph changes
        llama_set_block_causal(c->lctx, B);
        c->B = B;
        return CLOVER_OK;
    }
    const int32_t        nc = c->n_committed;
    std::vector<int32_t> toks = c->mem_tokens;
    const int32_t        mem_B = c->mem_B;
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
    c->mem_B       = mem_B;
    return CLOVER_OK;
}

double ms_since(std::chrono::steady_clock::time_point t0);

// candidates for block_size = auto: 1, 2, 4, ... up to max(32, training B), within n_ctx
std::vector<int32_t> auto_candidates(const clover_context * c) {
    std::vector<int32_t> out;
    const int32_t        top = std::min(std::max(32, c->model->train_block), c->n_ctx);
    for (int32_t B = 1; B <= top; B *= 2) {
        out.push_back(B);
    }
    return out;
}

// Measures the cost curve: per candidate B, the fastest of 10 denoising steps (2 sweeps)
// of an all-mask block on an almost empty memory, both as a plain block pass and as a commit
// fused with the next pass; each includes the greedy candidate of every position (a softmax
// over the vocabulary, which matters for small models). Leaves the context at the last B, empty.
int calibrate_impl(clover_context * c, std::string & msg) {
    const std::vector<int32_t> sizes = auto_candidates(c);
    std::vector<double>        ms(sizes.size(), 1e300), ms_fused(sizes.size(), 1e300);
    std::vector<const float *> rows;
    std::mt19937_64            rng(0);
    clover_detail::pick_work   work;
    int32_t                    tok  = 0;
    double                     conf = 0.0;
    // two sweeps, small to large then back, keeping the fastest step per B: a machine that
    // speeds up or slows down during the sweep then biases no end of the curve
    std::vector<size_t> order;
    for (size_t i = 0; i < sizes.size(); ++i) {
        order.push_back(i);
    }
    for (size_t i = sizes.size(); i-- > 0;) {
        order.push_back(i);
    }
    for (size_t idx : order) {
        const int32_t B  = sizes[idx];
        int           rc = set_block_size_impl(c, B, msg);
        if (rc != CLOVER_OK) {
            return rc;
        }
        const std::vector<int32_t> canvas(B, c->model->mask);
        for (int rep = 0; rep < 7; ++rep) {
            for (int fused = 0; fused < 2; ++fused) {
                clear_memory(c);
                const auto t0 = std::chrono::steady_clock::now();
                rc = fused ? fused_commit_pass(c, canvas.data(), canvas.data(), B, nullptr, rows, msg)
                           : block_pass_rows(c, canvas.data(), B, nullptr, rows, msg);
                if (rc != CLOVER_OK) {
                    return rc;
                }
                for (int32_t i = 0; i < B; ++i) {
                    clover_detail::pick_candidate(rows[i], c->model->n_vocab, c->model->mask, 0.0, 0, 1.0, rng, work,
                                                  tok, conf);
                }
                if (rep > 1) { // two warm-up steps
                    double & best = fused ? ms_fused[idx] : ms[idx];
                    best          = std::min(best, ms_since(t0));
                }
            }
        }
    }
    clear_memory(c);
    c->auto_sizes    = sizes;
    c->auto_ms       = ms;
    c->auto_ms_fused = ms_fused;
    c->auto_tpf.assign(sizes.size(), -1.0);
    return CLOVER_OK;
}

// Expected tokens per block pass at B: its own running figure; else that of the largest
// smaller B seen, doubled when that B finished its blocks in about one pass (so a confident
// model climbs one size at a time); else the running figure of any B; each capped at B; else 1.
double auto_tpf_estimate(const clover_context * c, size_t i) {
    const int32_t B = c->auto_sizes[i];
    if (B == 1) {
        return 1.0;
    }
    if (c->auto_tpf[i] > 0) {
        return c->auto_tpf[i];
    }
    for (size_t j = i; j-- > 0;) {
        const double t = c->auto_tpf[j];
        if (t > 0 && c->auto_sizes[j] > 1) {
            return std::min<double>(B, t >= 0.9 * c->auto_sizes[j] ? 2 * t : t);
        }
    }
    return c->auto_tpf_any > 0 ? std::min<double>(B, c->auto_tpf_any) : 1.0;
}

// Expected milliseconds per generated token at candidate i: a block of B tokens takes B / tpf
// passes, the first of which carries the previous block's commit.
double auto_ms_per_token(const clover_context * c, size_t i) {
    const int32_t B      = c->auto_sizes[i];
    const double  passes = std::max(1.0, B / auto_tpf_estimate(c, i));
    return (c->auto_ms_fused[i] + (passes - 1.0) * c->auto_ms[i]) / B;
}

// ---- the calibration cache: one small text file per (model file, backend, build, threads)
// under $CLOVER_CACHE_DIR, else $XDG_CACHE_HOME/clover-cpp, else ~/.cache/clover-cpp. The
// first lines repeat the key; an entry that does not match it or does not parse is measured
// again and replaced (written to a temporary file, then renamed).

std::string calib_cache_dir() {
    if (const char * d = getenv("CLOVER_CACHE_DIR"); d && *d) {
        return d;
    }
    if (const char * x = getenv("XDG_CACHE_HOME"); x && *x) {
        return std::string(x) + "/clover-cpp";
    }
    if (const char * h = getenv("HOME"); h && *h) {
        return std::string(h) + "/.cache/clover-cpp";
    }
    return "";
}

std::string calib_key(const clover_context * c) {
    struct stat st {};
    if (c->model->path.empty() || stat(c->model->path.c_str(), &st) != 0) {
        return "";
    }
    std::ostringstream k;
    k << "clover-calibration 2\n"
      << "model " << c->model->path << "\n"
      << "file " << (long long) st.st_size << " " << (long long) st.st_mtim.tv_sec << "." << st.st_mtim.tv_nsec
      << " " << (long long) st.st_ino << "\n"
      << "build " << __DATE__ << " " << __TIME__ << " " << CLOVER_API_VERSION << "\n"
      << "backend";
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        k << " " << ggml_backend_dev_name(ggml_backend_dev_get(i));
    }
    k << "\nsystem " << llama_print_system_info() << "\n"
      << "threads " << c->n_threads << " flash_attn " << c->flash_attn << " kv_f32 " << c->kv_f32
      << " n_ctx " << c->n_ctx << "\n";
    return k.str();
}

std::string calib_path(const std::string & dir, const std::string & key) {
    uint64_t h = 1469598103934665603ull; // FNV-1a
    for (unsigned char ch : key) {
        h = (h ^ ch) * 1099511628211ull;
    }
    char name[64];
    snprintf(name, sizeof(name), "/calibration-%016llx.txt", (unsigned long long) h);
    return dir + name;
}

// true = the cost curve was read from the entry; false = absent, stale or corrupt (*bad = the
// entry exists but cannot be trusted)
bool calib_load(clover_context * c, const std::string & path, const std::string & key, bool * bad) {
    *bad = false;
    std::ifstream f(path, std::ios::binary);
    if (!f) {
        return false;
    }
    std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    *bad = true;
    if (text.compare(0, key.size(), key) != 0) {
        return false;
    }
    std::istringstream in(text.substr(key.size()));
    const std::vector<int32_t> sizes = auto_candidates(c);
    std::vector<double> ms(sizes.size()), msf(sizes.size());
    for (size_t i = 0; i < sizes.size(); ++i) {
        std::string tag;
        long long   B = 0;
        if (!(in >> tag >> B >> ms[i] >> msf[i]) || tag != "cost" || B != sizes[i] || !(ms[i] > 0) ||
            !(msf[i] > 0) || std::isinf(ms[i]) || std::isinf(msf[i])) {
            return false;
        }
    }
    std::string end;
    if (!(in >> end) || end != "end") {
        return false;
    }
    *bad           = false;
    c->auto_sizes    = sizes;
    c->auto_ms       = ms;
    c->auto_ms_fused = msf;
    c->auto_tpf.assign(sizes.size(), -1.0);
    return true;
}

void calib_store(const clover_context * c, const std::string & dir, const std::string & path, const std::string & key) {
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    const std::string tmp = path + ".tmp" + std::to_string((long long) getpid());
    {
        std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
        if (!f) {
            return; // a cache we cannot write is no error
        }
        f << key;
        char line[96];
        for (size_t i = 0; i < c->auto_sizes.size(); ++i) {
            snprintf(line, sizeof(line), "cost %d %.6f %.6f\n", c->auto_sizes[i], c->auto_ms[i], c->auto_ms_fused[i]);
            f << line;
        }
        f << "end\n";
        if (!f.flush()) {
            f.close();
            std::filesystem::remove(tmp, ec);
            return;
        }
    }
    if (rename(tmp.c_str(), path.c_str()) != 0) {
        std::filesystem::remove(tmp, ec);
    }
}

// The cost curve from the disk cache, else measured (and stored).
int calibrate_cached(clover_context * c, std::string & msg) {
    const std::string dir = c->use_calib_cache ? calib_cache_dir() : "";
    const std::string key = dir.empty() ? "" : calib_key(c);
    const std::string path = key.empty() ? "" : calib_path(dir, key);
    if (!path.empty()) {
        bool bad = false;
        if (calib_load(c, path, key, &bad)) {
            c->last_calibration = 2;
            return CLOVER_OK;
        }
        if (bad) {
            fprintf(stderr, "clover: warning: the calibration cache entry %s is stale or corrupt; measuring again\n",
                    path.c_str());
        }
    }
    const int rc = calibrate_impl(c, msg);
    if (rc != CLOVER_OK) {
        return rc;
    }
    c->last_calibration = 1;
    if (!path.empty()) {
        calib_store(c, dir, path, key);
    }
    return CLOVER_OK;
}

// Index of B among the candidates, or -1.
int auto_index(const clover_context * c, int32_t B) {
    for (size_t i = 0; i < c->auto_sizes.size(); ++i) {
        if (c->auto_sizes[i] == B) {
            return (int) i;
        }
    }
    return -1;
}

// Can a block of B start at n_committed (block aligned) with `n_left` more tokens fitting
// into n_ctx?
bool auto_fits(const clover_context * c, int32_t B, int32_t n_committed, int32_t n_left) {
    return n_committed % B == 0 && (int64_t) n_committed + ((int64_t) n_left + B - 1) / B * B <= c->n_ctx;
}

// The candidate with the lowest expected ms per token among those that fit (auto_fits).
int32_t auto_pick(const clover_context * c, int32_t n_committed, int32_t n_left) {
    int32_t best = 0;
    double  best_ms = 1e300;
    for (size_t i = 0; i < c->auto_sizes.size(); ++i) {
        const int32_t B = c->auto_sizes[i];
        if (!auto_fits(c, B, n_committed, n_left)) {
            continue;
        }
        const double ms = auto_ms_per_token(c, i);
        if (ms < best_ms) {
            best_ms = ms;
            best    = B;
        }
    }
    return best;
}

// Running tokens per pass after a finished decode block of size B.
void auto_observe(clover_context * c, int32_t B, int32_t n_tokens, int32_t n_passes) {
    if (B < 2 || n_passes < 1 || n_tokens < 1) {
        return;
    }
    const double tpf = (double) n_tokens / n_passes;
    const double a   = 0.3;
    c->auto_tpf_any  = c->auto_tpf_any > 0 ? (1 - a) * c->auto_tpf_any + a * tpf : tpf;
    const int i      = auto_index(c, B);
    if (i >= 0) {
        c->auto_tpf[i] = c->auto_tpf[i] > 0 ? (1 - a) * c->auto_tpf[i] + a * tpf : tpf;
    }
}

// Expected ms per token at B (1e300 if B is not a candidate).
double auto_ms_of(const clover_context * c, int32_t B) {
    const int i = auto_index(c, B);
    return i >= 0 ? auto_ms_per_token(c, (size_t) i) : 1e300;
}

double ms_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

} // namespace

// ------------------------------------------------------------------ C API

extern "C" {

const char * clover_status_str(int status) {
    switch (status) {
        case CLOVER_OK:                   return "ok";
        case CLOVER_ERR_INVALID_ARG:      return "invalid argument";
        case CLOVER_ERR_LOAD:             return "load error";
        case CLOVER_ERR_DECODE:           return "decode error";
        case CLOVER_ERR_CANCELLED:        return "cancelled";
        case CLOVER_ERR_CONTEXT_FULL:     return "context full";
        case CLOVER_ERR_BUFFER_TOO_SMALL: return "buffer too small";
        case CLOVER_ERR_INTERNAL:         return "internal error";
        default:                          return "unknown status";
    }
}

void clover_set_verbosity(int level) {
    ensure_init();
    g_verbosity.store(level);
}

clover_model_params clover_model_default_params(void) {
    clover_model_params p;
    p.n_gpu_layers   = 0;
    p.use_mmap       = -1;
    p.use_mlock      = 0;
    p.rpc_servers    = nullptr;
    p.tensor_split   = nullptr;
    p.n_tensor_split = 0;
    return p;
}

// The devices of the comma-separated RPC endpoints, then the local GPUs (llama.cpp's own order:
// RPC servers first), NULL-terminated for llama_model_params.devices.
static int rpc_devices(const char * servers, std::vector<ggml_backend_dev_t> & devices, std::string & msg) {
    ggml_backend_reg_t reg = rpc_backend();
    auto add_server = reg ? (ggml_backend_reg_t (*)(const char *)) ggml_backend_reg_get_proc_address(reg, "ggml_backend_rpc_add_server")
                          : nullptr;
    if (!add_server) {
        msg = "this libclover was built without llama.cpp's RPC backend (GGML_RPC=OFF)";
        return CLOVER_ERR_INVALID_ARG;
    }
    std::stringstream ss(servers);
    std::string       ep;
    while (std::getline(ss, ep, ',')) {
        ep = trim(ep);
        const size_t colon = ep.rfind(':');
        char *       end   = nullptr;
        const long   port  = colon == std::string::npos ? 0 : strtol(ep.c_str() + colon + 1, &end, 10);
        if (colon == 0 || colon == std::string::npos || !end || *end || port < 1 || port > 65535) {
            msg = "RPC server '" + ep + "' is not HOST:PORT";
            return CLOVER_ERR_INVALID_ARG;
        }
        g_last_log_error.clear();
        const uint64_t     before = rpc_failures();
        ggml_backend_reg_t server = add_server(ep.c_str());
        if (!server || rpc_failures() != before) {
            const std::string le = rpc_error(); // "RPC server HOST:PORT: cannot connect"
            msg = le.empty() || rpc_failures() == before ? "RPC server " + ep + " offers no device" : le;
            return CLOVER_ERR_LOAD;
        }
        for (size_t i = 0; i < ggml_backend_reg_dev_count(server); ++i) {
            devices.push_back(ggml_backend_reg_dev_get(server, i));
        }
    }
    if (devices.empty()) {
        msg = "no RPC server given";
        return CLOVER_ERR_INVALID_ARG;
    }
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        ggml_backend_dev_t dev = ggml_backend_dev_get(i);
        const auto         t   = ggml_backend_dev_type(dev);
        if ((t == GGML_BACKEND_DEVICE_TYPE_GPU || t == GGML_BACKEND_DEVICE_TYPE_IGPU) &&
            ggml_backend_dev_backend_reg(dev) != reg) {
            devices.push_back(dev);
        }
    }
    devices.push_back(nullptr);
    return CLOVER_OK;
}

clover_model * clover_model_load(const char * path, const clover_model_params * params, char * err, size_t err_len) {
    clover_model * result = nullptr;
    guarded(err, err_len, [&]() -> int {
        ensure_init();
        clear_err(err, err_len);
        if (!path) {
            return set_err(err, err_len, CLOVER_ERR_INVALID_ARG, "model path is NULL");
        }
        const clover_model_params mp = params ? *params : clover_model_default_params();
        {
            // a FIFO or a device would block or stream forever: only regular files are models
            struct stat st;
            if (stat(path, &st) == 0 && !S_ISREG(st.st_mode)) {
                return set_err(err, err_len, CLOVER_ERR_LOAD,
                               std::string("'") + path + "' is not a regular file");
            }
        }
        {
            FILE * f = fopen(path, "rb");
            if (!f) {
                return set_err(err, err_len, CLOVER_ERR_LOAD,
                               std::string("cannot open model file '") + path + "': " + strerror(errno));
            }
            char magic[4] = {0, 0, 0, 0};
            const size_t got = fread(magic, 1, 4, f);
            fclose(f);
            if (got != 4 || memcmp(magic, "GGUF", 4) != 0) {
                return set_err(err, err_len, CLOVER_ERR_LOAD,
                               std::string("'") + path + "' is not a GGUF file (bad magic)");
            }
        }
        {
            gguf_init_params gp;
            gp.no_alloc = true;
            gp.ctx      = nullptr;
            g_last_log_error.clear();
            gguf_context * g = gguf_init_from_file(path, gp);
            if (!g) {
                std::string m = std::string("'") + path + "' is not a valid GGUF file";
                const std::string le = last_log_error();
                if (!le.empty()) {
                    m += ": " + le;
                }
                return set_err(err, err_len, CLOVER_ERR_LOAD, m);
            }
            const int64_t k = gguf_find_key(g, "general.architecture");
            std::string   arch;
            if (k >= 0 && gguf_get_kv_type(g, k) == GGUF_TYPE_STRING) {
                arch = gguf_get_val_str(g, k);
            }
            const std::string bad = arch == "clover" ? check_hparams(g) : "";
            gguf_free(g);
            if (k < 0) {
                return set_err(err, err_len, CLOVER_ERR_LOAD,
                               std::string("'") + path + "' has no general.architecture key");
            }
            if (arch != "clover") {
                return set_err(err, err_len, CLOVER_ERR_LOAD,
                               std::string("'") + path + "' is a '" + arch +
                                   "' model, not a 'clover' model (general.architecture)");
            }
            if (!bad.empty()) {
                return set_err(err, err_len, CLOVER_ERR_LOAD, std::string("'") + path + "': " + bad);
            }
        }
        llama_model_params lp = llama_model_default_params();
        lp.n_gpu_layers       = mp.n_gpu_layers;
        std::vector<ggml_backend_dev_t> devices;
        std::vector<float>              split;
        if (mp.rpc_servers && *mp.rpc_servers) {
            std::string bad;
            const int rc = rpc_devices(mp.rpc_servers, devices, bad);
            if (rc != CLOVER_OK) {
                return set_err(err, err_len, rc, bad);
            }
            lp.devices = devices.data();
        }
        if (mp.n_tensor_split < 0 || mp.n_tensor_split > (int32_t) llama_max_devices() ||
            (mp.n_tensor_split > 0 && !mp.tensor_split)) {
            return set_err(err, err_len, CLOVER_ERR_INVALID_ARG,
                           "tensor_split: 0.." + std::to_string(llama_max_devices()) + " values expected");
        }
        if (mp.n_tensor_split > 0) {
            split.assign(llama_max_devices(), 0.0f);
            for (int32_t i = 0; i < mp.n_tensor_split; ++i) {
                if (!std::isfinite(mp.tensor_split[i]) || mp.tensor_split[i] < 0) {
                    return set_err(err, err_len, CLOVER_ERR_INVALID_ARG, "tensor_split values must be finite and >= 0");
                }
                split[i] = mp.tensor_split[i];
            }
            lp.tensor_split = split.data();
        }
        const uint64_t rpc_failures_before = rpc_failures();
        if (mp.use_mmap < 0 && !mp.use_mlock) {
            lp.load_mode = LLAMA_LOAD_MODE_AUTO;
        } else if (mp.use_mmap != 0) {
            lp.load_mode = mp.use_mlock ? LLAMA_LOAD_MODE_MMAP_MLOCK : LLAMA_LOAD_MODE_MMAP;
        } else {
            lp.load_mode = mp.use_mlock ? LLAMA_LOAD_MODE_MLOCK : LLAMA_LOAD_MODE_NONE;
        }
        g_last_log_error.clear();
        llama_model * lm = llama_model_load_from_file(path, lp);
        if (!lm) {
            std::string m = std::string("llama.cpp failed to load '") + path + "'";
            const std::string le = last_log_error();
            if (!le.empty()) {
                m += ": " + le;
            }
            return set_err(err, err_len, CLOVER_ERR_LOAD, m);
        }
        auto * cm        = new clover_model();
        cm->lm           = lm;
        cm->on_rpc           = !devices.empty();
        cm->rpc_failures_now = rpc_failures();
        if (cm->on_rpc && cm->rpc_failures_now != rpc_failures_before) {
            clover_model_free(cm);
            return set_err(err, err_len, CLOVER_ERR_LOAD, "while loading: " + rpc_error());
        }
        {
            std::error_code ec;
            const auto abs = std::filesystem::canonical(path, ec);
            cm->path       = ec ? std::string(path) : abs.string();
        }
        cm->vocab        = llama_model_get_vocab(lm);
        cm->n_vocab      = llama_vocab_n_tokens(cm->vocab);
        char buf[64];
        if (llama_model_meta_val_str(lm, "tokenizer.ggml.mask_token_id", buf, sizeof(buf)) > 0) {
            cm->mask = (int32_t) strtol(buf, nullptr, 10);
        } else {
            cm->mask = llama_vocab_mask(cm->vocab);
        }
        if (cm->mask >= cm->n_vocab) {
            cm->mask = -1;
        }
        cm->eos = llama_vocab_eos(cm->vocab);
        if (llama_model_meta_val_str(lm, "clover.diffusion.block_size", buf, sizeof(buf)) > 0) {
            cm->train_block = (int32_t) strtol(buf, nullptr, 10);
        }
        result = cm;
        return CLOVER_OK;
    });
    return result;
}

void clover_model_free(clover_model * model) {
    if (!model) {
        return;
    }
    if (model->lm) {
        llama_model_free(model->lm);
    }
    delete model;
}

int32_t clover_n_vocab(const clover_model * m) { return m ? m->n_vocab : 0; }
int32_t clover_mask_token(const clover_model * m) { return m ? m->mask : -1; }
int32_t clover_eos_token(const clover_model * m) { return m ? m->eos : -1; }
int32_t clover_train_block_size(const clover_model * m) { return m ? m->train_block : 0; }
int32_t clover_n_ctx_train(const clover_model * m) { return m ? llama_model_n_ctx_train(m->lm) : 0; }

int32_t clover_model_meta(const clover_model * m, const char * key, char * buf, size_t buf_size) {
    if (!m || !key) {
        return -1;
    }
    return llama_model_meta_val_str(m->lm, key, buf, buf_size);
}

int clover_tokenize(const clover_model * m, const char * text, int32_t text_len, int32_t * tokens, int32_t n_max,
                    int add_special, int parse_special, int32_t * n_out) {
    return guarded(nullptr, 0, [&]() -> int {
        if (!m || !text || n_max < 0 || (n_max > 0 && !tokens)) {
            return CLOVER_ERR_INVALID_ARG;
        }
        const int32_t len = text_len < 0 ? (int32_t) strlen(text) : text_len;
        const int32_t r   = llama_tokenize(m->vocab, text, len, tokens, n_max, add_special != 0, parse_special != 0);
        if (r == std::numeric_limits<int32_t>::min()) {
            return CLOVER_ERR_INVALID_ARG;
        }
        if (r < 0) {
            if (n_out) {
                *n_out = -r;
            }
            return CLOVER_ERR_BUFFER_TOO_SMALL;
        }
        if (n_out) {
            *n_out = r;
        }
        return CLOVER_OK;
    });
}

int clover_token_to_piece(const clover_model * m, int32_t token, char * buf, int32_t buf_size, int special,
                          int32_t * n_out) {
    return guarded(nullptr, 0, [&]() -> int {
        if (!m || token < 0 || token >= m->n_vocab || buf_size < 0 || (buf_size > 0 && !buf)) {
            return CLOVER_ERR_INVALID_ARG;
        }
        const int32_t r = llama_token_to_piece(m->vocab, token, buf, buf_size, 0, special != 0);
        if (r < 0) {
            if (n_out) {
                *n_out = -r;
            }
            return CLOVER_ERR_BUFFER_TOO_SMALL;
        }
        if (n_out) {
            *n_out = r;
        }
        return CLOVER_OK;
    });
}

int clover_detokenize(const clover_model * m, const int32_t * tokens, int32_t n_tokens, char * buf, int32_t buf_size,
                      int remove_special, int unparse_special, int32_t * n_out) {
    return guarded(nullptr, 0, [&]() -> int {
        if (!m || n_tokens < 0 || (n_tokens > 0 && !tokens) || buf_size < 0 || (buf_size > 0 && !buf)) {
            return CLOVER_ERR_INVALID_ARG;
        }
        for (int32_t i = 0; i < n_tokens; ++i) {
            if (tokens[i] < 0 || tokens[i] >= m->n_vocab) {
                return CLOVER_ERR_INVALID_ARG;
            }
        }
        const int32_t r =
            llama_detokenize(m->vocab, tokens, n_tokens, buf, buf_size, remove_special != 0, unparse_special != 0);
        if (r < 0 || r >= buf_size) { // no room for the terminator either
            if (n_out) {
                *n_out = r < 0 ? -r : r;
            }
            return CLOVER_ERR_BUFFER_TOO_SMALL;
        }
        buf[r] = '\0';
        if (n_out) {
            *n_out = r;
        }
        return CLOVER_OK;
    });
}

clover_context_params clover_context_default_params(void) {
    clover_context_params p;
    p.n_ctx      = 4096;
    p.n_threads  = 4;
    p.block_size = 0;
    p.flash_attn = -1;
    p.kv_f32     = 0;
    p.calib_cache = 1;
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
        const clover_context_params cp = params ? *params : clover_context_default_params();
        if (cp.n_ctx < 1) {
            return set_err(err, err_len, CLOVER_ERR_INVALID_ARG, "n_ctx must be >= 1, got " + std::to_string(cp.n_ctx));
        }
        int32_t B = cp.block_size;
        if (B == 0) {
            B = model->train_block > 0 ? model->train_block : 32;
            B = std::min(B, cp.n_ctx);
        }
        if (B < 1 || B > cp.n_ctx) {
            return set_err(err, err_len, CLOVER_ERR_INVALID_ARG,
                           "block size must be in [1, n_ctx=" + std::to_string(cp.n_ctx) + "], got " +
                               std::to_string(cp.block_size));
        }
        if (cp.flash_attn < -1 || cp.flash_attn > 1) {
            return set_err(err, err_len, CLOVER_ERR_INVALID_ARG, "flash_attn must be -1, 0 or 1");
        }
        if (model->mask < 0) {
            return set_err(err, err_len, CLOVER_ERR_LOAD, "the model has no mask token (tokenizer.ggml.mask_token_id)");
        }
        auto * c       = new clover_context();
        c->model       = model;
        c->n_ctx       = cp.n_ctx;
        c->n_threads   = default_threads(cp.n_threads);
        c->flash_attn  = cp.flash_attn;
        c->kv_f32      = cp.kv_f32 != 0;
        c->use_calib_cache = cp.calib_cache != 0;
        std::string msg;
        const int rc = make_lctx(c, B, msg);
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

int clover_calibrate(clover_context * ctx, int32_t * sizes_out, double * ms_out, double * ms_fused_out, int32_t cap,
                     int32_t * n_out, char * err, size_t err_len) {
    return guarded(err, err_len, [&]() -> int {
        clear_err(err, err_len);
        if (!ctx || !ctx->lctx || cap < 0) {
            return set_err(err, err_len, CLOVER_ERR_INVALID_ARG, "bad arguments to clover_calibrate");
        }
        std::string msg;
        const int   rc = calibrate_impl(ctx, msg);
        if (rc != CLOVER_OK) {
            return set_err(err, err_len, rc, "block-size calibration: " + msg);
        }
        const int32_t n = (int32_t) ctx->auto_sizes.size();
        for (int32_t i = 0; i < std::min(n, cap); ++i) {
            if (sizes_out) {
                sizes_out[i] = ctx->auto_sizes[i];
            }
            if (ms_out) {
                ms_out[i] = ctx->auto_ms[i];
            }
            if (ms_fused_out) {
                ms_fused_out[i] = ctx->auto_ms_fused[i];
            }
        }
        if (n_out) {
            *n_out = n;
        }
        return CLOVER_OK;
    });
}

int clover_set_cost_curve(clover_context * ctx, const int32_t * sizes, const double * ms, const double * ms_fused,
                          int32_t n, char * err, size_t err_len) {
    return guarded(err, err_len, [&]() -> int {
        clear_err(err, err_len);
        if (!ctx || !sizes || !ms || n < 1) {
            return set_err(err, err_len, CLOVER_ERR_INVALID_ARG, "bad arguments to clover_set_cost_curve");
        }
        for (int32_t i = 0; i < n; ++i) {
            const double f = ms_fused ? ms_fused[i] : 1.0;
            if (sizes[i] != (i == 0 ? 1 : 2 * sizes[i - 1]) || sizes[i] > ctx->n_ctx || !(ms[i] > 0.0) ||
                std::isinf(ms[i]) || !(f > 0.0) || std::isinf(f)) {
                return set_err(err, err_len, CLOVER_ERR_INVALID_ARG,
                               "cost curve: sizes must be 1, 2, 4, ... (<= n_ctx) and costs finite and > 0");
            }
        }
        ctx->auto_sizes.assign(sizes, sizes + n);
        ctx->auto_ms.assign(ms, ms + n);
        // without fused costs: a fused step of B tokens is about a pass of 2B
        ctx->auto_ms_fused.resize(n);
        for (int32_t i = 0; i < n; ++i) {
            ctx->auto_ms_fused[i] = ms_fused ? ms_fused[i] : i + 1 < n ? ms[i + 1] : 2.0 * ms[i];
        }
        ctx->auto_tpf.assign(n, -1.0);
        ctx->auto_tpf_any = -1.0;
        return CLOVER_OK;
    });
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
        int         rc = check_pass(ctx, tokens, n, msg);
        if (rc == CLOVER_OK) {
            rc = block_pass_impl(ctx, tokens, n, logits_out, msg);
        }
        return rc == CLOVER_OK ? rc : set_err(err, err_len, rc, msg);
    });
}

int clover_commit(clover_context * ctx, const int32_t * tokens, int32_t n, char * err, size_t err_len) {
    return guarded(err, err_len, [&]() -> int {
        clear_err(err, err_len);
        if (!ctx) {
            return set_err(err, err_len, CLOVER_ERR_INVALID_ARG, "context is NULL");
        }
        std::string msg;
        int         rc = check_pass(ctx, tokens, n, msg);
        if (rc == CLOVER_OK) {
            rc = commit_impl(ctx, tokens, n, msg);
        }
        return rc == CLOVER_OK ? rc : set_err(err, err_len, rc, msg);
    });
}

int clover_prefill(clover_context * ctx, const int32_t * tokens, int32_t n, int32_t * n_rest, char * err,
                   size_t err_len) {
    return guarded(err, err_len, [&]() -> int {
        clear_err(err, err_len);
        if (!ctx || !ctx->lctx || n < 0 || (n > 0 && !tokens)) {
            return set_err(err, err_len, CLOVER_ERR_INVALID_ARG, "bad arguments to clover_prefill");
        }
        std::string msg;
        if (ctx->n_committed % ctx->B != 0) {
            return set_err(err, err_len, CLOVER_ERR_INVALID_ARG, "n_committed is not block aligned");
        }
        const int32_t n_full = n / ctx->B * ctx->B;
        if ((int64_t) ctx->n_committed + n_full > ctx->n_ctx) {
            return set_err(err, err_len, CLOVER_ERR_CONTEXT_FULL,
                           "context full: " + std::to_string(ctx->n_committed) + " committed + " +
                               std::to_string(n_full) + " > n_ctx=" + std::to_string(ctx->n_ctx));
        }
        int rc = check_tokens(ctx, tokens, n, msg);
        int32_t nb = 0;
        if (rc == CLOVER_OK) {
            int32_t n_calls = 0;
            rc = prefill_impl(ctx, tokens, n_full, nb, n_calls, msg);
        }
        if (n_rest) {
            *n_rest = n - n_full;
        }
        return rc == CLOVER_OK ? rc : set_err(err, err_len, rc, msg);
    });
}

clover_generate_params clover_generate_default_params(void) {
    clover_generate_params p;
    p.block_size     = 0;
    p.threshold      = 0.9;
    p.max_steps      = 0;
    p.temperature    = 0.0;
    p.top_k          = 0;
    p.top_p          = 1.0;
    p.seed           = 0;
    p.max_tokens     = 128;
    p.stop_at_eos    = 1;
    p.step_callback  = nullptr;
    p.block_callback = nullptr;
    p.user_data      = nullptr;
    p.reuse_prefix   = 1;
    return p;
}

int clover_pick_candidate(const float * logits, int32_t n_vocab, int32_t mask_token, double temperature,
                          int32_t top_k, double top_p, uint64_t seed, int32_t * token_out, double * confidence_out) {
    return guarded(nullptr, 0, [&]() -> int {
        if (!logits || n_vocab < 1 || !token_out || !confidence_out || !(temperature >= 0.0) || top_k < 0 ||
            !(top_p > 0.0 && top_p <= 1.0)) {
            return CLOVER_ERR_INVALID_ARG;
        }
        std::mt19937_64          rng(seed);
        clover_detail::pick_work w;
        clover_detail::pick_candidate(logits, n_vocab, mask_token, temperature, top_k, top_p, rng, w, *token_out,
                                      *confidence_out);
        return CLOVER_OK;
    });
}

int32_t clover_select_unmask(const double * conf, int32_t n_masked, double threshold, int32_t max_steps, int32_t step,
                             int32_t * order_out) {
    return guarded(nullptr, 0, [&]() -> int {
        if (!conf || !order_out || n_masked < 1 || max_steps < 0 || step < 0 || !(threshold >= 0.0 && threshold <= 1.0)) {
            return CLOVER_ERR_INVALID_ARG;
        }
        return clover_detail::select_unmask(conf, n_masked, threshold, max_steps, step, order_out);
    });
}

int clover_generate(clover_context * ctx, const int32_t * prompt, int32_t n_prompt,
                    const clover_generate_params * params, int32_t * out, int32_t out_cap, int32_t * n_out,
                    clover_stats * stats, char * err, size_t err_len) {
    if (n_out) {
        *n_out = 0;
    }
    if (stats) {
        memset(stats, 0, sizeof(*stats));
        stats->n_prompt = n_prompt;
    }
    return guarded(err, err_len, [&]() -> int {
        clear_err(err, err_len);
        if (!ctx || !ctx->model) {
            return set_err(err, err_len, CLOVER_ERR_INVALID_ARG, "context is NULL");
        }
        const clover_generate_params gp = params ? *params : clover_generate_default_params();
        const clover_model *         m  = ctx->model;
        // ---- validation (nothing is touched before it passes)
        const bool auto_B = gp.block_size == CLOVER_BLOCK_SIZE_AUTO;
        int32_t    B      = gp.block_size == 0 ? ctx->B : auto_B ? 1 : gp.block_size;
        if (B < 1 || B > ctx->n_ctx) {
            return set_err(err, err_len, CLOVER_ERR_INVALID_ARG,
                           "block size must be in [1, n_ctx=" + std::to_string(ctx->n_ctx) + "], got " +
                               std::to_string(gp.block_size));
        }
        if (!(gp.threshold >= 0.0 && gp.threshold <= 1.0)) {
            return set_err(err, err_len, CLOVER_ERR_INVALID_ARG,
                           "threshold must be in [0, 1], got " + std::to_string(gp.threshold));
        }
        if (!(gp.temperature >= 0.0) || std::isinf(gp.temperature)) {
            return set_err(err, err_len, CLOVER_ERR_INVALID_ARG,
                           "temperature must be finite and >= 0, got " + std::to_string(gp.temperature));
        }
        if (!(gp.top_p > 0.0 && gp.top_p <= 1.0)) {
            return set_err(err, err_len, CLOVER_ERR_INVALID_ARG, "top_p must be in (0, 1], got " + std::to_string(gp.top_p));
        }
        if (gp.top_k < 0) {
            return set_err(err, err_len, CLOVER_ERR_INVALID_ARG, "top_k must be >= 0");
        }
        if (gp.max_steps < 0) {
            return set_err(err, err_len, CLOVER_ERR_INVALID_ARG, "max_steps must be >= 0");
        }
        if (n_prompt < 0 || (n_prompt > 0 && !prompt)) {
            return set_err(err, err_len, CLOVER_ERR_INVALID_ARG, "bad prompt (NULL or negative length)");
        }
        if (m->mask < 0) {
            return set_err(err, err_len, CLOVER_ERR_INVALID_ARG, "the model has no mask token");
        }
        std::string msg;
        if (check_tokens(ctx, prompt, n_prompt, msg) != CLOVER_OK) {
            return set_err(err, err_len, CLOVER_ERR_INVALID_ARG, "prompt: " + msg);
        }
        if (gp.max_tokens <= 0) {
            return CLOVER_OK;
        }
        if (!out || out_cap < gp.max_tokens) {
            return set_err(err, err_len, CLOVER_ERR_INVALID_ARG,
                           "output buffer too small: out_cap=" + std::to_string(out_cap) + " < max_tokens=" +
                               std::to_string(gp.max_tokens));
        }
        {
            const int64_t need = ((int64_t) n_prompt + gp.max_tokens + B - 1) / B * B;
            if (need > ctx->n_ctx) {
                return set_err(err, err_len, CLOVER_ERR_CONTEXT_FULL,
                               "prompt (" + std::to_string(n_prompt) + " tokens) + max_tokens (" +
                                   std::to_string(gp.max_tokens) + "), rounded up to blocks of " + std::to_string(B) +
                                   ", needs " + std::to_string(need) + " positions > n_ctx=" +
                                   std::to_string(ctx->n_ctx));
            }
        }
        // ---- setup
        int rc = CLOVER_OK;
        ctx->last_calibration = 0;
        // prefix reuse: when the prompt starts with the committed tokens, they stay committed
        // (block aligned for this call's B) and only the prompt's new blocks are prefilled
        const int32_t nc     = ctx->n_committed;
        const bool    prefix = gp.reuse_prefix && ctx->lctx && nc > 0 && nc <= n_prompt &&
                            (int32_t) ctx->mem_tokens.size() == nc &&
                            std::equal(ctx->mem_tokens.begin(), ctx->mem_tokens.end(), prompt);
        if (auto_B) {
            if (ctx->auto_sizes.empty()) {
                rc = calibrate_cached(ctx, msg);
                if (rc != CLOVER_OK) {
                    return set_err(err, err_len, rc, "block-size calibration: " + msg);
                }
            }
            const int32_t keep = prefix ? auto_pick(ctx, nc, n_prompt - nc + gp.max_tokens) : 0;
            B = keep > 0 ? keep : auto_pick(ctx, 0, n_prompt + gp.max_tokens);
        }
        // a fixed B reuses only blocks of that B (then the result is that of a cleared memory);
        // auto, whose blocks depend on its history anyway, reuses any block-aligned memory
        const int32_t reuse =
            prefix && nc % B == 0 && nc <= n_prompt / B * B && (auto_B || ctx->mem_B == B) ? nc : 0;
        if (reuse > 0) {
            rc = switch_block_size_keep(ctx, B, msg);
        } else {
            rc = set_block_size_impl(ctx, B, msg);
            if (rc == CLOVER_OK) {
                clear_memory(ctx);
            }
        }
        if (rc != CLOVER_OK) {
            return set_err(err, err_len, rc, msg);
        }
        if (stats) {
            stats->n_reused = reuse;
        }

        const int32_t  V    = m->n_vocab;
        const int32_t  mask = m->mask;
        const int32_t  eos  = gp.stop_at_eos ? m->eos : -1;
        std::mt19937_64 rng(gp.seed);
        clover_detail::pick_work work;

        int32_t n_commits = 0, n_calls = 0, n_steps = 0, n_blocks = 0, n_switches = 0, finish = CLOVER_FINISH_MAX_TOKENS;
        std::vector<int32_t> gen;      // generated tokens (uncut)
        int32_t              visible = 0; // gen prefix reported so far (cut at EOS / max_tokens)
        double               t_prefill = 0.0;
        const auto           t_start   = std::chrono::steady_clock::now();

        auto finish_stats = [&]() {
            const int32_t n_gen = std::min<int32_t>(visible, gp.max_tokens);
            for (int32_t i = 0; i < n_gen; ++i) {
                out[i] = gen[i];
            }
            if (n_out) {
                *n_out = n_gen;
            }
            if (stats) {
                stats->n_generated        = n_gen;
                stats->n_decode_passes    = n_steps;
                stats->n_steps            = n_steps;
                stats->n_commits          = n_commits;
                stats->n_forward          = n_steps + n_calls;
                stats->n_blocks           = n_blocks;
                stats->block_size         = B;
                stats->n_block_switches   = n_switches;
                stats->finish_reason      = finish;
                stats->tokens_per_forward = n_steps > 0 ? (double) n_gen / n_steps : 0.0;
                stats->t_prefill_ms       = t_prefill;
                stats->t_decode_ms        = ms_since(t_start) - t_prefill;
                stats->tokens_per_second =
                    stats->t_decode_ms > 0 ? n_gen / (stats->t_decode_ms / 1000.0) : 0.0;
                stats->calibration        = ctx->last_calibration;
            }
        };
        auto fail = [&](int code, const std::string & what) {
            finish = CLOVER_FINISH_NONE;
            clear_memory(ctx); // a failed step may leave the memory half written: never reuse it
            finish_stats();
            return set_err(err, err_len, code, what);
        };

        // ---- prefill: commit the prompt's complete blocks
        int32_t nb = 0;
        const int32_t n_full = n_prompt / B * B;
        rc = prefill_impl(ctx, prompt + reuse, n_full - reuse, nb, n_calls, msg);
        n_commits += nb;
        t_prefill = ms_since(t_start);
        if (rc != CLOVER_OK) {
            return fail(rc, "prefill: " + msg);
        }

        std::vector<int32_t> canvas, pending; // pending: the finished block whose commit rides on the next pass
        std::vector<char>    want;            // logits only for the masked positions inside the budget
        std::vector<const float *> rows;
        std::vector<int32_t> masked, cand_tok, order;
        std::vector<double>  cand_conf;
        int32_t              n_rest = n_prompt - n_full;
        bool                 cancelled = false;

        while (true) {
            const int32_t n_left = gp.max_tokens - (int32_t) gen.size();
            if (auto_B && n_blocks > 0) {
                // re-plan at a block boundary; the first time no tokens-per-pass figure
                // exists, one block of B = 2 measures it
                const int32_t at   = ctx->n_committed + (int32_t) pending.size();
                int32_t       next = auto_pick(ctx, at, n_left);
                if (next == 1 && ctx->auto_tpf_any < 0 && auto_index(ctx, 2) >= 0 && auto_fits(ctx, 2, at, n_left)) {
                    next = 2;
                } else if (next > 0 && next != B && !(auto_ms_of(ctx, next) < 0.9 * auto_ms_of(ctx, B))) {
                    next = B; // not worth a switch
                }
                if (next > 0 && next != B) {
                    if (!pending.empty()) { // a commit cannot share a ubatch with a block of another size
                        rc = commit_impl(ctx, pending.data(), B, msg);
                        if (rc != CLOVER_OK) {
                            return fail(rc, msg);
                        }
                        pending.clear();
                        ++n_calls;
                    }
                    rc = switch_block_size_keep(ctx, next, msg);
                    if (rc != CLOVER_OK) {
                        return fail(rc, msg);
                    }
                    B = next;
                    ++n_switches;
                }
            }
            const int32_t start = ctx->n_committed + (int32_t) pending.size();
            // positions at or past the budget are never candidates: they stay masked
            const int32_t n_cand = std::min(B - n_rest, n_left);
            canvas.resize(B);
            want.assign(B, 0);
            for (int32_t i = 0; i < B; ++i) {
                canvas[i] = i < n_rest ? prompt[n_full + i] : mask;
            }
            masked.clear();
            for (int32_t i = n_rest; i < n_rest + n_cand; ++i) {
                masked.push_back(i);
            }
            ++n_blocks;
            int32_t step = 0;
            while (!masked.empty()) {
                std::fill(want.begin(), want.end(), 0);
                for (int32_t p : masked) {
                    want[p] = 1;
                }
                if (!pending.empty()) {
                    rc = fused_commit_pass(ctx, pending.data(), canvas.data(), B, &want, rows, msg);
                    pending.clear();
                    ++n_commits;
                } else {
                    rc = block_pass_rows(ctx, canvas.data(), B, &want, rows, msg);
                }
                if (rc != CLOVER_OK) {
                    return fail(rc, msg);
                }
                ++n_steps;
                const int32_t nm = (int32_t) masked.size();
                cand_tok.resize(nm);
                cand_conf.resize(nm);
                order.resize(nm);
                for (int32_t j = 0; j < nm; ++j) {
                    clover_detail::pick_candidate(rows[masked[j]], V, mask, gp.temperature,
                                                  gp.top_k, gp.top_p, rng, work, cand_tok[j], cand_conf[j]);
                }
                const int32_t k = clover_detail::select_unmask(cand_conf.data(), nm, gp.threshold, gp.max_steps, step,
                                                               order.data());
                for (int32_t j = 0; j < k; ++j) {
                    canvas[masked[order[j]]] = cand_tok[order[j]];
                }
                std::vector<int32_t> still;
                still.reserve(nm);
                for (int32_t p : masked) {
                    if (canvas[p] == mask) {
                        still.push_back(p);
                    }
                }
                masked.swap(still);
                ++step;
                if (gp.step_callback &&
                    gp.step_callback(start, canvas.data(), B, (int32_t) masked.size(), gp.user_data) != 0) {
                    cancelled = true;
                    break;
                }
            }
            bool has_eos = false;
            if (masked.empty()) {
                auto_observe(ctx, B, n_cand, step);
                gen.insert(gen.end(), canvas.begin() + n_rest, canvas.begin() + n_rest + n_cand);
                // visible output: cut at the first EOS and at max_tokens
                int32_t new_visible = (int32_t) gen.size();
                if (eos >= 0) {
                    for (int32_t i = visible; i < (int32_t) gen.size(); ++i) {
                        if (gen[i] == eos) {
                            new_visible = i;
                            has_eos     = true;
                            break;
                        }
                    }
                }
                new_visible = std::min(new_visible, gp.max_tokens);
                const int32_t old_visible = visible;
                visible                   = std::max(visible, new_visible);
                if (gp.block_callback) {
                    const int cb = gp.block_callback(start, gen.data() + old_visible, visible - old_visible,
                                                     gp.user_data);
                    if (cb != 0) {
                        cancelled = true;
                    }
                }
            }
            if (cancelled) {
                finish = CLOVER_FINISH_CANCELLED;
                break;
            }
            if (has_eos) {
                finish = CLOVER_FINISH_EOS;
                break;
            }
            if ((int32_t) gen.size() >= gp.max_tokens) {
                finish = CLOVER_FINISH_MAX_TOKENS;
                break;
            }
            pending = canvas; // committed by the next block's first pass
            n_rest  = 0;
        }
        finish_stats();
        if (cancelled) {
            return set_err(err, err_len, CLOVER_ERR_CANCELLED, "cancelled by a callback");
        }
        return CLOVER_OK;
    });
}

} // extern "C"
