// clover-logprobs.cpp - the log-probabilities of a call's output tokens and the most likely tokens
// at each (gen_logprobs, declared in clover-logprobs.h).

#include "clover-impl.h"
#include "clover-logprobs.h"

namespace clover_impl {

void gen_logprobs::init(const clover_model * m, const clover_generate_params & gp) {
    model   = m;
    n_top   = gp.n_top_logprobs;
    want_lp = gp.logprobs != nullptr || n_top > 0;
}

void gen_logprobs::record(const float * row, int32_t tok, float & lp, int32_t * top_tok, float * top_lp) {
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

void gen_logprobs::unmasked(int32_t p, const float * row, int32_t tok) {
    // (the block's records are final only at take_block: a draft-self canvas is a draft)
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

void gen_logprobs::block_from_canvas(int32_t n) {
    if (!want_lp) {
        return;
    }
    n = std::min<int32_t>(n, (int32_t) canvas_lp.size());
    block_lp.assign(canvas_lp.begin(), canvas_lp.begin() + n);
    block_top_tok.assign(canvas_top_tok.begin(), canvas_top_tok.begin() + (size_t) n * n_top);
    block_top_lp.assign(canvas_top_lp.begin(), canvas_top_lp.begin() + (size_t) n * n_top);
}

void gen_logprobs::verify_begin() {
    block_lp.clear();
    block_top_tok.clear();
    block_top_lp.clear();
}

void gen_logprobs::verified(const float * row, int32_t tok) {
    if (want_lp) {
        block_lp.push_back(0.0f);
        block_top_tok.resize(block_top_tok.size() + n_top);
        block_top_lp.resize(block_top_lp.size() + n_top);
        record(row, tok, block_lp.back(), block_top_tok.data() + block_top_tok.size() - n_top,
               block_top_lp.data() + block_top_lp.size() - n_top);
    }
}

void gen_logprobs::take_block() {
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

void gen_logprobs::publish(const clover_generate_params & gp, int32_t from, int32_t to) const {
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

} // namespace clover_impl
