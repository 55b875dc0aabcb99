// clover-planner.cpp - block size auto: the cost curve (measured or set), its disk cache,
// the running tokens per pass, and the B picked for the next block.

#include "clover-impl.h"

namespace clover_impl {

// a cost above this (ms per denoising step: 11.6 days) is no measurement: a cache entry that
// holds one is measured again, clover_set_cost_curve refuses it
constexpr double MAX_STEP_MS = 1e9;

static bool plausible_ms(double ms) {
    return ms > 0.0 && ms <= MAX_STEP_MS; // (false for NaN)
}

// candidates for block_size = auto: 1, 2, 4, ... up to max(32, training B), with a commit of B
// fused with a pass of B within n_ctx (the calibration measures that)
std::vector<int32_t> auto_candidates(const clover_context * c) {
    std::vector<int32_t> out;
    const int32_t        top = std::min(std::max(32, c->model->train_block), std::max(1, c->n_ctx / 2));
    for (int32_t B = 1; B <= top; B *= 2) {
        out.push_back(B);
    }
    return out;
}

// The running figures (tokens per pass, draft-self acceptance) start afresh with a cost curve.
void auto_reset_running(clover_context * c) {
    c->auto_tpf.assign(c->auto_sizes.size(), -1.0);
    c->auto_tpf_any = -1.0;
    c->ds_acc.assign(c->auto_sizes.size(), 0.0);
    c->ds_tried.assign(c->auto_sizes.size(), 0.0);
    c->ds_acc_any   = 0.0;
    c->ds_tried_any = 0.0;
    c->meas_ms.assign(c->auto_sizes.size(), -1.0);
    c->ds_meas_ms.assign(c->auto_sizes.size(), -1.0);
}

// The measured ms per token of a finished block decoded as p (EMA).
void auto_observe_ms(clover_context * c, const auto_plan & p, double ms_per_token) {
    const int i = auto_index(c, p.B);
    std::vector<double> & v = p.ds && p.B > 1 ? c->ds_meas_ms : c->meas_ms;
    if (i < 0 || (size_t) i >= v.size() || !(ms_per_token >= 0.0)) {
        return;
    }
    v[i] = v[i] < 0 ? ms_per_token : 0.7 * v[i] + 0.3 * ms_per_token;
}

// Was p (B > 1) measured slower per token than B = 1, both measured in this context? The cost
// curve, measured once and cached, may no longer hold (another load on the machine); a curve
// set by clover_set_cost_curve is taken as it is.
// When p has been measured but B = 1 not yet, the answer is "yes" once: one B = 1 block
// measures it (a token at B = 1's speed).
bool auto_measured_slower_than_ar(const clover_context * c, const auto_plan & p) {
    const int i = auto_index(c, p.B);
    if (c->curve_set || p.B <= 1 || i < 0 || c->meas_ms.empty()) {
        return false;
    }
    const std::vector<double> & v = p.ds ? c->ds_meas_ms : c->meas_ms;
    const double                m = (size_t) i < v.size() ? v[i] : -1.0;
    return m >= 0 && (c->meas_ms[0] < 0 || m > c->meas_ms[0]);
}

// Measures the cost curve: per candidate B, the fastest of 10 denoising steps (2 sweeps)
// of an all-mask block on an almost empty memory, both as a plain block pass and as a commit
// fused with the next pass; each includes the greedy candidate of every position (a softmax
// over the vocabulary, which matters for small models). Leaves the context at the last B, empty.
int calibrate_impl(clover_context * c, std::string & msg) {
    if (check_mask_token(c->model, "block-size calibration (block passes)", msg) != CLOVER_OK) {
        return CLOVER_ERR_INVALID_ARG;
    }
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
                if (fused && 2 * B > c->U) { // a context too small for both: such a step commits first
                    continue;
                }
                clear_memory(c);
                const auto t0 = std::chrono::steady_clock::now();
                rc = fused ? fused_commit_pass(c, canvas.data(), B, canvas.data(), B, nullptr, rows, msg)
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
    for (size_t i = 0; i < sizes.size(); ++i) {
        if (ms_fused[i] >= 1e300) { // not measured: a commit of B, then the pass
            ms_fused[i] = 2.0 * ms[i];
        }
    }
    c->auto_sizes    = sizes;
    c->auto_ms       = ms;
    c->auto_ms_fused = ms_fused;
    c->curve_set     = false;
    auto_reset_running(c);
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
// B = 1 is autoregressive decoding: one 1-token forward per token.
double auto_ms_per_token(const clover_context * c, size_t i) {
    const int32_t B      = c->auto_sizes[i];
    if (B == 1) {
        return c->auto_ms[i];
    }
    const double  passes = std::max(1.0, B / auto_tpf_estimate(c, i));
    return (c->auto_ms_fused[i] + (passes - 1.0) * c->auto_ms[i]) / B;
}

// Draft-self's per-position acceptance at candidate i: the share of drafted positions after
// the first (which is the autoregressive token itself) that verifications kept while every
// position before them was kept; its own running figure, else that of any B; -1 = none seen.
double auto_ds_alpha(const clover_context * c, size_t i) {
    if (i < c->ds_tried.size() && c->ds_tried[i] >= 1.0) {
        return c->ds_acc[i] / c->ds_tried[i];
    }
    return c->ds_tried_any >= 1.0 ? c->ds_acc_any / c->ds_tried_any : -1.0;
}

// One draft-self forward at candidate i: the B drafted tokens committed with their logits and
// the next draft's canvas of B, i.e. 2B tokens with 2B logits rows: a pass of 2B (the next
// candidate's; twice B's past the last), at least a fused step of B.
double auto_ds_forward_ms(const clover_context * c, size_t i) {
    const double pass2 = i + 1 < c->auto_ms.size() ? c->auto_ms[i + 1] : 2.0 * c->auto_ms[i];
    return std::max(c->auto_ms_fused[i], pass2);
}

// Expected ms per token of draft-self at candidate i (spec/decoding.md, "Block size auto"):
// position 0 is always kept, each later one with probability a while all before it were; a
// draft kept whole costs one forward (its verification drafts the next block), a rejection two
// (the kept tokens' commit drafts again); draft steps after the first are passes of B.
double auto_ds_ms_per_token(const clover_context * c, size_t i, int32_t draft_steps) {
    const int32_t B = c->auto_sizes[i];
    const double  a = auto_ds_alpha(c, i);
    if (B < 2 || a < 0) {
        return 1e300;
    }
    double tok = 0.0, aj = 1.0; // aj = a^j
    for (int32_t j = 0; j < B - 1; ++j) {
        tok += aj * (1.0 - a) * (j + 2); // j kept after position 0, then the rejection's own token
        aj *= a;
    }
    tok += aj * B;
    double extra = 0.0;
    if (draft_steps > 1) {
        extra = (draft_steps - 1) * c->auto_ms[i];
    } else if (draft_steps == 0) { // the threshold rule: about B / tpf passes per draft
        extra = std::max(0.0, B / auto_tpf_estimate(c, i) - 1.0) * c->auto_ms[i];
    }
    return ((2.0 - aj) * auto_ds_forward_ms(c, i) + extra) / tok;
}

// The cost of a forward of n tokens with their logits, from the cost curve (the pass of the
// smallest candidate >= n; proportionally past the last); < 0 without a curve.
static double auto_tokens_ms(const clover_context * c, int32_t n) {
    if (c->auto_sizes.empty()) {
        return -1.0;
    }
    for (size_t i = 0; i < c->auto_sizes.size(); ++i) {
        if (c->auto_sizes[i] >= n) {
            return c->auto_ms[i];
        }
    }
    return c->auto_ms.back() * n / c->auto_sizes.back();
}

// Draft-self: does the next draft's canvas pay its way in a verification of n drafted tokens
// at B? It is used only when the whole draft is kept (probability a^(n-1) by the running
// acceptance), when it saves a pass of B; it always costs B more tokens in the forward.
// Without a cost curve or an acceptance figure: yes.
bool auto_ds_canvas_pays(const clover_context * c, int32_t B, int32_t n) {
    const int i = auto_index(c, B);
    if (i < 0 || c->auto_sizes.empty()) {
        return true;
    }
    const double a = auto_ds_alpha(c, (size_t) i);
    if (a < 0) {
        return true;
    }
    const double whole = std::pow(a, n - 1);
    return whole * c->auto_ms[i] >= auto_tokens_ms(c, n + B) - auto_tokens_ms(c, n);
}

// Could draft-self beat B = 1 at all, were every draft kept whole (one forward per B tokens)?
// If not, block_size = auto never spends a block measuring its acceptance.
bool auto_ds_may_pay(const clover_context * c, int32_t draft_steps) {
    if (c->auto_sizes.empty() || c->auto_sizes[0] != 1) {
        return false;
    }
    for (size_t i = 1; i < c->auto_sizes.size(); ++i) {
        const int32_t B     = c->auto_sizes[i];
        const double  extra = draft_steps > 1 ? (draft_steps - 1) * c->auto_ms[i] : 0.0;
        if ((auto_ds_forward_ms(c, i) + extra) / B < c->auto_ms[0]) {
            return true;
        }
    }
    return false;
}

double auto_plan_ms(const clover_context * c, const auto_plan & p, int32_t draft_steps) {
    const int i = auto_index(c, p.B);
    if (i < 0) {
        return 1e300;
    }
    return p.ds && p.B > 1 ? auto_ds_ms_per_token(c, (size_t) i, draft_steps) : auto_ms_per_token(c, (size_t) i);
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
    k << "\nplacement " << c->model->placement;
    k << "\nsystem " << llama_print_system_info() << "\n"
      << "threads " << c->n_threads << " flash_attn " << c->flash_attn << " kv_f32 " << c->kv_f32
      << " n_ctx " << c->n_ctx << "\n";
    return k.str();
}

std::string placement_key(const clover_model_params & mp, const std::vector<ggml_backend_dev_t> & devices) {
    std::ostringstream k;
    k << "n_gpu_layers " << mp.n_gpu_layers << " rpc [" << (mp.rpc_servers ? mp.rpc_servers : "") << "] devices";
    for (ggml_backend_dev_t dev : devices) {
        if (dev) { // the endpoint (RPC) or the device's own description, and its type
            k << " " << ggml_backend_dev_description(dev) << "/" << (int) ggml_backend_dev_type(dev);
        }
    }
    k << " split";
    for (int32_t i = 0; i < mp.n_tensor_split && mp.tensor_split; ++i) {
        k << " " << mp.tensor_split[i];
    }
    k << " ot [" << (mp.tensor_overrides ? mp.tensor_overrides : "") << "]";
    std::string s = k.str();
    std::replace(s.begin(), s.end(), '\n', ' '); // the key is line-oriented
    return s;
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
    std::error_code ec;
    const auto      st = std::filesystem::status(path, ec);
    if (!ec && std::filesystem::exists(st) && !std::filesystem::is_regular_file(st)) {
        *bad = true; // a FIFO would block the open forever, a device never ends: measure again
        return false; // (and the store renames a regular file into its place)
    }
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
        if (!(in >> tag >> B >> ms[i] >> msf[i]) || tag != "cost" || B != sizes[i] || !plausible_ms(ms[i]) ||
            !plausible_ms(msf[i])) {
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
    c->curve_set     = false;
    auto_reset_running(c);
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

// The measurement can take many seconds on a large model, before the first token:
// one line says so, once per process, where a front end asked for its notices (clover_set_notices:
// the command lines) or at verbosity 1 and up; a quiet library prints nothing.
static std::atomic<bool> g_notices{false};
static std::once_flag    g_measuring_said;

static void say_measuring(const std::string & dir) {
    if (!g_notices.load() && g_verbosity.load() < 1) {
        return;
    }
    std::call_once(g_measuring_said, [&] {
        fprintf(stderr, "clover: measuring the cost curve of block size auto (once per model file and machine%s)\n",
                dir.empty() ? "" : ("; kept in " + dir).c_str());
        fflush(stderr);
    });
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
            fprintf(stderr, "clover: warning: the calibration cache entry %s is stale, corrupt or holds impossible costs; measuring again\n",
                    path.c_str());
        }
    }
    say_measuring(dir);
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

// Can blocks of B starting at n_committed hold `n_left` more tokens within n_ctx?
bool auto_fits(const clover_context * c, int32_t B, int32_t n_committed, int32_t n_left) {
    return (int64_t) n_committed + ((int64_t) n_left + B - 1) / B * B <= c->n_ctx;
}

// The (B, mode) with the lowest expected ms per token among those that fit (auto_fits) and
// that `modes` allows; B = 1 (autoregressive) is always allowed.
auto_plan auto_pick(const clover_context * c, int32_t n_committed, int32_t n_left, const auto_modes & modes) {
    auto_plan best;
    double    best_ms = 1e300;
    for (size_t i = 0; i < c->auto_sizes.size(); ++i) {
        const int32_t B = c->auto_sizes[i];
        if (!auto_fits(c, B, n_committed, n_left)) {
            continue;
        }
        if (B == 1 || modes.diffusion) {
            const double ms = auto_ms_per_token(c, i);
            if (best.B == 0 || ms < best_ms) { // (the first that fits, whatever its cost)
                best_ms = ms;
                best    = auto_plan{ B, false };
            }
        }
        if (B > 1 && modes.draft_self) {
            const double ms = auto_ds_ms_per_token(c, i, modes.draft_steps);
            if (best.B == 0 || ms < best_ms) {
                best_ms = ms;
                best    = auto_plan{ B, true };
            }
        }
    }
    return best;
}

// Draft-self's running acceptance after a verification at B: `tried` drafted positions after
// the first were compared, `accepted` of them kept (decayed sums, per B and over all B).
void auto_observe_ds(clover_context * c, int32_t B, int32_t accepted, int32_t tried) {
    if (tried < 1) {
        return;
    }
    const double keep = 0.8;
    c->ds_acc_any   = keep * c->ds_acc_any + accepted;
    c->ds_tried_any = keep * c->ds_tried_any + tried;
    const int i     = auto_index(c, B);
    if (i >= 0 && (size_t) i < c->ds_tried.size()) {
        c->ds_acc[i]   = keep * c->ds_acc[i] + accepted;
        c->ds_tried[i] = keep * c->ds_tried[i] + tried;
    }
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

} // namespace clover_impl

using namespace clover_impl;

extern "C" {

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
            if (sizes[i] != (i == 0 ? 1 : 2 * sizes[i - 1]) || sizes[i] > ctx->n_ctx || !plausible_ms(ms[i]) ||
                !plausible_ms(f)) {
                return set_err(err, err_len, CLOVER_ERR_INVALID_ARG,
                               "cost curve: sizes must be 1, 2, 4, ... (<= n_ctx) and costs in (0, 1e9] ms");
            }
        }
        ctx->auto_sizes.assign(sizes, sizes + n);
        ctx->auto_ms.assign(ms, ms + n);
        // without fused costs: a fused step of B tokens is about a pass of 2B
        ctx->auto_ms_fused.resize(n);
        for (int32_t i = 0; i < n; ++i) {
            ctx->auto_ms_fused[i] = ms_fused ? ms_fused[i] : i + 1 < n ? ms[i + 1] : 2.0 * ms[i];
        }
        ctx->curve_set = true;
        auto_reset_running(ctx);
        return CLOVER_OK;
    });
}

// The command lines' switch for the measuring notice (say_measuring)
CLOVER_API void clover_set_notices(int on) {
    g_notices.store(on != 0);
}

} // extern "C"
