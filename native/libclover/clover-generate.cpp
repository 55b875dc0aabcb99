// clover-generate.cpp - block-diffusion decoding of Clover models on llama.cpp (see clover.h): the
// decode loop. The other parts are listed in clover-impl.h.

#include "clover-impl.h"
#include "clover-params.h"
#include "clover-sampling.h"
#include "clover-grammar.h"
#include "clover-logprobs.h"
#include "clover-time.h"
#include "clover-calibration-cache.h"

using namespace clover_impl;

// step() and verify() stay functions of their own, so that a profiler can attribute their cost
// (benchmarks/draft_self_cost.py --callgrind dumps every call of them by name)
#if defined(__GNUC__) || defined(__clang__)
#define CLOVER_NOINLINE __attribute__((noinline))
#else
#define CLOVER_NOINLINE
#endif

namespace {

// One generation (spec/decoding.md): the prompt is committed causally, then decode blocks are
// denoised one by one, each finished block committed by the next block's first pass. Every
// method returns a status; on failure `msg` says why and run() clears the memory.
struct decode_run {
    clover_context *               ctx;
    const clover_generate_params & gp;
    const int32_t *                prompt;
    int32_t                        n_prompt;
    bool                           auto_B;
    int32_t                        B;
    std::string                    msg;
    gen_grammar &                  grammar;  // the token choice under the grammar (clover-grammar.h)
    gen_logprobs &                 logprobs; // the output's log-probabilities (clover-logprobs.h)
    // greedy without a grammar or sampler chain: a row whose confidence nothing reads needs its argmax only
    const bool                     greedy_plain;

    std::mt19937_64          rng;
    pick_work                work;
    int32_t n_commits = 0, n_calls = 0, n_prefill_calls = 0, n_steps = 0, n_blocks = 0, n_switches = 0;
    int32_t n_verifications = 0, n_drafted = 0, n_accepted = 0;
    int32_t finish    = CLOVER_FINISH_MAX_TOKENS;
    std::vector<int32_t> gen;         // generated tokens (uncut)
    int32_t              visible = 0; // gen prefix reported so far (cut at EOS / max_tokens)
    double               t_prefill = 0.0;
    std::chrono::steady_clock::time_point t_start = std::chrono::steady_clock::now();

    std::vector<int32_t>       canvas, pending; // pending: the finished block whose commit rides on the next pass
    std::vector<char>          want;            // logits only for the rows that predict a position of the block (set at its start)
    std::vector<const float *> rows;
    std::vector<int32_t>       masked, cand_tok, order;
    std::vector<double>        cand_conf;
    std::vector<int32_t>       block_out;      // the tokens a finished block adds to the output
    std::vector<float>         verify_logits;  // draft-self: the verifying commit's logits
    std::vector<float>         last_before;    // draft-self: L_last before the verifying commit
    std::vector<float>         draft_q;        // draft-self, temperature > 0: each canvas position's draft distribution
    std::vector<int32_t>       next_canvas;    // draft-self: the next block's canvas in the verification's forward
    std::vector<const float *> vrows;          // draft-self: the verification's rows (row i predicts position i + 1)
    int32_t                    Bc      = 0;     // the current block's canvas length (B; draft-self: within n_ctx)
    bool                       ds      = false; // the current block is draft-self (else block diffusion; B = 1: autoregressive)
    bool                       ds_rows = false; // draft-self: `rows` hold the canvas of the last verification's forward
    auto_modes                 modes;           // block_size = auto: what it may choose besides B = 1
    int32_t                    mode_last        = CLOVER_MODE_NONE;
    int32_t                    n_mode_blocks[4] = { 0, 0, 0, 0 };

    decode_run(clover_context * c, const clover_generate_params & p, const int32_t * pr, int32_t n, bool a, int32_t b,
               gen_grammar & g, gen_logprobs & l)
        : ctx(c), gp(p), prompt(pr), n_prompt(n), auto_B(a), B(b), grammar(g), logprobs(l),
          greedy_plain(p.temperature == 0.0 && !(p.grammar && p.grammar[0]) && !sampler_chain::active(p)),
          rng(p.seed) {}

    // commit the prompt past the reused prefix (L_last: its last token's logits)
    int prefill(int32_t reuse) {
        int rc = CLOVER_OK;
        if (reuse < n_prompt) {
            rc = commit_impl(ctx, prompt + reuse, n_prompt - reuse, nullptr, n_prefill_calls, msg);
        }
        t_prefill = ms_since(t_start);
        if (rc != CLOVER_OK) {
            msg = "prefill: " + msg;
        }
        return rc;
    }

