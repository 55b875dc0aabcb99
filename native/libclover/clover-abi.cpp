// clover-abi.cpp - what a binding checks at load (clover_api_version, clover_abi_query): the
// size and alignment of every public struct, the offset of every field, the field counts and
// the values of the named constants, as this build of clover.h has them. One table; a binding
// (clover_cpp/_native.py) compares its own declarations with it, and tests/native/test_abi.py checks
// that the table lists every field clover.h declares.

#include "clover.h"

#include <cstddef>
#include <cstring>

namespace {

struct abi_entry {
    const char * name;
    int64_t      value;
};

#define CLOVER_ABI_STRUCT(S) { "sizeof " #S, (int64_t) sizeof(S) }, { "alignof " #S, (int64_t) alignof(S) }
#define CLOVER_ABI_FIELD(S, F) { "offsetof " #S "." #F, (int64_t) offsetof(S, F) }
#define CLOVER_ABI_VALUE(N) { "value " #N, (int64_t) (N) }

const abi_entry k_abi[] = {
    CLOVER_ABI_STRUCT(clover_model_params),
    CLOVER_ABI_FIELD(clover_model_params, n_gpu_layers),
    CLOVER_ABI_FIELD(clover_model_params, use_mmap),
    CLOVER_ABI_FIELD(clover_model_params, use_mlock),
    CLOVER_ABI_FIELD(clover_model_params, rpc_servers),
    CLOVER_ABI_FIELD(clover_model_params, tensor_split),
    CLOVER_ABI_FIELD(clover_model_params, n_tensor_split),
    CLOVER_ABI_FIELD(clover_model_params, tensor_overrides),

    CLOVER_ABI_STRUCT(clover_context_params),
    CLOVER_ABI_FIELD(clover_context_params, n_ctx),
    CLOVER_ABI_FIELD(clover_context_params, n_threads),
    CLOVER_ABI_FIELD(clover_context_params, block_size),
    CLOVER_ABI_FIELD(clover_context_params, flash_attn),
    CLOVER_ABI_FIELD(clover_context_params, kv_f32),
    CLOVER_ABI_FIELD(clover_context_params, calib_cache),
    CLOVER_ABI_FIELD(clover_context_params, coreset),
    CLOVER_ABI_FIELD(clover_context_params, expert_stats),

    CLOVER_ABI_STRUCT(clover_generate_params),
    CLOVER_ABI_FIELD(clover_generate_params, block_size),
    CLOVER_ABI_FIELD(clover_generate_params, threshold),
    CLOVER_ABI_FIELD(clover_generate_params, max_steps),
    CLOVER_ABI_FIELD(clover_generate_params, temperature),
    CLOVER_ABI_FIELD(clover_generate_params, top_k),
    CLOVER_ABI_FIELD(clover_generate_params, top_p),
    CLOVER_ABI_FIELD(clover_generate_params, seed),
    CLOVER_ABI_FIELD(clover_generate_params, max_tokens),
    CLOVER_ABI_FIELD(clover_generate_params, stop_at_eos),
    CLOVER_ABI_FIELD(clover_generate_params, step_callback),
    CLOVER_ABI_FIELD(clover_generate_params, block_callback),
    CLOVER_ABI_FIELD(clover_generate_params, user_data),
    CLOVER_ABI_FIELD(clover_generate_params, reuse_prefix),
    CLOVER_ABI_FIELD(clover_generate_params, draft_self),
    CLOVER_ABI_FIELD(clover_generate_params, grammar),
    CLOVER_ABI_FIELD(clover_generate_params, grammar_root),
    CLOVER_ABI_FIELD(clover_generate_params, logprobs),
    CLOVER_ABI_FIELD(clover_generate_params, n_top_logprobs),
    CLOVER_ABI_FIELD(clover_generate_params, top_tokens),
    CLOVER_ABI_FIELD(clover_generate_params, top_logprobs),
    CLOVER_ABI_FIELD(clover_generate_params, draft_steps),
    CLOVER_ABI_FIELD(clover_generate_params, stop_tokens),
    CLOVER_ABI_FIELD(clover_generate_params, n_stop_tokens),
    CLOVER_ABI_FIELD(clover_generate_params, min_p),
    CLOVER_ABI_FIELD(clover_generate_params, typical_p),
    CLOVER_ABI_FIELD(clover_generate_params, top_n_sigma),
    CLOVER_ABI_FIELD(clover_generate_params, xtc_probability),
    CLOVER_ABI_FIELD(clover_generate_params, xtc_threshold),
    CLOVER_ABI_FIELD(clover_generate_params, repeat_last_n),
    CLOVER_ABI_FIELD(clover_generate_params, repeat_penalty),
    CLOVER_ABI_FIELD(clover_generate_params, frequency_penalty),
    CLOVER_ABI_FIELD(clover_generate_params, presence_penalty),
    CLOVER_ABI_FIELD(clover_generate_params, dry_multiplier),
    CLOVER_ABI_FIELD(clover_generate_params, dry_base),
    CLOVER_ABI_FIELD(clover_generate_params, dry_allowed_length),
    CLOVER_ABI_FIELD(clover_generate_params, dry_penalty_last_n),
    CLOVER_ABI_FIELD(clover_generate_params, dry_sequence_breakers),
    CLOVER_ABI_FIELD(clover_generate_params, n_dry_sequence_breakers),
    CLOVER_ABI_FIELD(clover_generate_params, mirostat),
    CLOVER_ABI_FIELD(clover_generate_params, mirostat_tau),
    CLOVER_ABI_FIELD(clover_generate_params, mirostat_eta),
    CLOVER_ABI_FIELD(clover_generate_params, logit_bias_tokens),
    CLOVER_ABI_FIELD(clover_generate_params, logit_bias),
    CLOVER_ABI_FIELD(clover_generate_params, n_logit_bias),
    CLOVER_ABI_FIELD(clover_generate_params, samplers),
    CLOVER_ABI_FIELD(clover_generate_params, dynatemp_range),
    CLOVER_ABI_FIELD(clover_generate_params, dynatemp_exponent),
    CLOVER_ABI_FIELD(clover_generate_params, min_keep),
    CLOVER_ABI_FIELD(clover_generate_params, draft_callback),

    CLOVER_ABI_STRUCT(clover_stats),
    CLOVER_ABI_FIELD(clover_stats, n_prompt),
    CLOVER_ABI_FIELD(clover_stats, n_generated),
    CLOVER_ABI_FIELD(clover_stats, n_forward),
    CLOVER_ABI_FIELD(clover_stats, n_decode_passes),
    CLOVER_ABI_FIELD(clover_stats, n_steps),
    CLOVER_ABI_FIELD(clover_stats, n_commits),
    CLOVER_ABI_FIELD(clover_stats, n_blocks),
    CLOVER_ABI_FIELD(clover_stats, finish_reason),
    CLOVER_ABI_FIELD(clover_stats, tokens_per_forward),
    CLOVER_ABI_FIELD(clover_stats, t_prefill_ms),
    CLOVER_ABI_FIELD(clover_stats, t_decode_ms),
    CLOVER_ABI_FIELD(clover_stats, tokens_per_second),
    CLOVER_ABI_FIELD(clover_stats, block_size),
    CLOVER_ABI_FIELD(clover_stats, n_block_switches),
    CLOVER_ABI_FIELD(clover_stats, calibration),
    CLOVER_ABI_FIELD(clover_stats, n_reused),
    CLOVER_ABI_FIELD(clover_stats, n_verifications),
    CLOVER_ABI_FIELD(clover_stats, n_drafted),
    CLOVER_ABI_FIELD(clover_stats, n_accepted),
    CLOVER_ABI_FIELD(clover_stats, n_decode_forwards),
    CLOVER_ABI_FIELD(clover_stats, grammar_mode),
    CLOVER_ABI_FIELD(clover_stats, mode),
    CLOVER_ABI_FIELD(clover_stats, n_blocks_ar),
    CLOVER_ABI_FIELD(clover_stats, n_blocks_diffusion),
    CLOVER_ABI_FIELD(clover_stats, n_blocks_draft_self),
    CLOVER_ABI_FIELD(clover_stats, tokens_per_verification),
    CLOVER_ABI_FIELD(clover_stats, n_graphs_reused),
    CLOVER_ABI_FIELD(clover_stats, n_expert_passes),
    CLOVER_ABI_FIELD(clover_stats, experts_per_pass),
    CLOVER_ABI_FIELD(clover_stats, expert_bytes_per_pass),
    CLOVER_ABI_FIELD(clover_stats, expert_bytes_b1),

    CLOVER_ABI_VALUE(CLOVER_API_VERSION),
    CLOVER_ABI_VALUE(CLOVER_OK),
    CLOVER_ABI_VALUE(CLOVER_ERR_INVALID_ARG),
    CLOVER_ABI_VALUE(CLOVER_ERR_LOAD),
    CLOVER_ABI_VALUE(CLOVER_ERR_DECODE),
    CLOVER_ABI_VALUE(CLOVER_ERR_CANCELLED),
    CLOVER_ABI_VALUE(CLOVER_ERR_CONTEXT_FULL),
    CLOVER_ABI_VALUE(CLOVER_ERR_BUFFER_TOO_SMALL),
    CLOVER_ABI_VALUE(CLOVER_ERR_INTERNAL),
    CLOVER_ABI_VALUE(CLOVER_FINISH_NONE),
    CLOVER_ABI_VALUE(CLOVER_FINISH_EOS),
    CLOVER_ABI_VALUE(CLOVER_FINISH_MAX_TOKENS),
    CLOVER_ABI_VALUE(CLOVER_FINISH_CANCELLED),
    CLOVER_ABI_VALUE(CLOVER_FINISH_STOP_TOKEN),
    CLOVER_ABI_VALUE(CLOVER_MODE_NONE),
    CLOVER_ABI_VALUE(CLOVER_MODE_AUTOREGRESSIVE),
    CLOVER_ABI_VALUE(CLOVER_MODE_DIFFUSION),
    CLOVER_ABI_VALUE(CLOVER_MODE_DRAFT_SELF),
    CLOVER_ABI_VALUE(CLOVER_BLOCK_SIZE_TRAIN),
    CLOVER_ABI_VALUE(CLOVER_BLOCK_SIZE_AUTO),
    CLOVER_ABI_VALUE(CLOVER_BLOCK_SIZE_CONTEXT),
    CLOVER_ABI_VALUE(CLOVER_DRAFT_SELF_AUTO),
    CLOVER_ABI_VALUE(CLOVER_CORESET_MODEL),
    CLOVER_ABI_VALUE(CLOVER_CORESET_AUTO),
    CLOVER_ABI_VALUE(CLOVER_MAX_TOP_LOGPROBS),
    CLOVER_ABI_VALUE(CLOVER_DEFAULT_MAX_TOKENS),
};

#undef CLOVER_ABI_STRUCT
#undef CLOVER_ABI_FIELD
#undef CLOVER_ABI_VALUE

} // namespace

extern "C" {

int32_t clover_api_version(void) { return CLOVER_API_VERSION; }

int64_t clover_abi_query(const char * what) {
    if (!what) {
        return -1;
    }
    // "fields S": how many fields the table lists for struct S
    if (!strncmp(what, "fields ", 7)) {
        const size_t n = strlen(what + 7);
        int64_t      count = 0;
        bool         known = false;
        for (const abi_entry & e : k_abi) {
            if (!strncmp(e.name, "sizeof ", 7) && !strcmp(e.name + 7, what + 7)) {
                known = true;
            }
            if (!strncmp(e.name, "offsetof ", 9) && !strncmp(e.name + 9, what + 7, n) && e.name[9 + n] == '.') {
                ++count;
            }
        }
        return known ? count : -1;
    }
    // "known Q": 1 when query Q is in the table (a "value" may itself be -1), else 0
    const bool known = !strncmp(what, "known ", 6);
    for (const abi_entry & e : k_abi) {
        if (!strcmp(e.name, known ? what + 6 : what)) {
            return known ? 1 : e.value;
        }
    }
    return known ? 0 : -1;
}

} // extern "C"
