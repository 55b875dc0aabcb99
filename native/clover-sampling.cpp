// clover-sampling.cpp - a position's candidate token and confidence, and which positions a
// denoising step unmasks.

#include "clover-impl.h"

// ------------------------------------------------------------------ pure decoding pieces

namespace clover_detail {

// uniform double in [0, 1) from 53 random bits (the same on every platform)
static double uniform01(std::mt19937_64 & rng) {
    return (double) (rng() >> 11) * (1.0 / 9007199254740992.0);
}

// The one place the sampling parameters are normalised (clover.h, clover_generate_params): a
// temperature below CLOVER_MIN_TEMPERATURE is greedy (0: logits / T could overflow); top_k >=
// n_vocab is off (0). (A top_p of 0 needs nothing: its kept set is the argmax alone, as top_k = 1.)
// Values out of range are left for the caller to refuse.
void normalise_sampling(double & T, int32_t & top_k, double & top_p, int32_t n_vocab) {
    (void) top_p;
    if (top_k >= n_vocab) {
        top_k = 0;
    }
    if (T > 0.0 && T < CLOVER_MIN_TEMPERATURE) {
        T = 0.0;
    }
}

// the greedy candidate: the highest logit but the mask's (strict: the lowest id wins ties; NaN
// never wins); -1 when every candidate is -inf/NaN. bl: its logit.
static int32_t greedy_best(const float * logits, int32_t V, int32_t mask, double & bl) {
    int32_t best = -1;
    bl           = -std::numeric_limits<double>::infinity();
    for (int32_t i = 0; i < V; ++i) {
        if (i == mask) {
            continue;
        }
        const double l = logits[i];
        if (l > bl) {
            bl   = l;
            best = i;
        }
    }
    return best;
}

// (degenerate rows: the lowest non-mask id)
static int32_t degenerate_pick(int32_t V, int32_t mask) {
    return mask == 0 && V > 1 ? 1 : 0;
}

int32_t greedy_candidate(const float * logits, int32_t V, int32_t mask) {
    double        bl   = 0.0;
    const int32_t best = greedy_best(logits, V, mask, bl);
    return best < 0 ? degenerate_pick(V, mask) : best;
}

void pick_candidate(const float * logits, int32_t V, int32_t mask, double T, int32_t top_k, double top_p,
                           std::mt19937_64 & rng, pick_work & w, int32_t & tok, double & conf) {
    const double NEG_INF = -std::numeric_limits<double>::infinity();
    if (T == 0.0) {
        double        bl   = NEG_INF;
        const int32_t best = greedy_best(logits, V, mask, bl);
        if (best < 0) { // every candidate is -inf/NaN: degenerate, pick the lowest non-mask id
            tok  = degenerate_pick(V, mask);
            conf = 0.0;
            return;
        }
        double sum = 0.0;
        for (int32_t i = 0; i < V; ++i) {
            if (i == mask) {
                continue;
            }
            const double l = logits[i];
            if (l == l) {
                sum += l == bl ? 1.0 : std::exp(l - bl); // (bl = +inf: the infinite logits share it)
            }
        }
        tok  = best;
        conf = 1.0 / sum;
        return;
    }

    // sampling: z = logits / T
    w.p.resize(V);
    double * z = w.p.data();
    for (int32_t i = 0; i < V; ++i) {
        const double l = logits[i];
        z[i]           = (i == mask || l != l) ? NEG_INF : l / T;
    }
    auto by_z = [z](int32_t a, int32_t b) { return z[a] > z[b] || (z[a] == z[b] && a < b); };
    if (top_k > 0 && top_k < V) {
        w.idx.resize(V);
        for (int32_t i = 0; i < V; ++i) {
            w.idx[i] = i;
        }
        std::nth_element(w.idx.begin(), w.idx.begin() + top_k, w.idx.end(), by_z);
        for (int32_t j = top_k; j < V; ++j) {
            z[w.idx[j]] = NEG_INF;
        }
    }
    double zmax = NEG_INF;
    for (int32_t i = 0; i < V; ++i) {
        zmax = std::max(zmax, z[i]);
    }
    if (zmax == NEG_INF) { // degenerate
        tok  = mask == 0 && V > 1 ? 1 : 0;
        conf = 0.0;
        return;
    }
    if (zmax == -NEG_INF) { // infinite logits (or logits / T overflowed): they share the mass
        for (int32_t i = 0; i < V; ++i) {
            z[i] = z[i] == zmax ? 0.0 : NEG_INF;
        }
        zmax = 0.0;
    }
    double sum = 0.0;
    for (int32_t i = 0; i < V; ++i) {
        const double e = z[i] == NEG_INF ? 0.0 : std::exp(z[i] - zmax);
        z[i]           = e;
        sum += e;
    }
    double * p = z;
    for (int32_t i = 0; i < V; ++i) {
        p[i] /= sum;
    }
    if (top_p < 1.0) {
        // smallest prefix of the sorted distribution (p desc, id asc) with cum >= top_p
        w.idx.clear();
        for (int32_t i = 0; i < V; ++i) {
            if (p[i] > 0.0) {
                w.idx.push_back(i);
            }
        }
        const size_t npos = w.idx.size();
        auto by_p = [p](int32_t a, int32_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); };
        size_t m    = std::min<size_t>(64, npos);
        size_t keep = npos;
        while (true) {
            std::partial_sort(w.idx.begin(), w.idx.begin() + m, w.idx.end(), by_p);
            double cum   = 0.0;
            bool   found = false;
            for (size_t j = 0; j < m; ++j) {
                cum += p[w.idx[j]];
                if (cum >= top_p) {
                    keep  = j + 1;
                    found = true;
                    break;
                }
            }
            if (found || m == npos) {
                break;
            }
            m = std::min(npos, m * 4);
        }
        double kept = 0.0;
        for (size_t j = 0; j < keep; ++j) {
            kept += p[w.idx[j]];
        }
        for (size_t j = keep; j < npos; ++j) {
            p[w.idx[j]] = 0.0;
        }
        for (size_t j = 0; j < keep; ++j) {
            p[w.idx[j]] /= kept;
        }
    }
    // inverse-CDF sample in id order
    double total = 0.0;
    for (int32_t i = 0; i < V; ++i) {
        total += p[i];
    }
    const double target = uniform01(rng) * total;
    double       cdf    = 0.0;
    int32_t      pick   = -1;
    int32_t      last   = -1;
    for (int32_t i = 0; i < V; ++i) {
        if (p[i] <= 0.0) {
            continue;
        }
        last = i;
        cdf += p[i];
        if (cdf > target) {
            pick = i;
            break;
        }
    }
    if (pick < 0) {
        pick = last;
    }
    tok  = pick;
    conf = p[pick];
}