    // the pending block's commit as a forward of its own (no pass to ride on)
    int commit_pending() {
        ds_rows         = false;
        int32_t   calls = 0;
        const int rc    = commit_impl(ctx, pending.data(), (int32_t) pending.size(), nullptr, calls, msg);
        n_calls += calls;
        ++n_commits;
        pending.clear();
        return rc;
    }

    // block size auto, at a block boundary: the (B, mode) cheapest per token (auto_pick), switched
    // to only when it is at least 10% cheaper than the current one, unless the current one is
    // slower than B = 1. The first time no figure exists, one block measures it: block diffusion's
    // tokens per pass at B = 2 (when B = 1 looks best), draft-self's acceptance at B = 8 (only
    // when whole drafts would beat B = 1 on this cost curve).
    int replan() {
        const int32_t   n_left = gp.max_tokens - (int32_t) gen.size();
        const int32_t   at     = ctx->n_committed + (int32_t) pending.size();
        const auto_plan cur{ B, ds && B > 1 };
        auto_plan       next = ctx->planner.pick(ctx->n_ctx, at, n_left, modes);
        int32_t         probe = 0; // draft-self's probe: the largest candidate <= 8 that fits
        for (int32_t b = 2; b <= 8 && n_left >= 2; b *= 2) {
            if (ctx->planner.index(b) >= 0 && auto_fits(ctx->n_ctx, b, at, n_left)) {
                probe = b;
            }
        }
        if (next.B == 1 && modes.diffusion && ctx->planner.tpf_any < 0 && ctx->planner.index(2) >= 0 &&
            auto_fits(ctx->n_ctx, 2, at, n_left)) {
            next = auto_plan{ 2, false };
        } else if (modes.draft_self && ctx->planner.ds_tried_any <= 0.0 && probe > 1 &&
                   ctx->planner.ds_may_pay(modes.draft_steps)) {
            next = auto_plan{ probe, true };
        } else if (next.B > 0 && next != cur && auto_fits(ctx->n_ctx, B, at, n_left)) {
            const clover_planner & pl     = ctx->planner;
            const double           ms_cur = pl.plan_ms(cur, modes.draft_steps);
            const bool             cur_ok = B == 1 || (ms_cur <= pl.plan_ms(auto_plan{ 1, false }, modes.draft_steps) &&
                                                     !pl.measured_slower_than_ar(cur));
            if (cur_ok && !(pl.plan_ms(next, modes.draft_steps) < 0.9 * ms_cur)) {
                next = cur; // not worth a switch (and B still fits)
            }
        }
        if (ctx->planner.measured_slower_than_ar(next)) { // measured: B = 1 is faster here and now
            next = auto_plan{ 1, false };
        }
        if (next.B <= 0 || next == cur) {
            return CLOVER_OK;
        }
        ds_rows = false; // a canvas drafted for another block
        ++n_switches;
        ds = next.ds;
        if (next.B == B) {
            return CLOVER_OK;
        }
        // the pending block rides on the next pass only when both fit one ubatch of this context
        if (!pending.empty() && (!ubatch_fits(ctx, next.B) || (int32_t) pending.size() + next.B > ctx->U)) {
            const int rc = commit_pending();
            if (rc != CLOVER_OK) {
                return rc;
            }
        }
        const int rc = switch_block_size_keep(ctx, next.B, msg);
        if (rc == CLOVER_OK) {
            B = next.B;
        }
        return rc;
    }

    // one denoising step of the current block: position 0's candidate from L_last, position
    // i > 0's from the pass's row i - 1; a pass (fused with the pending commit) only when some
    // masked i > 0 needs one; the unmasked ones are written into the canvas
    CLOVER_NOINLINE int step(int32_t s, int32_t cap) {
        ds_rows = false;
        // (the rows asked for stay the block's first step's, `want`: every pass of a block then has
        // the same shape, so that llama.cpp and the GPU backends replay its graph)
        const bool need_pass = std::any_of(masked.begin(), masked.end(), [](int32_t p) { return p > 0; });
        int rc = CLOVER_OK;
        if (need_pass && !pending.empty() && (int32_t) pending.size() + Bc > ctx->U) {
            rc = commit_pending(); // the two do not fit one ubatch (a context of fewer than 2B positions)
        }
        if (rc != CLOVER_OK) {
            return rc;
        }
        if (need_pass && !pending.empty()) {
            rc = fused_commit_pass(ctx, pending.data(), (int32_t) pending.size(), canvas.data(), Bc, &want, rows, msg);
            pending.clear();
            ++n_commits;
        } else if (need_pass) {
            rc = block_pass_rows(ctx, canvas.data(), Bc, &want, rows, msg);
        } else if (!pending.empty()) {
            rc = commit_pending();
        }
        if (rc != CLOVER_OK) {
            return rc;
        }
        n_steps += need_pass ? 1 : 0;
        pick(s, cap);
        return CLOVER_OK;
    }

