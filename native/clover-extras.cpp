// clover-extras.cpp - what a clover_generate call adds to the decode loop besides decoding:
// constrained decoding by a GBNF grammar and the log-probabilities of the output
// (clover_detail::gen_extras, declared in clover-impl.h; spec/decoding.md, "Grammar").

#include "clover-impl.h"

namespace clover_detail {

// Bounds on what llama.cpp's grammar code does recursively (a parenthesised group per nesting
// level, a rule reference per rule in a chain): past them a hostile grammar would overflow the
// stack; and on its size. A lexical scan (strings, character classes and comments skipped).
static bool grammar_within_limits(const char * g, std::string & msg) {
    constexpr int    MAX_DEPTH = 500, MAX_RULES = 5000;
    constexpr size_t MAX_BYTES = 1 << 20; // (a JSON schema's grammar is a few KB)
    const size_t     n         = strlen(g);
    if (n > MAX_BYTES) {
        msg = "invalid grammar: " + std::to_string(n) + " bytes (at most " + std::to_string(MAX_BYTES) + ")";
        return false;
    }
    int depth = 0, max_depth = 0, rules = 0;
    for (const char * p = g; *p; ++p) {
        if (*p == '"' || *p == '[') {
            const char close = *p == '"' ? '"' : ']';
            for (++p; *p && *p != close; ++p) {
                if (*p == '\\' && p[1]) {
                    ++p;
                }
            }
            if (!*p) {
                break;
            }
        } else if (*p == '#') {
            while (p[1] && p[1] != '\n') {
                ++p;
            }
        } else if (*p == '(') {
            max_depth = std::max(max_depth, ++depth);
        } else if (*p == ')') {
            --depth;
        } else if (p[0] == ':' && p[1] == ':' && p[2] == '=') {
            ++rules;
        }
    }
    if (max_depth > MAX_DEPTH) {
        msg = "invalid grammar: groups nested " + std::to_string(max_depth) + " deep (at most " +
              std::to_string(MAX_DEPTH) + ")";
        return false;
    }
    if (rules > MAX_RULES) {
        msg = "invalid grammar: " + std::to_string(rules) + " rules (at most " + std::to_string(MAX_RULES) + ")";
        return false;
    }
    return true;
}

gen_extras::~gen_extras() {
    if (draft) {
        llama_sampler_free(draft);
    }
    if (smpl) {
        llama_sampler_free(smpl);
    }
}

bool gen_extras::forces_ar(const clover_generate_params & gp) {
    return gp.grammar && gp.grammar[0] && gp.draft_self != 1; // (draft_self auto included)
}

int gen_extras::init(const clover_model * m, const clover_generate_params & gp, std::string & msg) {
    model      = m;
    draft_self = gp.draft_self == 1;
    // (the ranges of n_top_logprobs and block_size: clover_impl::check_params, checked first)
    n_top   = gp.n_top_logprobs;
    want_lp = gp.logprobs != nullptr || n_top > 0;
    if (gp.grammar && gp.grammar[0]) {
        const char * root = gp.grammar_root && gp.grammar_root[0] ? gp.grammar_root : "root";
        if (!grammar_within_limits(gp.grammar, msg)) {
            return CLOVER_ERR_INVALID_ARG;
        }
        clover_impl::g_last_log_error.clear();
        smpl = llama_sampler_init_grammar(m->vocab, gp.grammar, root);
        if (!smpl) {
            std::string why = clover_impl::last_log_error();
            for (const char * noise : { "; failed to parse grammar", "parse: " }) {
                const size_t at = why.find(noise);
                if (at != std::string::npos && why.size() > strlen(noise)) {
                    why.erase(at, strlen(noise));
                }
            }
            const size_t nl = why.find('\n');
            if (nl != std::string::npos) {
                why.erase(nl);
            }
            if (why.size() > 300) {
                why = why.substr(0, 300) + "...";
            }
            msg = "invalid grammar" + (why.empty() ? std::string() : ": " + why);
            return CLOVER_ERR_INVALID_ARG;
        }
        cur.resize(m->n_vocab);
        constrained.resize(m->n_vocab);
    }
    return CLOVER_OK;
}

bool gen_extras::allows(llama_sampler * g, int32_t tok) const {
    if (model->eos >= 0 && tok != model->eos && llama_vocab_is_eog(model->vocab, tok)) {
        return false; // the output ends at EOS only (an end-of-turn token would not stop it)
    }
    llama_token_data       one{ tok, 0.0f, 0.0f };
    llama_token_data_array arr{ &one, 1, -1, false };
    llama_sampler_apply(g, &arr);
    return one.logit != -std::numeric_limits<float>::infinity();
}

void gen_extras::accept(int32_t tok) {
    if (smpl && allows(smpl, tok)) { // (a token the grammar refuses is only ever the stuck case's EOS)
        llama_sampler_accept(smpl, tok);
    }
}

void gen_extras::pick(const float * row, bool next, const clover_generate_params & gp, std::mt19937_64 & rng,
                      pick_work & w, int32_t & tok, double & conf) {
    if (!smpl || !next) {
        pick_candidate(row, model->n_vocab, model->mask, gp.temperature, gp.top_k, gp.top_p, rng, w, tok, conf);
        return;
    }
    pick_in(smpl, row, gp, rng, w, tok, conf);
}

void gen_extras::pick_at(const float * row, int32_t p, const clover_generate_params & gp, std::mt19937_64 & rng,
                         pick_work & w, int32_t & tok, double & conf) {
    if (!smpl || p == 0 || !draft_self) { // (without draft-self a grammar runs at B = 1: p is 0)
        pick(row, p == 0, gp, rng, w, tok, conf);
        if (smpl && draft_self) { // a new step of the draft (its positions come in order)
            note_candidate(0, tok);
        }
        return;
    }
    // a draft position: the grammar, run (on a copy) over the draft before it - the tokens
    // already unmasked and this step's candidates of the masked ones - constrains it too, so that
    // the draft stays in the grammar and can be accepted (the verification decides either way)
    if (p <= draft_n - 1 || !draft) { // a new step: start again from the grammar's state
        if (draft) {
            llama_sampler_free(draft);
        }
        draft      = llama_sampler_clone(smpl);
        draft_n    = 0;
        draft_dead = false;
    }
    for (; !draft_dead && draft_n < p; ++draft_n) {
        const int32_t t = draft_n < (int32_t) canvas_tok.size() && canvas_tok[draft_n] >= 0 ? canvas_tok[draft_n]
                          : draft_n < (int32_t) step_cand.size()                            ? step_cand[draft_n]
                                                                                             : -1;
        if (t < 0 || !allows(draft, t)) {
            draft_dead = true; // the draft already left the grammar: the rest of this step is free
            break;
        }
        llama_sampler_accept(draft, t);
    }
    if (draft_dead) {
        pick(row, false, gp, rng, w, tok, conf);
    } else {
        pick_in(draft, row, gp, rng, w, tok, conf);
    }
    note_candidate(p, tok);
}

void gen_extras::note_candidate(int32_t p, int32_t tok) {
    if ((int32_t) step_cand.size() <= p) {
        step_cand.resize(p + 1, -1);
    }
    step_cand[p] = tok;
    if (p == 0) {
        draft_n = 0; // (position 0 is the grammar's own next position: the draft copy restarts)
        if (draft) {
            llama_sampler_free(draft);
            draft = nullptr;
        }
        draft_dead = false;
    }
}

void gen_extras::pick_in(llama_sampler * g, const float * row, const clover_generate_params & gp,
                         std::mt19937_64 & rng, pick_work & w, int32_t & tok, double & conf) {
    const int32_t V = model->n_vocab;
    if (gp.temperature == 0.0) { // greedy: the free argmax, when the grammar allows it, is the constrained one
        pick_candidate(row, V, model->mask, 0.0, gp.top_k, gp.top_p, rng, w, tok, conf);
        if (allows(g, tok)) {
            return;
        }
    }
    for (int32_t i = 0; i < V; ++i) {
        cur[i] = llama_token_data{ i, row[i], 0.0f };
    }
    llama_token_data_array arr{ cur.data(), (size_t) V, -1, false };
    llama_sampler_apply(g, &arr);
    bool any = false;
    for (int32_t i = 0; i < V; ++i) {
        const bool other_end = model->eos >= 0 && i != model->eos && llama_vocab_is_eog(model->vocab, i);
        constrained[i]       = other_end ? -std::numeric_limits<float>::infinity() : cur[i].logit;
        any = any || (i != model->mask && constrained[i] > -std::numeric_limits<float>::infinity());
    }
    if (!any) { // no token of the vocabulary continues the grammar: the output ends here, as at EOS
        if (model->eos < 0) {
            throw std::runtime_error("grammar: no token of the vocabulary can continue the output, and the model "
                                     "has no EOS token");
        }
        tok  = model->eos;
        conf = 1.0;
        w.p.assign(V, 0.0); // the distribution it was chosen from (draft-self's acceptance reads it)
        w.p[tok] = 1.0;
        return;
    }
    pick_candidate(constrained.data(), V, model->mask, gp.temperature, gp.top_k, gp.top_p, rng, w, tok, conf);
}

void gen_extras::record(const float * row, int32_t tok, float & lp, int32_t * top_tok, float * top_lp) {
    const int32_t V    = model->n_vocab;
    const int32_t mask = model->mask;
    const double  NEG  = -std::numeric_limits<double>::infinity();
    double        mx   = NEG;
    for (int32_t i = 0; i < V; ++i) {
        if (i != mask && row[i] == row[i]) {
            mx = std::max(mx, (double) row[i]);
        }
    }
    double sum = 0.0;
    if (mx > NEG && mx < -NEG) {
        for (int32_t i = 0; i < V; ++i) {
            if (i != mask && row[i] == row[i]) {
                sum += std::exp((double) row[i] - mx);
            }
        }
    }
    // infinite or absent logits: the distribution is degenerate, reported as 0 / -inf
    auto logp = [&](int32_t i) -> double {
        const double l = row[i];
        if (i == mask || l != l) {
            return NEG;
        }
        if (!(mx > NEG && mx < -NEG)) {
            return l == mx ? 0.0 : NEG;
        }
        return l - mx - std::log(sum);
    };
    lp = (float) logp(tok);
    if (n_top > 0) {
        idx.resize(V);
        for (int32_t i = 0; i < V; ++i) {
            idx[i] = i;
        }
        auto key = [&](int32_t i) { return i == mask || row[i] != row[i] ? NEG : (double) row[i]; };
        const int32_t n = std::min(n_top, V);
        std::partial_sort(idx.begin(), idx.begin() + n, idx.end(), [&](int32_t a, int32_t b) {
            const double ka = key(a), kb = key(b);
            return ka > kb || (ka == kb && a < b);
        });
        for (int32_t j = 0; j < n_top; ++j) {
            top_tok[j] = j < n ? idx[j] : -1;
            top_lp[j]  = j < n ? (float) logp(idx[j]) : (float) NEG;
        }
    }
}

void gen_extras::unmasked(int32_t p, const float * row, int32_t tok) {
    // (the block's tokens are final only at take_block: a draft-self canvas is a draft)
    if ((int32_t) canvas_tok.size() <= p) {
        canvas_tok.resize(p + 1, -1);
    }
    canvas_tok[p] = tok;
    if (want_lp) {
        if ((int32_t) canvas_lp.size() <= p) {
            canvas_lp.resize(p + 1);
            canvas_top_tok.resize((size_t) (p + 1) * n_top);
            canvas_top_lp.resize((size_t) (p + 1) * n_top);
        }
        record(row, tok, canvas_lp[p], canvas_top_tok.data() + (size_t) p * n_top,
               canvas_top_lp.data() + (size_t) p * n_top);
    }
}

void gen_extras::block_from_canvas(int32_t n) {
    n = std::min<int32_t>(n, (int32_t) canvas_tok.size());
    block_tok.assign(canvas_tok.begin(), canvas_tok.begin() + n);
    block_verified = false;
    if (!want_lp) {
        return;
    }
    n = std::min<int32_t>(n, (int32_t) canvas_lp.size());
    block_lp.assign(canvas_lp.begin(), canvas_lp.begin() + n);
    block_top_tok.assign(canvas_top_tok.begin(), canvas_top_tok.begin() + (size_t) n * n_top);
    block_top_lp.assign(canvas_top_lp.begin(), canvas_top_lp.begin() + (size_t) n * n_top);
}

void gen_extras::verify_begin() {
    block_tok.clear();
    block_verified = true;
    block_lp.clear();
    block_top_tok.clear();
    block_top_lp.clear();
}

void gen_extras::verified(const float * row, int32_t tok) {
    block_tok.push_back(tok);
    if (want_lp) {
        block_lp.push_back(0.0f);
        block_top_tok.resize(block_top_tok.size() + n_top);
        block_top_lp.resize(block_top_lp.size() + n_top);
        record(row, tok, block_lp.back(), block_top_tok.data() + block_top_tok.size() - n_top,
               block_top_lp.data() + block_top_lp.size() - n_top);
    }
    accept(tok); // the verification's next position is constrained given this one
}

void gen_extras::take_block() {
    if (!block_verified) { // a block decoded without a verification (block size 1): the grammar takes it now
        for (int32_t t : block_tok) {
            accept(t);
        }
    }
    block_tok.clear();
    block_verified = false;
    std::fill(canvas_tok.begin(), canvas_tok.end(), -1);
    if (draft) { // the next block's draft starts from the grammar's state after this block
        llama_sampler_free(draft);
        draft = nullptr;
    }
    draft_n    = 0;
    draft_dead = false;
    std::fill(step_cand.begin(), step_cand.end(), -1);
    if (!want_lp) {
        return;
    }
    gen_lp.insert(gen_lp.end(), block_lp.begin(), block_lp.end());
    gen_top_tok.insert(gen_top_tok.end(), block_top_tok.begin(), block_top_tok.end());
    gen_top_lp.insert(gen_top_lp.end(), block_top_lp.begin(), block_top_lp.end());
    block_lp.clear();
    block_top_tok.clear();
    block_top_lp.clear();
}

void gen_extras::publish(const clover_generate_params & gp, int32_t from, int32_t to) const {
    if (!want_lp || to <= from) {
        return;
    }
    // (a token without a record: NaN, and -1 for its top tokens)
    const float   nan  = std::numeric_limits<float>::quiet_NaN();
    const int32_t have = std::min<int32_t>(to, (int32_t) gen_lp.size());
    for (int32_t i = from; i < to; ++i) {
        if (gp.logprobs) {
            gp.logprobs[i] = i < have ? gen_lp[i] : nan;
        }
        for (size_t j = (size_t) i * n_top; j < (size_t) (i + 1) * n_top; ++j) {
            gp.top_tokens[j]   = i < have ? gen_top_tok[j] : -1;
            gp.top_logprobs[j] = i < have ? gen_top_lp[j] : nan;
        }
    }
}

void gen_extras::report(clover_stats * stats) const {
    if (stats) {
        stats->grammar_mode = !smpl ? 0 : draft_self ? 2 : 1;
    }
}

} // namespace clover_detail
