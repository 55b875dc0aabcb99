// clover.cpp - block-diffusion decoding of Clover models on llama.cpp (see clover.h): the
// decode loop. The other parts are listed in clover-impl.h.

#include "clover-impl.h"

using namespace clover_impl;

extern "C" {

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