    // the candidates of step s from L_last and `rows`, and the unmasking (step cap `cap`)
    void pick(int32_t s, int32_t cap) {
        const clover_model * m  = ctx->model;
        const int32_t        nm = (int32_t) masked.size();
        cand_tok.resize(nm);
        cand_conf.resize(nm);
        order.resize(nm);
        const bool keep_q = ds && gp.temperature > 0.0;
        if (keep_q) {
            draft_q.resize((size_t) B * m->n_vocab);
        }
        // the step cap unmasks every position now, or one is left (select_unmask unmasks at least
        // one): no confidence is read
        const bool all_now = greedy_plain && ((cap > 0 && cap - s <= 1) || nm == 1);
        if (greedy_plain && !all_now) {
            greedy_rows(nm); // (what grammar.pick_at would give: a row's greedy candidate and confidence)
        } else {
            for (int32_t j = 0; j < nm; ++j) {
                const float * row = masked[j] == 0 ? ctx->last_logits.data() : rows[masked[j] - 1];
                if (all_now) {
                    cand_tok[j]  = greedy_candidate(row, m->n_vocab, m->mask);
                    cand_conf[j] = 1.0;
                    continue;
                }
                grammar.pick_at(row, masked[j], gp, rng, work, cand_tok[j], cand_conf[j]);
                if (keep_q) { // the distribution the candidate was drawn from (its final one if unmasked now)
                    std::copy(work.p.begin(), work.p.end(), draft_q.begin() + (size_t) masked[j] * m->n_vocab);
                }
            }
        }
        const int32_t k =
            select_unmask(cand_conf.data(), nm, gp.threshold, cap, s, order.data());
        for (int32_t j = 0; j < k; ++j) {
            const int32_t p = masked[order[j]];
            canvas[p]       = cand_tok[order[j]];
            grammar.unmasked(p, canvas[p]);
            logprobs.unmasked(p, p == 0 ? ctx->last_logits.data() : rows[p - 1], canvas[p]);
        }
        masked.erase(std::remove_if(masked.begin(), masked.end(), [&](int32_t p) { return canvas[p] != m->mask; }),
                     masked.end());
    }

    // greedy_pick of the masked positions' rows (greedy without a grammar or sampler chain: a pure
    // function of each row), over the context's threads when the rows are long: at the release's
    // vocabulary a row's softmax is ~0.5 ms, B of them at every step
    void greedy_rows(int32_t nm) {
        const clover_model * m    = ctx->model;
        auto                 rows_from = [&](int32_t first, int32_t stride) {
            for (int32_t j = first; j < nm; j += stride) {
                const float * row = masked[j] == 0 ? ctx->last_logits.data() : rows[masked[j] - 1];
                greedy_pick(row, m->n_vocab, m->mask, cand_tok[j], cand_conf[j]);
            }
        };
        const int64_t work = (int64_t) nm * m->n_vocab;
        const int32_t nt   = work < (1 << 21) ? 1 : std::min(std::max(1, ctx->n_threads), nm);
        std::vector<std::thread> pool;
        for (int32_t t = 1; t < nt; ++t) {
            pool.emplace_back(rows_from, t, nt);
        }
        rows_from(0, nt);
        for (auto & th : pool) {
            th.join();
        }
    }

