// clover-params.cpp - the rules of clover_generate's parameters, in one place: their defaults
// (clover_generate_default_params), their ranges (clover_generate_params_check, which
// clover_generate, clover-cli and the Python bindings all ask), what each block_size value means
// (CLOVER_BLOCK_SIZE_*), and how many positions a generation needs (clover_generate_room); and
// the context parameters' model-free rules (check_context_params: clover_context_params_check).

#include "clover-impl.h"
#include "clover-params.h"
#include "clover-sampling.h"
#include "clover-grammar.h"

#include <cinttypes>

namespace clover_impl {

namespace {

std::string num(double x) {
    char buf[32];
    snprintf(buf, sizeof(buf), "%g", x);
    return buf;
}

} // namespace

int32_t training_block_size(const clover_model * m, int32_t n_ctx) {
    // (no mask token: causal only, B = 1)
    const int32_t B = m->mask < 0 ? 1 : m->train_block > 0 ? m->train_block : 32;
    return std::max(1, std::min(B, n_ctx));
}

// The rules that need no context, one message each (clover.h, clover_generate_params_check).
int check_params(const clover_generate_params & gp, std::string & msg) {
    auto bad = [&](std::string what) {
        msg = std::move(what);
        return CLOVER_ERR_INVALID_ARG;
    };
    if (gp.block_size < 1 && gp.block_size != CLOVER_BLOCK_SIZE_AUTO && gp.block_size != CLOVER_BLOCK_SIZE_TRAIN &&
        gp.block_size != CLOVER_BLOCK_SIZE_CONTEXT) {
        return bad("block size must be >= 1, CLOVER_BLOCK_SIZE_AUTO (-1), _TRAIN (0) or _CONTEXT (-2), got " +
                   std::to_string(gp.block_size));
    }
    if (!(gp.threshold >= 0.0 && gp.threshold <= 1.0)) {
        return bad("threshold must be in [0, 1], got " + num(gp.threshold));
    }
    if (!(gp.temperature >= 0.0) || std::isinf(gp.temperature)) {
        return bad("temperature must be finite and >= 0, got " + num(gp.temperature));
    }
    if (!(gp.top_p >= 0.0 && gp.top_p <= 1.0)) {
        return bad("top_p must be in [0, 1], got " + num(gp.top_p));
    }
    if (gp.top_k < 0) {
        return bad("top_k must be >= 0 (0 = off), got " + std::to_string(gp.top_k));
    }
    if (gp.max_steps < 0) {
        return bad("max_steps must be >= 0 (0 = no cap), got " + std::to_string(gp.max_steps));
    }
    if (gp.max_tokens < 0) {
        return bad("max_tokens must be >= 0, got " + std::to_string(gp.max_tokens));
    }
    if (gp.draft_self != 0 && gp.draft_self != 1 && gp.draft_self != CLOVER_DRAFT_SELF_AUTO) {
        return bad("draft_self must be 0, 1 or -1 (auto), got " + std::to_string(gp.draft_self));
    }
    if (gp.draft_steps < 0) {
        return bad("draft_steps must be >= 0 (0 = the threshold rule), got " + std::to_string(gp.draft_steps));
    }
    if (gp.n_top_logprobs < 0 || gp.n_top_logprobs > CLOVER_MAX_TOP_LOGPROBS) {
        return bad("n_top_logprobs must be in [0, " + std::to_string(CLOVER_MAX_TOP_LOGPROBS) + "], got " +
                   std::to_string(gp.n_top_logprobs));
    }
    if (gp.n_top_logprobs > 0 && (!gp.top_tokens || !gp.top_logprobs)) {
        return bad("n_top_logprobs > 0 needs the top_tokens and top_logprobs buffers");
    }
    if (gp.n_stop_tokens < 0) {
        return bad("n_stop_tokens must be >= 0, got " + std::to_string(gp.n_stop_tokens));
    }
    if (gp.n_stop_tokens > 0 && !gp.stop_tokens) {
        return bad("n_stop_tokens > 0 needs the stop_tokens array");
    }
    return check_chain_params(gp, msg);
}

// the sampler chain's fields (clover.h; the ranges llama-server accepts, finite everywhere)
int check_chain_params(const clover_generate_params & gp, std::string & msg) {
    auto bad = [&](std::string what) {
        msg = std::move(what);
        return CLOVER_ERR_INVALID_ARG;
    };
    auto in = [](double x, double lo, double hi) { return x >= lo && x <= hi; };
    if (!in(gp.min_p, 0.0, 1.0)) {
        return bad("min_p must be in [0, 1], got " + num(gp.min_p));
    }
    if (!(gp.typical_p > 0.0 && gp.typical_p <= 1.0)) {
        return bad("typical_p must be in (0, 1], got " + num(gp.typical_p));
    }
    if (!std::isfinite(gp.top_n_sigma)) {
        return bad("top_n_sigma must be finite (<= 0 = off), got " + num(gp.top_n_sigma));
    }
    if (!in(gp.xtc_probability, 0.0, 1.0)) {
        return bad("xtc_probability must be in [0, 1], got " + num(gp.xtc_probability));
    }
    if (!in(gp.xtc_threshold, 0.0, 1.0)) {
        return bad("xtc_threshold must be in [0, 1], got " + num(gp.xtc_threshold));
    }
    if (gp.repeat_last_n < -1) {
        return bad("repeat_last_n must be >= -1 (-1 = the context size, 0 = off), got " +
                   std::to_string(gp.repeat_last_n));
    }
    if (!(gp.repeat_penalty > 0.0) || !std::isfinite(gp.repeat_penalty)) {
        return bad("repeat_penalty must be finite and > 0 (1 = off), got " + num(gp.repeat_penalty));
    }
    if (!in(gp.frequency_penalty, -2.0, 2.0)) {
        return bad("frequency_penalty must be in [-2, 2], got " + num(gp.frequency_penalty));
    }
    if (!in(gp.presence_penalty, -2.0, 2.0)) {
        return bad("presence_penalty must be in [-2, 2], got " + num(gp.presence_penalty));
    }
    if (!(gp.dry_multiplier >= 0.0) || !std::isfinite(gp.dry_multiplier)) {
        return bad("dry_multiplier must be finite and >= 0 (0 = off), got " + num(gp.dry_multiplier));
    }
    if (!(gp.dry_base >= 1.0) || !std::isfinite(gp.dry_base)) {
        return bad("dry_base must be finite and >= 1, got " + num(gp.dry_base));
    }
    if (gp.dry_allowed_length < 0) {
        return bad("dry_allowed_length must be >= 0, got " + std::to_string(gp.dry_allowed_length));
    }
    if (gp.dry_penalty_last_n < -1) {
        return bad("dry_penalty_last_n must be >= -1 (-1 = the context size, 0 = off), got " +
                   std::to_string(gp.dry_penalty_last_n));
    }
    if (gp.n_dry_sequence_breakers < 0 || (gp.n_dry_sequence_breakers > 0 && !gp.dry_sequence_breakers)) {
        return bad("n_dry_sequence_breakers must be >= 0, with the dry_sequence_breakers array when > 0");
    }
    for (int32_t i = 0; i < gp.n_dry_sequence_breakers; ++i) {
        if (!gp.dry_sequence_breakers[i] || !gp.dry_sequence_breakers[i][0]) {
            return bad("dry_sequence_breakers[" + std::to_string(i) + "] must be a non-empty string");
        }
    }
    if (gp.mirostat < 0 || gp.mirostat > 2) {
        return bad("mirostat must be 0, 1 or 2, got " + std::to_string(gp.mirostat));
    }
    if (!(gp.mirostat_tau > 0.0) || !std::isfinite(gp.mirostat_tau)) {
        return bad("mirostat_tau must be finite and > 0, got " + num(gp.mirostat_tau));
    }
    if (!(gp.mirostat_eta > 0.0) || !std::isfinite(gp.mirostat_eta)) {
        return bad("mirostat_eta must be finite and > 0, got " + num(gp.mirostat_eta));
    }
    if (gp.n_logit_bias < 0 || (gp.n_logit_bias > 0 && (!gp.logit_bias_tokens || !gp.logit_bias))) {
        return bad("n_logit_bias must be >= 0, with the logit_bias_tokens and logit_bias arrays when > 0");
    }
    for (int32_t i = 0; i < gp.n_logit_bias; ++i) {
        const float b = gp.logit_bias[i];
        if (gp.logit_bias_tokens[i] < 0 || b != b || b == std::numeric_limits<float>::infinity()) {
            return bad("logit_bias: token " + std::to_string(gp.logit_bias_tokens[i]) + ": the id must be >= 0 "
                       "and the bias a number or -inf, got " + num(b));
        }
    }
    if (!(gp.dynatemp_range >= 0.0) || !std::isfinite(gp.dynatemp_range)) {
        return bad("dynatemp_range must be finite and >= 0 (0 = off), got " + num(gp.dynatemp_range));
    }
    if (!(gp.dynatemp_exponent >= 0.0) || !std::isfinite(gp.dynatemp_exponent)) {
        return bad("dynatemp_exponent must be finite and >= 0, got " + num(gp.dynatemp_exponent));
    }
    if (gp.min_keep < 0) {
        return bad("min_keep must be >= 0, got " + std::to_string(gp.min_keep));
    }
    std::vector<chain_sampler> order;
    return parse_samplers(gp.samplers, order, msg) ? CLOVER_OK : CLOVER_ERR_INVALID_ARG;
}

int check_context_params(const clover_context_params & cp, std::string & msg) {
    if (cp.n_ctx != 0 && cp.n_ctx < 3) { // (llama.cpp caps its batch at n_ctx and needs one output per sequence: 3)
        msg = "n_ctx must be 0 (the model's training context) or >= 3, got " + std::to_string(cp.n_ctx);
        return CLOVER_ERR_INVALID_ARG;
    }
    // (with n_ctx 0 the block size's bound is known once the model is: clover_context_new)
    if (cp.block_size != CLOVER_BLOCK_SIZE_TRAIN && (cp.block_size < 1 || (cp.n_ctx > 0 && cp.block_size > cp.n_ctx))) {
        msg = "block size must be in [1, n_ctx=" + std::to_string(cp.n_ctx) + "], got " + std::to_string(cp.block_size);
        return CLOVER_ERR_INVALID_ARG;
    }
    if (cp.flash_attn < -1 || cp.flash_attn > 1) {
        msg = "flash_attn must be -1, 0 or 1, got " + std::to_string(cp.flash_attn);
        return CLOVER_ERR_INVALID_ARG;
    }
    if (cp.expert_stats != 0 && cp.expert_stats != 1) {
        msg = "expert_stats must be 0 or 1, got " + std::to_string(cp.expert_stats);
        return CLOVER_ERR_INVALID_ARG;
    }
    return check_coreset(cp.coreset, msg);
}

int check_coreset(int32_t coreset, std::string & msg) {
    if (coreset < 0 && coreset != CLOVER_CORESET_MODEL && coreset != CLOVER_CORESET_AUTO) {
        msg = "coreset must be >= 0 (0 = off), " + std::to_string(CLOVER_CORESET_MODEL) + " (the model's default) or " +
              std::to_string(CLOVER_CORESET_AUTO) + " (auto), got " + std::to_string(coreset);
        return CLOVER_ERR_INVALID_ARG;
    }
    return CLOVER_OK;
}

static int32_t meta_int(const clover_model * m, const std::string & key) {
    char buf[32];
    if (llama_model_meta_val_str(m->lm, key.c_str(), buf, sizeof(buf)) <= 0) {
        return 0;
    }
    char *     end = nullptr;
    const long v   = strtol(buf, &end, 10);
    return end != buf && *end == '\0' && v >= 0 && v <= INT32_MAX ? (int32_t) v : 0;
}

void model_experts(const clover_model * m, int32_t & n_expert, int32_t & n_used) {
    char arch[64];
    if (llama_model_meta_val_str(m->lm, "general.architecture", arch, sizeof(arch)) <= 0) {
        n_expert = n_used = 0;
        return;
    }
    n_expert = meta_int(m, std::string(arch) + ".expert_count");
    n_used   = meta_int(m, std::string(arch) + ".expert_used_count");
}

// CLOVER_CORESET_MODEL -> the GGUF's clover.expert_coreset (0 when absent or not a count >= 0);
// CLOVER_CORESET_AUTO -> the C this context decided (resolve_coreset_auto), else off until the
// next generation decides it (spec/decoding.md, "The block expert coreset")
void set_coreset_rule(clover_context * c, int32_t coreset) {
    const bool is_auto = coreset == CLOVER_CORESET_AUTO;
    c->coreset_auto    = is_auto && c->planner.coreset_auto_C < 0;
    c->coreset         = is_auto ? std::max(0, c->planner.coreset_auto_C) : resolve_coreset(c->model, coreset);
}

int32_t resolve_coreset(const clover_model * m, int32_t coreset) {
    if (coreset != CLOVER_CORESET_MODEL) {
        return coreset;
    }
    return meta_int(m, "clover.expert_coreset");
}

void set_rates(clover_stats & s) {
    s.tokens_per_forward = s.n_decode_forwards > 0 ? (double) s.n_generated / s.n_decode_forwards : 0.0;
    s.tokens_per_second  = s.t_decode_ms > 0 ? s.n_generated / (s.t_decode_ms / 1000.0) : 0.0;
}

gen_setup resolve_generate(const clover_context * ctx, clover_generate_params & gp) {
    const clover_model * m = ctx->model;
    normalise_sampling(gp.temperature, gp.top_k, gp.top_p, m->n_vocab);
    // draft_self = auto: with block_size = auto the mode too is chosen per block, unless a
    // grammar or log-probabilities ask for one mode's records; else block diffusion, or
    // draft-self on a model without a block operator
    if (gp.draft_self == CLOVER_DRAFT_SELF_AUTO && m->mask < 0) {
        gp.draft_self = 0; // no mask token: causal only (auto stays at B = 1, check_mask_token)
    }
    if (gp.draft_self == CLOVER_DRAFT_SELF_AUTO &&
        (gp.block_size != CLOVER_BLOCK_SIZE_AUTO || (gp.grammar && gp.grammar[0]) || gp.logprobs ||
         gp.n_top_logprobs != 0)) {
        gp.draft_self = m->has_block_operator ? 0 : 1;
    }
    gen_setup s;
    s.modes.diffusion   = gp.draft_self != 1 && m->has_block_operator;
    s.modes.draft_self  = gp.draft_self != 0;
    s.modes.draft_steps = gp.draft_steps;
    // a grammar needs the text left to right: without draft-self the call runs at B = 1
    // (the context's B is kept), spec/decoding.md "Grammar"
    s.ar_grammar = gen_grammar::forces_ar(gp);
    // a model without a block operator (the release's layout) never runs block diffusion: auto is
    // B = 1 there, a B > 1 without draft-self is refused (check_block_diffusion)
    s.no_diffusion = !gp.draft_self && !m->has_block_operator;
    s.auto_B       = gp.block_size == CLOVER_BLOCK_SIZE_AUTO && !s.ar_grammar && !s.no_diffusion && m->mask >= 0;
    s.B            = s.ar_grammar                                   ? 1
                     : gp.block_size == CLOVER_BLOCK_SIZE_CONTEXT ? ctx->B
                     : gp.block_size == CLOVER_BLOCK_SIZE_TRAIN   ? training_block_size(m, ctx->n_ctx)
                     : gp.block_size == CLOVER_BLOCK_SIZE_AUTO    ? 1
                                                                    : gp.block_size;
    return s;
}

int64_t positions_needed(const clover_generate_params & gp, int32_t B, int32_t n_prompt, int32_t max_tokens) {
    // (draft-self cuts its canvases at n_ctx: it needs no whole blocks; auto starts at B = 1 and
    // only ever picks a B that fits, auto_fits)
    return gp.draft_self == 1 ? (int64_t) n_prompt + max_tokens
                              : (int64_t) n_prompt + ((int64_t) max_tokens + B - 1) / B * B;
}

// The arguments of clover_generate, checked before anything is touched. B: the block size the
// call starts with (1 for auto until the planner picks).
int check_generate_args(const clover_context * ctx, const clover_generate_params & gp, int32_t B,
                        const int32_t * prompt, int32_t n_prompt, const int32_t * out, int32_t out_cap,
                        std::string & msg) {
    auto bad = [&](int code, std::string what) {
        msg = std::move(what);
        return code;
    };
    if (B < 1 || B > ctx->n_ctx) {
        return bad(CLOVER_ERR_INVALID_ARG, "block size must be in [1, n_ctx=" + std::to_string(ctx->n_ctx) +
                                               "], got " + std::to_string(gp.block_size));
    }
    if (n_prompt < 0 || (n_prompt > 0 && !prompt)) {
        return bad(CLOVER_ERR_INVALID_ARG, "bad prompt (NULL or negative length)");
    }
    if (n_prompt == 0 && gp.max_tokens > 0) {
        return bad(CLOVER_ERR_INVALID_ARG, "empty prompt: the first block is predicted from the prompt's last token");
    }
    if (gp.draft_self == 1 && check_mask_token(ctx->model, "draft-self", msg) != CLOVER_OK) {
        return CLOVER_ERR_INVALID_ARG;
    }
    if (B > 1 && check_mask_token(ctx->model, "block size " + std::to_string(B), msg) != CLOVER_OK) {
        return CLOVER_ERR_INVALID_ARG;
    }
    if (check_tokens(ctx, prompt, n_prompt, msg) != CLOVER_OK) {
        return bad(CLOVER_ERR_INVALID_ARG, "prompt: " + msg);
    }
    if (check_tokens(ctx, gp.stop_tokens, gp.n_stop_tokens, msg) != CLOVER_OK) {
        return bad(CLOVER_ERR_INVALID_ARG, "stop_tokens: " + msg);
    }
    if (gp.max_tokens <= 0) {
        return CLOVER_OK;
    }
    if (!out || out_cap < gp.max_tokens) {
        return bad(CLOVER_ERR_INVALID_ARG, "output buffer too small: out_cap=" + std::to_string(out_cap) +
                                               " < max_tokens=" + std::to_string(gp.max_tokens));
    }
    const int64_t need = positions_needed(gp, B, n_prompt, gp.max_tokens);
    if (need > ctx->n_ctx) {
        return bad(CLOVER_ERR_CONTEXT_FULL,
                   "prompt (" + std::to_string(n_prompt) + " tokens) + max_tokens (" + std::to_string(gp.max_tokens) +
                       ") in blocks of " + std::to_string(B) + " needs " + std::to_string(need) +
                       " positions > n_ctx=" + std::to_string(ctx->n_ctx));
    }
    return CLOVER_OK;
}

} // namespace clover_impl