// Speculative sampling (draft-self at temperature > 0): keep the drafted token x with probability
// min(1, p(x) / q(x)); else return the token drawn from the residual max(0, p - q), normalised
// (p when it is all zero). p: the verifier's distribution, q: the draft's, both over V tokens.
bool accept_draft(const double * p, const float * q, int32_t V, int32_t x, std::mt19937_64 & rng, int32_t & other) {
    const double u = uniform01(rng);
    if (q[x] > 0.0f && u < p[x] / (double) q[x]) {
        return true;
    }
    double total = 0.0;
    for (int32_t i = 0; i < V; ++i) {
        total += std::max(0.0, p[i] - (double) q[i]);
    }
    const bool   residual = total > 0.0;
    const double target   = uniform01(rng) * (residual ? total : 1.0);
    double       cdf      = 0.0;
    other                 = -1;
    for (int32_t i = 0; i < V; ++i) {
        const double w = residual ? std::max(0.0, p[i] - (double) q[i]) : p[i];
        if (w <= 0.0) {
            continue;
        }
        other = i;
        cdf += w;
        if (cdf > target) {
            break;
        }
    }
    return false;
}

// Returns how many to unmask; order_out = ranking (conf desc, index asc).
int32_t select_unmask(const double * conf, int32_t n, double threshold, int32_t max_steps, int32_t step,
                             int32_t * order_out) {
    std::vector<double> c(conf, conf + n);
    for (auto & x : c) {
        if (x != x) {
            x = -1.0; // NaN never ranks first
        }
    }
    for (int32_t i = 0; i < n; ++i) {
        order_out[i] = i;
    }
    std::stable_sort(order_out, order_out + n, [&c](int32_t a, int32_t b) { return c[a] > c[b]; });
    int32_t k = 0;
    for (int32_t i = 0; i < n; ++i) {
        if (c[i] >= threshold) {
            ++k;
        }
    }
    k = std::max<int32_t>(k, 1);
    if (max_steps > 0) {
        const int32_t left = max_steps - step;
        const int32_t need = left <= 0 ? n : (n + left - 1) / left;
        k                  = std::max(k, need);
    }
    return std::min(k, n);
}

} // namespace clover_detail

using clover_impl::check_params;
using clover_impl::guarded;

extern "C" {

int clover_pick_candidate(const float * logits, int32_t n_vocab, int32_t mask_token, double temperature,
                          int32_t top_k, double top_p, uint64_t seed, int32_t * token_out, double * confidence_out) {
    return guarded(nullptr, 0, [&]() -> int {
        clover_generate_params gp = clover_generate_default_params(); // the ranges: clover-params.cpp
        gp.temperature            = temperature;
        gp.top_k                  = top_k;
        gp.top_p                  = top_p;
        std::string msg;
        if (!logits || n_vocab < 1 || !token_out || !confidence_out || check_params(gp, msg) != CLOVER_OK) {
            return CLOVER_ERR_INVALID_ARG;
        }
        clover_detail::normalise_sampling(temperature, top_k, top_p, n_vocab);
        std::mt19937_64          rng(seed);
        clover_detail::pick_work w;
        clover_detail::pick_candidate(logits, n_vocab, mask_token, temperature, top_k, top_p, rng, w, *token_out,
                                      *confidence_out);
        return CLOVER_OK;
    });
}

int32_t clover_select_unmask(const double * conf, int32_t n_masked, double threshold, int32_t max_steps, int32_t step,
                             int32_t * order_out) {
    return guarded(nullptr, 0, [&]() -> int {
        clover_generate_params gp = clover_generate_default_params(); // the ranges: clover-params.cpp
        gp.threshold              = threshold;
        gp.max_steps              = max_steps;
        std::string msg;
        if (!conf || !order_out || n_masked < 1 || step < 0 || check_params(gp, msg) != CLOVER_OK) {
            return CLOVER_ERR_INVALID_ARG;
        }
        return clover_detail::select_unmask(conf, n_masked, threshold, max_steps, step, order_out);
    });
}

} // extern "C"