    // the finished block's tokens join the output (cut at the first EOS or stop token and at
    // max_tokens; ended = CLOVER_FINISH_EOS / _STOP_TOKEN when one was there); returns the block
    // callback's verdict (nonzero = cancel)
    int take_block(int32_t start, int32_t & ended) {
        gen.insert(gen.end(), block_out.begin(), block_out.end());
        grammar.take_block();
        logprobs.take_block();
        const int32_t eos         = gp.stop_at_eos ? ctx->model->eos : -1;
        int32_t       new_visible = (int32_t) gen.size();
        for (int32_t i = visible; i < (int32_t) gen.size() && !ended; ++i) {
            if (gen[i] == eos && eos >= 0) {
                ended = CLOVER_FINISH_EOS;
            } else if (std::find(gp.stop_tokens, gp.stop_tokens + std::max(0, gp.n_stop_tokens), gen[i]) !=
                       gp.stop_tokens + std::max(0, gp.n_stop_tokens)) {
                ended = CLOVER_FINISH_STOP_TOKEN;
            }
            new_visible = ended ? i : new_visible;
        }
        const int32_t old_visible = visible;
        visible                   = std::max(visible, std::min(new_visible, gp.max_tokens));
        logprobs.publish(gp, old_visible, visible); // (the callback may read the block's logprobs)
        return gp.block_callback ? gp.block_callback(start, gen.data() + old_visible, visible - old_visible,
                                                     gp.user_data)
                                 : 0;
    }

    // decode blocks until EOS, the budget or a cancelling callback
    int run() {
        while (true) {
            if (auto_B && n_blocks > 0) {
                const int rc = replan();
                if (rc != CLOVER_OK) {
                    return rc;
                }
            }
            const int32_t start  = ctx->n_committed + (int32_t) pending.size();
            // positions at or past the budget are never candidates: they stay masked
            const int32_t n_cand = std::min(B, gp.max_tokens - (int32_t) gen.size());
            // a draft-self block may start anywhere (after a rejection): its canvas ends within n_ctx
            Bc = ds ? std::max(n_cand, std::min(B, ctx->n_ctx - start)) : B;
            canvas.assign(B, ctx->model->mask);
            want.assign(B, 0);
            masked.clear();
            for (int32_t i = 0; i < n_cand; ++i) {
                masked.push_back(i);
                want[i] = i + 1 < n_cand; // row i predicts position i + 1
            }
            ++n_blocks;
            const auto t_block = std::chrono::steady_clock::now();
            mode_last = B == 1 ? CLOVER_MODE_AUTOREGRESSIVE : ds ? CLOVER_MODE_DRAFT_SELF : CLOVER_MODE_DIFFUSION;
            ++n_mode_blocks[mode_last];
            bool    cancelled = false;
            int32_t ended     = 0; // CLOVER_FINISH_EOS / _STOP_TOKEN: the block held one
            const bool ds_block = ds && n_cand >= 2; // (a draft of one token is the autoregressive token itself)
            if (ds_block) {
                const int rc = draft_self_block(start, n_cand, cancelled, ended);
                if (rc != CLOVER_OK) {
                    return rc;
                }
            } else {
                int32_t s = 0, passes = n_steps;
                while (!masked.empty() && !cancelled) {
                    const int rc = step(s++, gp.max_steps);
                    if (rc != CLOVER_OK) {
                        return rc;
                    }
                    cancelled = gp.step_callback &&
                                gp.step_callback(start, canvas.data(), B, (int32_t) masked.size(), gp.user_data) != 0;
                }
                if (masked.empty()) {
                    if (!ds) {
                        ctx->planner.observe(B, n_cand, std::max(1, n_steps - passes));
                    }
                    block_out.assign(canvas.begin(), canvas.begin() + n_cand);
                    grammar.block_from_canvas(n_cand);
                    logprobs.block_from_canvas(n_cand);
                    cancelled = take_block(start, ended) != 0 || cancelled;
                }
            }
            // the wall time per token of this block (its forwards carry the previous block's commit;
            // the first block's have none, so it is left out)
            if (auto_B && n_blocks > 1 && !block_out.empty() && (!ds || ds_block)) {
                ctx->planner.observe_ms(auto_plan{ B, ds && B > 1 }, ms_since(t_block) / (double) block_out.size());
            }
            if (cancelled || ended || (int32_t) gen.size() >= gp.max_tokens) {
                finish = cancelled ? CLOVER_FINISH_CANCELLED : ended ? ended : CLOVER_FINISH_MAX_TOKENS;
                return cancelled ? CLOVER_ERR_CANCELLED : CLOVER_OK;
            }
            if (!ds_block) {
                pending = canvas; // committed by the next block's first pass
            }
        }
    }

