// clover-params.h - the rules of clover_generate's and a context's parameters (clover-params.cpp;
// not installed).
#pragma once

#include "clover-impl.h"

namespace clover_impl {

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
int32_t resolve_coreset(const clover_model * m, int32_t coreset); // (not CLOVER_CORESET_AUTO)
void    set_coreset_rule(clover_context * c, int32_t coreset);
// the model's routed experts per layer and per token (its GGUF keys <arch>.expert_count, expert_used_count)
void model_experts(const clover_model * m, int32_t & n_expert, int32_t & n_used);
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