using namespace clover_impl;

extern "C" {

clover_generate_params clover_generate_default_params(void) {
    clover_generate_params p;
    p.block_size     = CLOVER_BLOCK_SIZE_CONTEXT;
    p.threshold      = 0.9;
    p.max_steps      = 0;
    p.temperature    = 0.0;
    p.top_k          = 0;
    p.top_p          = 1.0;
    p.seed           = 0;
    p.max_tokens     = CLOVER_DEFAULT_MAX_TOKENS;
    p.stop_at_eos    = 1;
    p.step_callback  = nullptr;
    p.block_callback = nullptr;
    p.user_data      = nullptr;
    p.reuse_prefix   = 1;
    p.draft_self     = 0;
    p.draft_steps    = 1;
    p.grammar        = nullptr;
    p.grammar_root   = nullptr;
    p.logprobs       = nullptr;
    p.n_top_logprobs = 0;
    p.top_tokens     = nullptr;
    p.top_logprobs   = nullptr;
    p.stop_tokens    = nullptr;
    p.n_stop_tokens  = 0;
    // llama.cpp's sampler chain, every sampler off (llama-server's defaults for its parameters)
    p.min_p                   = 0.0;
    p.typical_p               = 1.0;
    p.top_n_sigma             = -1.0;
    p.xtc_probability         = 0.0;
    p.xtc_threshold           = 0.1;
    p.repeat_last_n           = 64;
    p.repeat_penalty          = 1.0;
    p.frequency_penalty       = 0.0;
    p.presence_penalty        = 0.0;
    p.dry_multiplier          = 0.0;
    p.dry_base                = 1.75;
    p.dry_allowed_length      = 2;
    p.dry_penalty_last_n      = -1;
    p.dry_sequence_breakers   = nullptr;
    p.n_dry_sequence_breakers = 0;
    p.mirostat                = 0;
    p.mirostat_tau            = 5.0;
    p.mirostat_eta            = 0.1;
    p.logit_bias_tokens       = nullptr;
    p.logit_bias              = nullptr;
    p.n_logit_bias            = 0;
    p.samplers                = nullptr;
    p.dynatemp_range          = 0.0;
    p.dynatemp_exponent       = 1.0;
    p.min_keep                = 0;
    p.draft_callback          = nullptr;
    return p;
}

int clover_generate_params_check(const clover_generate_params * params, char * err, size_t err_len) {
    return check_entry(params, check_params, err, err_len);
}

int clover_set_coreset(clover_context * ctx, int32_t coreset, char * err, size_t err_len) {
    clear_err(err, err_len);
    if (!ctx || !ctx->model) {
        return set_err(err, err_len, CLOVER_ERR_INVALID_ARG, "context is NULL");
    }
    std::string msg;
    if (check_coreset(coreset, msg) != CLOVER_OK) {
        return set_err(err, err_len, CLOVER_ERR_INVALID_ARG, msg);
    }
    set_coreset_rule(ctx, coreset); // read by set_canvas before every decode
    return CLOVER_OK;
}

int32_t clover_coreset(const clover_context * ctx) {
    return !ctx ? -1 : ctx->coreset_auto ? CLOVER_CORESET_AUTO : ctx->coreset;
}

int clover_stats_cut(clover_stats * stats, int32_t n_generated) {
    if (!stats || n_generated < 0) {
        return CLOVER_ERR_INVALID_ARG;
    }
    stats->n_generated = n_generated;
    set_rates(*stats);
    return CLOVER_OK;
}

int32_t clover_generate_room(const clover_context * ctx, const clover_generate_params * params, int32_t n_prompt) {
    if (!ctx || !ctx->model || n_prompt < 0) {
        return -1;
    }
    clover_generate_params gp = params ? *params : clover_generate_default_params();
    gp.max_tokens = 0; // the room does not depend on the budget asked for (clover-cli's -n -1 asks for it)
    std::string            msg;
    if (check_params(gp, msg) != CLOVER_OK) {
        return -1;
    }
    const gen_setup s = resolve_generate(ctx, gp);
    const int64_t          free_ = (int64_t) ctx->n_ctx - n_prompt;
    if (s.B < 1 || free_ <= 0) {
        return 0;
    }
    // the largest m with positions_needed(m) <= n_ctx: all of it without whole blocks, else whole blocks
    const bool whole_blocks = positions_needed(gp, s.B, 0, 1) > 1;
    return (int32_t) (whole_blocks ? free_ / s.B * s.B : free_);
}

} // extern "C"