    // A draft-self block (spec/decoding.md, "Draft-self"): the draft takes at most draft_steps
    // steps (the first one's pass rode on the last verification's forward when that one kept its
    // whole draft), then the verification. The step callback sees the verified tokens only.
    int draft_self_block(int32_t start, int32_t n_cand, bool & cancelled, int32_t & ended) {
        const int32_t cap = gp.draft_steps > 0 ? gp.draft_steps : gp.max_steps;
        int32_t       s   = 0;
        if (ds_rows) {
            ds_rows = false;
            pick(s++, cap);
        }
        while (!masked.empty()) {
            const int rc = step(s++, cap);
            if (rc != CLOVER_OK) {
                return rc;
            }
        }
        if (gp.draft_callback && gp.draft_callback(start, canvas.data(), n_cand, gp.user_data) != 0) {
            cancelled = true; // (nothing of the draft is kept: the memory holds the text before it)
            block_out.clear();
            return CLOVER_OK;
        }
        block_out.assign(canvas.begin(), canvas.begin() + n_cand);
        grammar.block_from_canvas(n_cand);
        logprobs.block_from_canvas(n_cand);
        const int rc = verify(n_cand);
        if (rc != CLOVER_OK) {
            return rc;
        }
        std::fill(canvas.begin(), canvas.end(), ctx->model->mask);
        std::copy(block_out.begin(), block_out.end(), canvas.begin());
        cancelled = gp.step_callback && gp.step_callback(start, canvas.data(), B, B - (int32_t) block_out.size(),
                                                         gp.user_data) != 0;
        cancelled = take_block(start, ended) != 0 || cancelled;
        return CLOVER_OK;
    }

    // Draft-self's verification (spec/decoding.md): the causal commit of the n drafted tokens gives,
    // at each of them, the autoregressive logits, and the same forward runs the next block's first
    // draft pass on a canvas after them (the commit does not see the canvas: its numbers are those
    // of a commit alone). The longest prefix of the draft that equals the greedy autoregressive
    // choices is kept (at temperature > 0: what speculative sampling accepts, against the draft's
    // distributions), plus the autoregressive token after it. All kept: the commit stands and the
    // canvas's rows are the next draft's first step. Else the memory goes back to the text before
    // the draft (a copy on the spare sequence, taken before the forward), the canvas is dropped,
    // and the kept tokens become the pending commit, which rides on the next block's first pass.
    // block_out: the kept tokens.
    CLOVER_NOINLINE int verify(int32_t n) {
        const clover_model * m   = ctx->model;
        const size_t         V   = (size_t) m->n_vocab;
        llama_memory_t       mem = llama_get_memory(ctx->lctx);
        const llama_seq_id   cur = ctx->mem_seq, other = 1 - ctx->mem_seq;
        const int32_t        P   = ctx->n_committed;
        // the next block's canvas, for when the whole draft is kept and that block needs a pass
        // (and, by the cost curve and the running acceptance, when it is likely enough to be used)
        const int32_t left_after = gp.max_tokens - (int32_t) gen.size() - n;
        const int32_t nb         = std::min(B, ctx->n_ctx - (P + n));
        const int32_t nc         = left_after >= 2 && nb >= std::min(B, left_after) && n + nb <= ctx->U &&
                                   ctx->planner.ds_canvas_pays(B, n)
                                       ? nb
                                       : 0;
        last_before.swap(ctx->last_logits); // (back on a rejection; a kept draft sets a new one)
        llama_memory_seq_rm(mem, other, -1, -1);
        llama_memory_seq_cp(mem, cur, other, -1, -1);
        ctx->batch.n_tokens = 0;
        add_to_batch(ctx, canvas.data(), n, P, cur, nullptr, true);
        if (nc > 0) {
            next_canvas.assign(nc, m->mask);
            want.assign(B, 0);
            for (int32_t i = 0; i + 1 < std::min(nc, left_after); ++i) {
                want[i] = 1;
            }
            add_to_batch(ctx, next_canvas.data(), nc, P + n, cur, &want, true);
        }
        set_canvas(ctx, nc);
        const char * what = nc > 0 ? "verification + block pass" : "verification";
        int          rc   = run_decode(ctx, what, msg);
        (nc > 0 ? n_steps : n_calls) += 1;
        ++n_verifications;
        n_drafted += n;
        if (rc == CLOVER_OK) {
            rc = read_rows(ctx, 0, n, nullptr, vrows, what, msg);
        }
        if (rc == CLOVER_OK && nc > 0) {
            rc = read_rows(ctx, n, nc, &want, rows, what, msg);
        }
        if (rc != CLOVER_OK) {
            return rc;
        }
        int32_t k = 0, next = -1;
        double  conf = 0.0;
        auto row_of = [&](int32_t i) { return i == 0 ? last_before.data() : vrows[i - 1]; };
        grammar.verify_begin();
        logprobs.verify_begin();
        for (; k < n; ++k) {
            if (greedy_plain) { // (its confidence is never read)
                next = greedy_candidate(row_of(k), m->n_vocab, m->mask);
            } else {
                grammar.pick(row_of(k), true, gp, rng, work, next, conf); // the grammar-constrained choice, if any
            }
            if (gp.temperature == 0.0 ? next != canvas[k]
                                      : !accept_draft(work.p.data(), draft_q.data() + (size_t) k * V, m->n_vocab,
                                                      canvas[k], rng, next)) {
                break;
            }
            logprobs.verified(row_of(k), canvas[k]);
            grammar.verified(canvas[k]);
        }
        if (k < n) {
            logprobs.verified(row_of(k), next);
            grammar.verified(next);
        }
        n_accepted += k;
        // the acceptance of the positions after the first (the first is the autoregressive token)
        ctx->planner.observe_ds(B, k < n ? std::max(0, k - 1) : n - 1, k < n ? k : n - 1);
        if (k == n) { // all kept: the commit stands, L_last predicts the next block's position 0
            llama_memory_seq_rm(mem, other, -1, -1);
            if (nc > 0) { // the canvas's cells go (see fused_commit_pass)
                llama_memory_seq_cp(mem, cur, other, -1, P + n);
                llama_memory_seq_rm(mem, cur, -1, -1);
                llama_memory_seq_cp(mem, other, cur, -1, -1);
                llama_memory_seq_rm(mem, other, -1, -1);
            }
            ctx->n_committed += n;
            ctx->mem_tokens.insert(ctx->mem_tokens.end(), canvas.begin(), canvas.begin() + n);
            rc      = keep_last_logits(ctx, n - 1, what, msg);
            ds_rows = nc > 0 && rc == CLOVER_OK;
            return rc;
        }
        llama_memory_seq_rm(mem, cur, -1, -1);
        llama_memory_seq_cp(mem, other, cur, -1, -1);
        llama_memory_seq_rm(mem, other, -1, -1);
        ctx->n_committed = P;
        ctx->mem_tokens.resize(P);
        ctx->last_logits.swap(last_before);
        block_out.assign(canvas.begin(), canvas.begin() + k);
        block_out.push_back(next);
        pending = block_out;
        return CLOVER_OK;
    }

