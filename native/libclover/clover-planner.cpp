// clover-planner.cpp - block size auto: the cost curve (measured or set), the running tokens
// per pass, and the B picked for the next block (clover-planner.h). The curve's disk cache is
// clover-calibration-cache.cpp.

#include "clover-impl.h"
#include "clover-params.h"
#include "clover-sampling.h"
#include "clover-testing.h"
#include "clover-time.h"

namespace clover_impl {

// a cost above this (ms per denoising step: 11.6 days) is no measurement: a cache entry that
// holds one is measured again, clover_set_cost_curve refuses it
constexpr double MAX_STEP_MS = 1e9;

bool plausible_step_ms(double ms) {
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

void clover_planner::set_curve(std::vector<int32_t> s, std::vector<double> ms, std::vector<double> ms_fused, bool set) {
    sizes     = std::move(s);
    pass_ms   = std::move(ms);
    fused_ms  = std::move(ms_fused);
    curve_set = set;
    reset_running();
}

// The running figures (tokens per pass, draft-self acceptance) start afresh with a cost curve.
void clover_planner::reset_running() {
    tpf.assign(sizes.size(), -1.0);
    tpf_any = -1.0;
    ds_acc.assign(sizes.size(), 0.0);
    ds_tried.assign(sizes.size(), 0.0);
    ds_acc_any   = 0.0;
    ds_tried_any = 0.0;
    meas_ms.assign(sizes.size(), -1.0);
    ds_meas_ms.assign(sizes.size(), -1.0);
}

// The measured ms per token of a finished block decoded as p (EMA).
void clover_planner::observe_ms(const auto_plan & p, double ms_per_token) {
    const int i = index(p.B);
    std::vector<double> & v = p.ds && p.B > 1 ? ds_meas_ms : meas_ms;
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
bool clover_planner::measured_slower_than_ar(const auto_plan & p) const {
    const int i = index(p.B);
    if (curve_set || p.B <= 1 || i < 0 || meas_ms.empty()) {
        return false;
    }
    const std::vector<double> & v = p.ds ? ds_meas_ms : meas_ms;
    const double                m = (size_t) i < v.size() ? v[i] : -1.0;
    return m >= 0 && (meas_ms[0] < 0 || m > meas_ms[0]);
}

// Measures the cost curve: per candidate B, the fastest of 10 denoising steps (2 sweeps)
// of an all-mask block on an almost empty memory, both as a plain block pass and as a commit
// fused with the next pass; each includes the greedy candidate of every position (a softmax
// over the vocabulary, which matters for small models). Leaves the context at the last B, empty.
int calibrate(clover_context * c, std::string & msg) {
    if (check_mask_token(c->model, "block-size calibration (block passes)", msg) != CLOVER_OK) {
        return CLOVER_ERR_INVALID_ARG;
    }
    const std::vector<int32_t> sizes = auto_candidates(c);
    std::vector<double>        ms(sizes.size(), 1e300), ms_fused(sizes.size(), 1e300);
    std::vector<const float *> rows;
    std::mt19937_64            rng(0);
    pick_work                  work;
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
                    pick_candidate(rows[i], c->model->n_vocab, c->model->mask, 0.0, 0, 1.0, rng, work, tok, conf);
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
    c->planner.set_curve(sizes, ms, ms_fused, false);
    return CLOVER_OK;
}

// Expected tokens per block pass at B: its own running figure; else that of the largest
// smaller B seen, doubled when that B finished its blocks in about one pass (so a confident
// model climbs one size at a time); else the running figure of any B; each capped at B; else 1.
double clover_planner::tpf_estimate(size_t i) const {
    const int32_t B = sizes[i];
    if (B == 1) {
        return 1.0;
    }
    if (tpf[i] > 0) {
        return tpf[i];
    }
    for (size_t j = i; j-- > 0;) {
        const double t = tpf[j];
        if (t > 0 && sizes[j] > 1) {
            return std::min<double>(B, t >= 0.9 * sizes[j] ? 2 * t : t);
        }
    }
    return tpf_any > 0 ? std::min<double>(B, tpf_any) : 1.0;
}

// Expected milliseconds per generated token at candidate i: a block of B tokens takes B / tpf
// passes, the first of which carries the previous block's commit.
// B = 1 is autoregressive decoding: one 1-token forward per token.
double clover_planner::ms_per_token(size_t i) const {
    const int32_t B      = sizes[i];
    if (B == 1) {
        return pass_ms[i];
    }
    const double  passes = std::max(1.0, B / tpf_estimate(i));
    return (fused_ms[i] + (passes - 1.0) * pass_ms[i]) / B;
}

// Draft-self's per-position acceptance at candidate i: the share of drafted positions after
// the first (which is the autoregressive token itself) that verifications kept while every
// position before them was kept; its own running figure, else that of any B; -1 = none seen.
double clover_planner::ds_alpha(size_t i) const {
    if (i < ds_tried.size() && ds_tried[i] >= 1.0) {
        return ds_acc[i] / ds_tried[i];
    }
    return ds_tried_any >= 1.0 ? ds_acc_any / ds_tried_any : -1.0;
}

// One draft-self forward at candidate i: the B drafted tokens committed with their logits and
// the next draft's canvas of B, i.e. 2B tokens with 2B logits rows: a pass of 2B (the next
// candidate's; twice B's past the last), at least a fused step of B.
double clover_planner::ds_forward_ms(size_t i) const {
    const double pass2 = i + 1 < pass_ms.size() ? pass_ms[i + 1] : 2.0 * pass_ms[i];
    return std::max(fused_ms[i], pass2);
}

// Expected ms per token of draft-self at candidate i (spec/decoding.md, "Block size auto"):
// position 0 is always kept, each later one with probability a while all before it were; a
// draft kept whole costs one forward (its verification drafts the next block), a rejection two
// (the kept tokens' commit drafts again); draft steps after the first are passes of B.
double clover_planner::ds_ms_per_token(size_t i, int32_t draft_steps) const {
    const int32_t B = sizes[i];
    const double  a = ds_alpha(i);
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
        extra = (draft_steps - 1) * pass_ms[i];
    } else if (draft_steps == 0) { // the threshold rule: about B / tpf passes per draft
        extra = std::max(0.0, B / tpf_estimate(i) - 1.0) * pass_ms[i];
    }
    return ((2.0 - aj) * ds_forward_ms(i) + extra) / tok;
}

// The cost of a forward of n tokens with their logits, from the cost curve (the pass of the
// smallest candidate >= n; proportionally past the last); < 0 without a curve.
double clover_planner::tokens_ms(int32_t n) const {
    if (sizes.empty()) {
        return -1.0;
    }
    for (size_t i = 0; i < sizes.size(); ++i) {
        if (sizes[i] >= n) {
            return pass_ms[i];
        }
    }
    return pass_ms.back() * n / sizes.back();
}

// Draft-self: does the next draft's canvas pay its way in a verification of n drafted tokens
// at B? It is used only when the whole draft is kept (probability a^(n-1) by the running
// acceptance), when it saves a pass of B; it always costs B more tokens in the forward.
// Without a cost curve or an acceptance figure: yes.
bool clover_planner::ds_canvas_pays(int32_t B, int32_t n) const {
    const int i = index(B);
    if (i < 0 || sizes.empty()) {
        return true;
    }
    const double a = ds_alpha((size_t) i);
    if (a < 0) {
        return true;
    }
    const double whole = std::pow(a, n - 1);
    return whole * pass_ms[i] >= tokens_ms(n + B) - tokens_ms(n);
}

// Could draft-self beat B = 1 at all, were every draft kept whole (one forward per B tokens)?
// If not, block_size = auto never spends a block measuring its acceptance.
bool clover_planner::ds_may_pay(int32_t draft_steps) const {
    if (sizes.empty() || sizes[0] != 1) {
        return false;
    }
    for (size_t i = 1; i < sizes.size(); ++i) {
        const int32_t B     = sizes[i];
        const double  extra = draft_steps > 1 ? (draft_steps - 1) * pass_ms[i] : 0.0;
        if ((ds_forward_ms(i) + extra) / B < pass_ms[0]) {
            return true;
        }
    }
    return false;
}

double clover_planner::plan_ms(const auto_plan & p, int32_t draft_steps) const {
    const int i = index(p.B);
    if (i < 0) {
        return 1e300;
    }
    return p.ds && p.B > 1 ? ds_ms_per_token((size_t) i, draft_steps) : ms_per_token((size_t) i);
}

// Index of B among the candidates, or -1.
int clover_planner::index(int32_t B) const {
    for (size_t i = 0; i < sizes.size(); ++i) {
        if (sizes[i] == B) {
            return (int) i;
        }
    }
    return -1;
}

// Can blocks of B starting at n_committed hold `n_left` more tokens within n_ctx?
bool auto_fits(int32_t n_ctx, int32_t B, int32_t n_committed, int32_t n_left) {
    return (int64_t) n_committed + ((int64_t) n_left + B - 1) / B * B <= n_ctx;
}

// The (B, mode) with the lowest expected ms per token among those that fit (auto_fits) and
// that `modes` allows; B = 1 (autoregressive) is always allowed.
auto_plan clover_planner::pick(int32_t n_ctx, int32_t n_committed, int32_t n_left, const auto_modes & modes) const {
    auto_plan best;
    double    best_ms = 1e300;
    for (size_t i = 0; i < sizes.size(); ++i) {
        const int32_t B = sizes[i];
        if (!auto_fits(n_ctx, B, n_committed, n_left)) {
            continue;
        }
        if (B == 1 || modes.diffusion) {
            const double ms = ms_per_token(i);
            if (best.B == 0 || ms < best_ms) { // (the first that fits, whatever its cost)
                best_ms = ms;
                best    = auto_plan{ B, false };
            }
        }
        if (B > 1 && modes.draft_self) {
            const double ms = ds_ms_per_token(i, modes.draft_steps);
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
void clover_planner::observe_ds(int32_t B, int32_t accepted, int32_t tried) {
    if (tried < 1) {
        return;
    }
    const double keep = 0.8;
    ds_acc_any   = keep * ds_acc_any + accepted;
    ds_tried_any = keep * ds_tried_any + tried;
    const int i  = index(B);
    if (i >= 0 && (size_t) i < ds_tried.size()) {
        ds_acc[i]   = keep * ds_acc[i] + accepted;
        ds_tried[i] = keep * ds_tried[i] + tried;
    }
}

// Running tokens per pass after a finished decode block of size B.
void clover_planner::observe(int32_t B, int32_t n_tokens, int32_t n_passes) {
    if (B < 2 || n_passes < 1 || n_tokens < 1) {
        return;
    }
    const double t = (double) n_tokens / n_passes;
    const double a = 0.3;
    tpf_any        = tpf_any > 0 ? (1 - a) * tpf_any + a * t : t;
    const int i    = index(B);
    if (i >= 0) {
        tpf[i] = tpf[i] > 0 ? (1 - a) * tpf[i] + a * t : t;
    }
}

// Coreset auto measures at the largest candidate B of block size auto, at most 32: the passes
// whose expert bytes the coreset cuts. 0 when that is B = 1 (which keeps full routing).
int32_t coreset_auto_B(const clover_context * c) {
    const int32_t B = std::min(32, auto_candidates(c).back());
    return B > 1 ? B : 0;
}

std::vector<int32_t> coreset_auto_candidates(const clover_context * c) {
    int32_t n_expert = 0, n_used = 0;
    model_experts(c->model, n_expert, n_used);
    std::vector<int32_t> out;
    for (int32_t f : { 3, 4, 6 }) {
        if (n_used > 0 && f * n_used < n_expert) {
            out.push_back(f * n_used);
        }
    }
    return out;
}

// The rule (spec/decoding.md, "The block expert coreset"): the first candidate whose pass is at least 10%
// faster than full routing's and whose argmax agrees with full routing's on at least 95% of the
// rows; none: 0 (off).
int32_t pick_coreset_auto(const clover_planner::coreset_probe & p) {
    for (size_t i = 0; i < p.C.size(); ++i) {
        if (p.ms[i] <= 0.9 * p.full_ms && p.agree[i] >= 0.95) {
            return p.C[i];
        }
    }
    return 0;
}

// The argmax of every row of a pass (lowest id on ties).
static std::vector<int32_t> row_argmax(const std::vector<const float *> & rows, int32_t n_vocab) {
    std::vector<int32_t> out;
    for (const float * r : rows) {
        out.push_back((int32_t) (std::max_element(r, r + n_vocab) - r));
    }
    return out;
}

// Measures coreset auto's figures: on one canvas of B = coreset_auto_B (every other token
// masked, the rest drawn from the vocabulary: rows that route apart), a block pass with full
// routing and with each candidate C, the median of 5 after 2 warm-ups, interleaved so that a
// drifting machine biases none; and each C's share of rows whose argmax equals full routing's.
// Leaves the context empty, its coreset off.
int measure_coreset_auto(clover_context * c, clover_planner::coreset_probe & out, std::string & msg) {
    const int32_t              B  = coreset_auto_B(c);
    const std::vector<int32_t> Cs = coreset_auto_candidates(c);
    out = {};
    std::string no_mask;
    if (B == 0 || Cs.empty() || check_mask_token(c->model, "coreset auto", no_mask) != CLOVER_OK) {
        return CLOVER_OK; // nothing to measure (no block passes without a mask token): off
    }
    int rc = set_block_size_impl(c, B, msg);
    if (rc != CLOVER_OK) {
        return rc;
    }
    clear_memory(c);
    std::mt19937_64      rng(0);
    std::vector<int32_t> canvas(B, c->model->mask);
    for (int32_t i = 0; i < B; i += 2) {
        do {
            canvas[i] = (int32_t) (rng() % (uint64_t) c->model->n_vocab);
        } while (canvas[i] == c->model->mask);
    }
    std::vector<int32_t>              all = { 0 };
    all.insert(all.end(), Cs.begin(), Cs.end());
    std::vector<std::vector<double>>  ms(all.size());
    std::vector<std::vector<int32_t>> argmax(all.size());
    std::vector<const float *>        rows;
    for (int rep = 0; rep < 7 && rc == CLOVER_OK; ++rep) {
        for (size_t j = 0; j < all.size() && rc == CLOVER_OK; ++j) {
            c->coreset    = all[j];
            const auto t0 = std::chrono::steady_clock::now();
            rc            = block_pass_rows(c, canvas.data(), B, nullptr, rows, msg);
            if (rc == CLOVER_OK && rep > 1) {
                ms[j].push_back(ms_since(t0));
            }
            if (rc == CLOVER_OK && rep == 0) {
                argmax[j] = row_argmax(rows, c->model->n_vocab);
            }
        }
    }
    c->coreset = 0;
    clear_memory(c);
    if (rc != CLOVER_OK) {
        return rc;
    }
    auto median = [](std::vector<double> v) {
        std::sort(v.begin(), v.end());
        return v[v.size() / 2];
    };
    out.full_ms = median(ms[0]);
    for (size_t j = 1; j < all.size(); ++j) {
        int32_t same = 0;
        for (int32_t i = 0; i < B; ++i) {
            same += argmax[j][i] == argmax[0][i];
        }
        out.C.push_back(all[j]);
        out.ms.push_back(median(ms[j]));
        out.agree.push_back((double) same / B);
    }
    return CLOVER_OK;
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
        const int   rc = calibrate(ctx, msg);
        if (rc != CLOVER_OK) {
            return set_err(err, err_len, rc, "block-size calibration: " + msg);
        }
        const clover_planner & pl = ctx->planner;
        const int32_t          n  = (int32_t) pl.sizes.size();
        for (int32_t i = 0; i < std::min(n, cap); ++i) {
            if (sizes_out) {
                sizes_out[i] = pl.sizes[i];
            }
            if (ms_out) {
                ms_out[i] = pl.pass_ms[i];
            }
            if (ms_fused_out) {
                ms_fused_out[i] = pl.fused_ms[i];
            }
        }
        if (n_out) {
            *n_out = n;
        }
        return CLOVER_OK;
    });
}

int clover_set_coreset_probe(clover_context * ctx, double full_ms, const int32_t * C, const double * ms,
                             const double * agree, int32_t n) {
    if (!ctx || n < 0 || (n > 0 && (!C || !ms || !agree))) {
        return CLOVER_ERR_INVALID_ARG;
    }
    clover_planner & pl = ctx->planner;
    pl.probe_set        = n > 0;
    pl.probe            = { full_ms, std::vector<int32_t>(C, C + n), std::vector<double>(ms, ms + n),
                            std::vector<double>(agree, agree + n) };
    pl.coreset_auto_C   = -1; // the next coreset auto decides again
    return CLOVER_OK;
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
            if (sizes[i] != (i == 0 ? 1 : 2 * sizes[i - 1]) || sizes[i] > ctx->n_ctx || !plausible_step_ms(ms[i]) ||
                !plausible_step_ms(f)) {
                return set_err(err, err_len, CLOVER_ERR_INVALID_ARG,
                               "cost curve: sizes must be 1, 2, 4, ... (<= n_ctx) and costs in (0, 1e9] ms");
            }
        }
        // without fused costs: a fused step of B tokens is about a pass of 2B
        std::vector<double> fused(n);
        for (int32_t i = 0; i < n; ++i) {
            fused[i] = ms_fused ? ms_fused[i] : i + 1 < n ? ms[i + 1] : 2.0 * ms[i];
        }
        ctx->planner.set_curve(std::vector<int32_t>(sizes, sizes + n), std::vector<double>(ms, ms + n), fused, true);
        return CLOVER_OK;
    });
}

} // extern "C"
