// clover-planner.h - block size auto: the cost curve and the running figures the per-block pick
// reads (not installed; the calibration's disk cache is clover-calibration-cache.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

struct clover_context;

namespace clover_impl {

// what block_size = auto may choose besides B = 1 (autoregressive): block diffusion at B > 1,
// draft-self at B > 1 (whose drafts take draft_steps passes; 0 = the threshold rule)
struct auto_modes {
    bool    diffusion   = true;
    bool    draft_self  = false;
    int32_t draft_steps = 1;
};

struct auto_plan {
    int32_t B  = 0; // 0 = none fits
    bool    ds = false;
    bool operator==(const auto_plan & o) const { return B == o.B && ds == o.ds; }
    bool operator!=(const auto_plan & o) const { return !(*this == o); }
};

// a cost a measurement or clover_set_cost_curve may hold: in (0, 1e9] ms per denoising step
bool plausible_step_ms(double ms);

// Can blocks of B starting at n_committed hold `n_left` more tokens within n_ctx?
bool auto_fits(int32_t n_ctx, int32_t B, int32_t n_committed, int32_t n_left);

// The planner of one context: the cost of a block pass per candidate B (ms; measured by
// clover_calibrate or set by clover_set_cost_curve) and the running figures of this context's
// generations, from which it picks the (B, mode) of each block.
struct clover_planner {
    std::vector<int32_t> sizes;    // the candidates 1, 2, 4, ... (empty: no cost curve yet)
    std::vector<double>  pass_ms;  // a block pass of B tokens
    std::vector<double>  fused_ms; // a commit of B tokens fused with the next block's first pass
    // the running tokens per pass (EMA over finished decode blocks; < 0 = not seen yet), per
    // candidate and overall
    std::vector<double>  tpf;
    double               tpf_any = -1.0;
    // draft-self's running acceptance (decayed sums over verifications): drafted positions after
    // the first that were compared (tried) and kept (acc), per candidate B and over all B
    std::vector<double>  ds_acc, ds_tried;
    double               ds_acc_any = 0.0, ds_tried_any = 0.0;
    // measured ms per generated token (wall, EMA over finished blocks but a generation's first),
    // per candidate B, of block diffusion (B = 1: autoregressive) and of draft-self; < 0 = not
    // seen. With a measured cost curve (not a set one) auto never stays in a mode measured
    // slower than B = 1 (and runs one B = 1 block to measure B = 1 when it has to).
    std::vector<double>  meas_ms, ds_meas_ms;
    bool                 curve_set = false;   // the cost curve came from clover_set_cost_curve (taken as is)
    int32_t              use_cache = 1;       // clover_context_params.calib_cache: the disk cache is read and written
    int32_t              last_calibration = 0; // 0 none, 1 measured, 2 from the disk cache (per generate)
    // coreset auto (spec/decoding.md, "The block expert coreset"): its C once decided in this context (-1 = not
    // yet), and the measurements clover_set_coreset_probe injects instead of measuring (tests)
    int32_t              coreset_auto_C = -1;
    bool                 probe_set      = false;
    struct coreset_probe {
        double               full_ms = 0.0;   // a block pass at the calibration B with full routing
        std::vector<int32_t> C;               // per candidate C: its pass (ms) and the share of rows
        std::vector<double>  ms, agree;       // whose argmax equals full routing's
    } probe;

    // a new cost curve (measured, or set: taken as is); the running figures start afresh
    void set_curve(std::vector<int32_t> sizes, std::vector<double> pass_ms, std::vector<double> fused_ms, bool set);
    void reset_running();
    // index of B among the candidates, or -1
    int  index(int32_t B) const;
    // the (B, mode) with the lowest expected ms per token among those that fit and that `modes` allows
    auto_plan pick(int32_t n_ctx, int32_t n_committed, int32_t n_left, const auto_modes & modes) const;
    double    plan_ms(const auto_plan & p, int32_t draft_steps) const;
    bool      ds_may_pay(int32_t draft_steps) const;
    bool      ds_canvas_pays(int32_t B, int32_t n) const;
    bool      measured_slower_than_ar(const auto_plan & p) const;
    // what a finished block teaches: tokens per pass, draft-self's acceptance, ms per token
    void observe(int32_t B, int32_t n_tokens, int32_t n_passes);
    void observe_ds(int32_t B, int32_t accepted, int32_t tried);
    void observe_ms(const auto_plan & p, double ms_per_token);

  private:
    double tpf_estimate(size_t i) const;
    double ms_per_token(size_t i) const;
    double ds_alpha(size_t i) const;
    double ds_forward_ms(size_t i) const;
    double ds_ms_per_token(size_t i, int32_t draft_steps) const;
    double tokens_ms(int32_t n) const;
};

// the candidates of a context: 1, 2, 4, ... up to max(32, training B), within n_ctx / 2
std::vector<int32_t> auto_candidates(const clover_context * c);
// measures the context's cost curve into its planner (clover_calibrate); leaves the context empty
int calibrate(clover_context * c, std::string & msg);

// coreset auto: the block size of its measurement (0: none has a coreset), its candidates C (3 k,
// 4 k, 6 k below the expert count E), the measurements (or the injected probe) and the rule's pick
int32_t              coreset_auto_B(const clover_context * c);
std::vector<int32_t> coreset_auto_candidates(const clover_context * c);
int     measure_coreset_auto(clover_context * c, clover_planner::coreset_probe & out, std::string & msg);
int32_t pick_coreset_auto(const clover_planner::coreset_probe & p);

} // namespace clover_impl