    void report(int32_t * out, int32_t * n_out, clover_stats * stats) const {
        const int32_t n_gen = std::min<int32_t>(visible, gp.max_tokens);
        std::copy(gen.begin(), gen.begin() + n_gen, out);
        if (n_out) {
            *n_out = n_gen;
        }
        if (stats) {
            stats->n_generated        = n_gen;
            stats->n_decode_passes    = n_steps;
            stats->n_steps            = n_steps;
            stats->n_commits          = n_commits;
            stats->n_forward          = n_prefill_calls + n_steps + n_calls;
            stats->n_blocks           = n_blocks;
            stats->block_size         = B;
            stats->n_block_switches   = n_switches;
            stats->finish_reason      = finish;
            stats->t_prefill_ms       = t_prefill;
            stats->t_decode_ms        = ms_since(t_start) - t_prefill;
            stats->calibration        = ctx->planner.last_calibration;
            stats->n_verifications    = n_verifications;
            stats->n_drafted          = n_drafted;
            stats->n_accepted         = n_accepted;
            stats->n_decode_forwards  = n_steps + n_calls;
            set_rates(*stats); // tokens_per_forward, tokens_per_second
            stats->mode                = mode_last;
            stats->n_blocks_ar         = n_mode_blocks[CLOVER_MODE_AUTOREGRESSIVE];
            stats->n_blocks_diffusion  = n_mode_blocks[CLOVER_MODE_DIFFUSION];
            stats->n_blocks_draft_self = n_mode_blocks[CLOVER_MODE_DRAFT_SELF];
            stats->tokens_per_verification =
                n_verifications > 0 ? (double) (n_accepted + n_verifications) / n_verifications : 0.0;
        }
        grammar.report(stats);
    }
};

} // namespace

extern "C" {

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
        clover_generate_params gp = params ? *params : clover_generate_default_params();
        std::string            msg;
        if (check_params(gp, msg) != CLOVER_OK) { // the rules that need no context (clover-params.cpp)
            return set_err(err, err_len, CLOVER_ERR_INVALID_ARG, msg);
        }
        const gen_setup setup      = resolve_generate(ctx, gp); // normalises gp
        const bool      ar_grammar = setup.ar_grammar, no_diffusion = setup.no_diffusion, auto_B = setup.auto_B;
        const auto_modes & modes   = setup.modes;
        int32_t         B          = setup.B;
        gen_grammar  grammar;
        gen_logprobs logprobs;
        int         rc = check_generate_args(ctx, gp, B, prompt, n_prompt, out, out_cap, msg);
        if (rc == CLOVER_OK && no_diffusion && !ar_grammar) {
            rc = check_block_diffusion(ctx->model, B, msg);
        }
        if (rc == CLOVER_OK) {
            rc = grammar.init(ctx, gp, prompt, n_prompt, msg);
            logprobs.init(ctx->model, gp);
        }
        if (rc != CLOVER_OK || gp.max_tokens <= 0) {
            return rc == CLOVER_OK ? rc : set_err(err, err_len, rc, msg);
        }
        // prefix reuse: when the prompt starts with the committed tokens, they stay committed
        // (the memory is the same for every B) and only the rest of the prompt is committed
        ctx->planner.last_calibration = 0;
        if (ctx->coreset_auto) { // (before prefix reuse: measuring empties the memory)
            rc = resolve_coreset_auto(ctx, msg);
            if (rc != CLOVER_OK) {
                return set_err(err, err_len, rc, "coreset auto: " + msg);
            }
        }
        const int32_t nc     = ctx->n_committed;
        const bool    prefix = gp.reuse_prefix && ctx->lctx && nc > 0 && nc <= n_prompt &&
                            (int32_t) ctx->mem_tokens.size() == nc &&
                            std::equal(ctx->mem_tokens.begin(), ctx->mem_tokens.end(), prompt);
        auto_plan plan{ B, gp.draft_self == 1 };
        if (auto_B) {
            if (ctx->planner.sizes.empty()) {
                rc = calibrate_cached(ctx, msg);
                if (rc != CLOVER_OK) {
                    return set_err(err, err_len, rc, "block-size calibration: " + msg);
                }
            }
            plan = ctx->planner.pick(ctx->n_ctx, n_prompt, gp.max_tokens, modes); // blocks start right after the prompt
            if (ctx->planner.measured_slower_than_ar(plan)) { // as at every block boundary (replan): a generation's
                plan = auto_plan{ 1, false };                   // first block is never timed, so only this keeps it out
            }
            B = plan.B;
        }
        const int32_t reuse = prefix ? nc : 0;
        if (reuse > 0) {
            rc = switch_block_size_keep(ctx, ar_grammar ? ctx->B : B, msg);
        } else {
            rc = set_block_size_impl(ctx, ar_grammar ? ctx->B : B, msg);
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

        decode_run run(ctx, gp, prompt, n_prompt, auto_B, B, grammar, logprobs);
        run.modes = modes;
        run.ds    = plan.ds && B > 1;
        ctx->experts.reset(); // (after a calibration's passes)
        rc = run.prefill(reuse);
        const int64_t graphs_reused_before = ctx->n_graphs_reused;
        if (rc == CLOVER_OK) {
            try {
                rc = run.run();
            } catch (const input_error & e) { // (through the one error exit below: the memory is cleared)
                run.msg = e.what();
                rc      = CLOVER_ERR_INVALID_ARG;
            }
        }
        if (stats) {
            stats->n_graphs_reused = (int32_t) (ctx->n_graphs_reused - graphs_reused_before);
            if (ctx->expert_stats) {
                report_experts(ctx, stats);
            }
        }
        if (rc != CLOVER_OK && rc != CLOVER_ERR_CANCELLED) { // the one error exit
            run.finish = CLOVER_FINISH_NONE;
            clear_memory(ctx); // a failed step may leave the memory half written: never reuse it
        }
        run.report(out, n_out, stats);
        if (rc == CLOVER_ERR_CANCELLED) {
            return set_err(err, err_len, rc, "cancelled by a callback");
        }
        return rc == CLOVER_OK ? rc : set_err(err, err_len, rc, run.msg);
    });
}

} // extern "C"
