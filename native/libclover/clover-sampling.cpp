// clover-sampling.cpp - a position's candidate token and confidence, and which positions a
// denoising step unmasks.

#include "clover-impl.h"
#include "clover-sampling.h"
#include "clover-params.h"
#include "clover-testing.h"

// ------------------------------------------------------------------ pure decoding pieces

namespace clover_impl {

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

// the highest of n logits (-inf when there is none but -inf/NaN): in lanes the compiler vectorizes
static float max_logit(const float * l, int32_t n) {
    constexpr int32_t W = 16;
    float             acc[W];
    std::fill(acc, acc + W, -std::numeric_limits<float>::infinity());
    int32_t i = 0;
    for (; i + W <= n; i += W) {
        for (int32_t j = 0; j < W; ++j) {
            acc[j] = l[i + j] > acc[j] ? l[i + j] : acc[j]; // (NaN never wins)
        }
    }
    for (; i < n; ++i) {
        acc[0] = l[i] > acc[0] ? l[i] : acc[0];
    }
    return *std::max_element(acc, acc + W);
}

// the greedy candidate: the highest logit but the mask's (strict: the lowest id wins ties; NaN
// never wins); -1 when every candidate is -inf/NaN. bl: its logit. (The maximum first, vectorized,
// then the first id that holds it.)
static int32_t greedy_best(const float * logits, int32_t V, int32_t mask, double & bl) {
    const int32_t m  = mask >= 0 && mask < V ? mask : V;
    const float   hi = std::max(max_logit(logits, m), m + 1 < V ? max_logit(logits + m + 1, V - m - 1)
                                                                : -std::numeric_limits<float>::infinity());
    bl = -std::numeric_limits<double>::infinity();
    if (hi == -std::numeric_limits<float>::infinity()) {
        return -1;
    }
    for (int32_t i = 0; i < V; ++i) {
        if (i != mask && logits[i] == hi) {
            bl = hi;
            return i;
        }
    }
    return -1;
}

// (degenerate rows: the lowest non-mask id)
static int32_t degenerate_pick(int32_t V, int32_t mask) {
    return mask == 0 && V > 1 ? 1 : 0;
}

// e^x for x <= 0 (0 below -87, where float's e^x is denormal or 0; x = NaN: 0), in float and without
// branches, so that the compiler vectorizes a loop of it (with -fno-trapping-math, native/libclover/CMakeLists.txt):
// x = n ln2 + r with |r| <= ln2 / 2, e^r by Cephes' degree-6 polynomial (about 2 ulp), 2^n through the exponent bits. (libm's exp is scalar:
// ~10 ns a logit, 2.5 ms for a row of the release's 248,320 entries, B of them at every step.)
static inline float exp_nonpositive(float x) {
    const float keep = x >= -87.0f ? 1.0f : 0.0f; // (NaN: 0)
    x                = x >= -87.0f ? x : 0.0f;
    const float n    = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; // round(x / ln2)
    const float r    = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    float       p    = 1.9875691500e-4f;
    p                = p * r + 1.3981999507e-3f;
    p                = p * r + 8.3334519073e-3f;
    p                = p * r + 4.1665795894e-2f;
    p                = p * r + 1.6666665459e-1f;
    p                = p * r + 5.0000001201e-1f;
    const float y    = p * r * r + r + 1.0f;
    const int32_t bits = ((int32_t) n + 127) << 23; // n in [-126, 0]
    float         scale;
    memcpy(&scale, &bits, sizeof(scale));
    return keep * (y * scale);
}

// sum of e^(l[i] - bl) over n logits, each <= bl (finite); NaN and -inf add nothing
static double exp_sum(const float * l, int32_t n, float bl) {
    constexpr int32_t W = 16, CHUNK = 64 * W; // float lanes, added into double every CHUNK
    double            sum = 0.0;
    int32_t           i   = 0;
    for (; i + W <= n;) {
        float         acc[W] = {};
        const int32_t end    = std::min(n - n % W, i + CHUNK);
        for (; i < end; i += W) {
            for (int32_t j = 0; j < W; ++j) {
                acc[j] += exp_nonpositive(l[i + j] - bl);
            }
        }
        for (float a : acc) {
            sum += a;
        }
    }
    for (; i < n; ++i) {
        sum += exp_nonpositive(l[i] - bl);
    }
    return sum;
}

// The softmax denominator of the greedy candidate's confidence: sum over the candidates (not the mask,
// not NaN) of e^(logit - bl), bl = the highest candidate logit.
double greedy_exp_sum(const float * logits, int32_t V, int32_t mask, double bl) {
    if (!std::isfinite(bl)) { // +inf logits (bl = +inf) share the mass: count them
        double sum = 0.0;
        for (int32_t i = 0; i < V; ++i) {
            sum += i != mask && (double) logits[i] == bl ? 1.0 : 0.0;
        }
        return sum;
    }
    const int32_t m = mask >= 0 && mask < V ? mask : V;
    return exp_sum(logits, m, (float) bl) + (m + 1 < V ? exp_sum(logits + m + 1, V - m - 1, (float) bl) : 0.0);
}

int32_t greedy_candidate(const float * logits, int32_t V, int32_t mask) {
    double        bl   = 0.0;
    const int32_t best = greedy_best(logits, V, mask, bl);
    return best < 0 ? degenerate_pick(V, mask) : best;
}

void greedy_pick(const float * logits, int32_t V, int32_t mask, int32_t & tok, double & conf) {
    double        bl   = 0.0;
    const int32_t best = greedy_best(logits, V, mask, bl);
    if (best < 0) { // every candidate is -inf/NaN: degenerate, pick the lowest non-mask id
        tok  = degenerate_pick(V, mask);
        conf = 0.0;
        return;
    }
    tok  = best;
    conf = 1.0 / greedy_exp_sum(logits, V, mask, bl);
}

void pick_candidate(const float * logits, int32_t V, int32_t mask, double T, int32_t top_k, double top_p,
                           std::mt19937_64 & rng, pick_work & w, int32_t & tok, double & conf) {
    const double NEG_INF = -std::numeric_limits<double>::infinity();
    if (T == 0.0) {
        greedy_pick(logits, V, mask, tok, conf);
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

// ------------------------------------------------------------------ llama.cpp's sampler chain

namespace {

struct sampler_name {
    const char *  name;
    char          letter;
    chain_sampler which;
};

// llama-server's names (common/sampling.cpp, common_sampler_type_to_str) and llama-cli's letters
const sampler_name k_sampler_names[] = {
    { "penalties", 'e', chain_sampler::penalties }, { "dry", 'd', chain_sampler::dry },
    { "top_n_sigma", 's', chain_sampler::top_n_sigma }, { "top_k", 'k', chain_sampler::top_k },
    { "typ_p", 'y', chain_sampler::typ_p }, { "top_p", 'p', chain_sampler::top_p },
    { "min_p", 'm', chain_sampler::min_p }, { "xtc", 'x', chain_sampler::xtc },
    { "temperature", 't', chain_sampler::temperature },
    // llama.cpp's other spellings (common_sampler_types_from_names' alternative names)
    { "top-k", 0, chain_sampler::top_k }, { "top-p", 0, chain_sampler::top_p }, { "nucleus", 0, chain_sampler::top_p },
    { "typical-p", 0, chain_sampler::typ_p }, { "typical", 0, chain_sampler::typ_p },
    { "typ-p", 0, chain_sampler::typ_p }, { "typical_p", 0, chain_sampler::typ_p },
    { "top-n-sigma", 0, chain_sampler::top_n_sigma }, { "min-p", 0, chain_sampler::min_p },
    { "temp", 0, chain_sampler::temperature },
};

const char k_default_order[] = "edskypmxt"; // llama-server's default (common.h, common_params_sampling)

bool sampler_by_name(const std::string & name, chain_sampler & which) {
    for (const auto & s : k_sampler_names) {
        if (name == s.name) {
            which = s.which;
            return true;
        }
    }
    return false;
}

bool sampler_by_letter(char c, chain_sampler & which) {
    for (const auto & s : k_sampler_names) {
        if (s.letter == c) {
            which = s.which;
            return true;
        }
    }
    return false;
}

bool has(const std::vector<chain_sampler> & order, chain_sampler s) {
    return std::find(order.begin(), order.end(), s) != order.end();
}

} // namespace

bool parse_samplers(const char * samplers, std::vector<chain_sampler> & order, std::string & msg) {
    order.clear();
    const std::string text = samplers && samplers[0] ? samplers : k_default_order;
    chain_sampler     which{};
    if (text.find_first_of(";,") == std::string::npos && !sampler_by_name(text, which)) {
        for (char c : text) { // llama-cli's letters
            if (!sampler_by_letter(c, which)) {
                msg = std::string("samplers: unknown sampler letter '") + c + "' (known: " + k_default_order + ")";
                return false;
            }
            order.push_back(which);
        }
        return true;
    }
    size_t from = 0;
    while (from <= text.size()) {
        const size_t      to   = std::min(text.find_first_of(";,", from), text.size());
        const std::string name = text.substr(from, to - from);
        if (!name.empty()) {
            if (!sampler_by_name(name, which)) {
                msg = "samplers: unknown sampler '" + name +
                      "' (known: penalties, dry, top_n_sigma, top_k, typ_p, top_p, min_p, xtc, temperature)";
                return false;
            }
            order.push_back(which);
        }
        from = to + 1;
    }
    return true;
}

static bool penalties_on(const clover_generate_params & gp) {
    return gp.repeat_last_n != 0 &&
           (gp.repeat_penalty != 1.0 || gp.frequency_penalty != 0.0 || gp.presence_penalty != 0.0);
}

static bool dry_on(const clover_generate_params & gp) {
    return gp.dry_multiplier > 0.0 && gp.dry_penalty_last_n != 0;
}

static bool xtc_on(const clover_generate_params & gp) {
    return gp.xtc_probability > 0.0 && gp.xtc_threshold <= 0.5;
}

bool sampler_chain::active(const clover_generate_params & gp) {
    const bool modifies = penalties_on(gp) || dry_on(gp) || gp.n_logit_bias > 0;
    if (gp.temperature == 0.0) { // greedy: top_k, top_p, min_p, top_n_sigma keep the argmax, Mirostat is greedy
        return modifies || gp.typical_p < 1.0 || xtc_on(gp);
    }
    return modifies || gp.min_p > 0.0 || gp.typical_p < 1.0 || gp.top_n_sigma > 0.0 || xtc_on(gp) ||
           gp.dynatemp_range > 0.0 || gp.min_keep > 0 || gp.mirostat != 0 || (gp.samplers && gp.samplers[0]);
}

bool sampler_chain::forces_ar(const clover_generate_params & gp) {
    return gp.mirostat != 0 && gp.temperature > 0.0;
}

sampler_chain::~sampler_chain() {
    for (llama_sampler * s : { modifiers, step, filters }) {
        if (s) {
            llama_sampler_free(s);
        }
    }
}

int sampler_chain::init(const clover_model * m, const clover_generate_params & gp, int32_t n_ctx,
                        std::string & msg) {
    if (!active(gp)) {
        return CLOVER_OK;
    }
    model = m;
    std::vector<chain_sampler> order;
    if (!parse_samplers(gp.samplers, order, msg)) {
        return CLOVER_ERR_INVALID_ARG;
    }
    std::vector<llama_logit_bias> bias;
    for (int32_t i = 0; i < gp.n_logit_bias; ++i) {
        if (gp.logit_bias_tokens[i] >= m->n_vocab) {
            msg = "logit_bias: token " + std::to_string(gp.logit_bias_tokens[i]) + " is past the vocabulary (" +
                  std::to_string(m->n_vocab) + " tokens)";
            return CLOVER_ERR_INVALID_ARG;
        }
        bias.push_back({ gp.logit_bias_tokens[i], gp.logit_bias[i] });
    }
    const llama_sampler_chain_params cp = llama_sampler_chain_default_params();
    modifiers                           = llama_sampler_chain_init(cp);
    filters                             = llama_sampler_chain_init(cp);
    auto add = [](llama_sampler * chain, llama_sampler * s) {
        if (!s) {
            throw std::runtime_error("llama.cpp refused a sampler's parameters");
        }
        llama_sampler_chain_add(chain, s);
    };
    if (!bias.empty()) { // (first, as llama-server puts it)
        add(modifiers, llama_sampler_init_logit_bias(m->n_vocab, (int32_t) bias.size(), bias.data()));
    }
    const uint32_t seed   = (uint32_t) (gp.seed ^ (gp.seed >> 32)); // (llama.cpp's samplers take 32 bits)
    // -1 = the context; more than the context can hold is the context (llama.cpp allocates the window)
    auto window = [n_ctx](int32_t last_n) { return last_n == -1 ? n_ctx : std::min(last_n, n_ctx); };
    const float    T      = (float) gp.temperature;
    const bool     greedy = gp.temperature == 0.0;
    const size_t   keep   = (size_t) gp.min_keep;
    for (chain_sampler s : order) {
        if (s == chain_sampler::penalties && penalties_on(gp)) {
            add(modifiers, llama_sampler_init_penalties(m->n_vocab, window(gp.repeat_last_n),
                                                        (float) gp.repeat_penalty, (float) gp.frequency_penalty,
                                                        (float) gp.presence_penalty));
        } else if (s == chain_sampler::dry && dry_on(gp)) {
            std::vector<const char *> breakers = { "\n", ":", "\"", "*" }; // (common.h's default)
            if (gp.n_dry_sequence_breakers > 0) {
                breakers.assign(gp.dry_sequence_breakers, gp.dry_sequence_breakers + gp.n_dry_sequence_breakers);
            }
            add(modifiers, llama_sampler_init_dry(m->vocab, (float) gp.dry_multiplier, (float) gp.dry_base,
                                                  gp.dry_allowed_length,
                                                  window(gp.dry_penalty_last_n),
                                                  breakers.data(), breakers.size()));
        }
    }
    if (gp.mirostat != 0 && !greedy) { // (llama-server: temperature then Mirostat, in place of the rest)
        mirostat = true;
        add(filters, llama_sampler_init_temp(T));
        add(filters, gp.mirostat == 1 ? llama_sampler_init_mirostat(m->n_vocab, seed, (float) gp.mirostat_tau,
                                                                    (float) gp.mirostat_eta, 100)
                                      : llama_sampler_init_mirostat_v2(seed, (float) gp.mirostat_tau,
                                                                       (float) gp.mirostat_eta));
        return CLOVER_OK;
    }
    for (chain_sampler s : order) {
        switch (s) {
            case chain_sampler::top_n_sigma:
                if (!greedy && gp.top_n_sigma > 0.0) {
                    add(filters, llama_sampler_init_top_n_sigma((float) gp.top_n_sigma));
                }
                break;
            case chain_sampler::top_k:
                if (!greedy && gp.top_k > 0) {
                    add(filters, llama_sampler_init_top_k(gp.top_k));
                }
                break;
            case chain_sampler::typ_p:
                if (gp.typical_p < 1.0) {
                    add(filters, llama_sampler_init_typical((float) gp.typical_p, keep));
                }
                break;
            case chain_sampler::top_p:
                if (!greedy && gp.top_p < 1.0) {
                    add(filters, llama_sampler_init_top_p((float) gp.top_p, keep));
                }
                break;
            case chain_sampler::min_p:
                if (!greedy && gp.min_p > 0.0) {
                    add(filters, llama_sampler_init_min_p((float) gp.min_p, keep));
                }
                break;
            case chain_sampler::xtc:
                if (xtc_on(gp)) {
                    add(filters, llama_sampler_init_xtc((float) gp.xtc_probability, (float) gp.xtc_threshold, keep,
                                                        seed));
                }
                break;
            case chain_sampler::temperature:
                if (!greedy) { // (common/sampling.cpp's: dynamic when dynatemp_range > 0)
                    add(filters, llama_sampler_init_temp_ext(T, (float) gp.dynatemp_range,
                                                             (float) gp.dynatemp_exponent));
                }
                break;
            case chain_sampler::penalties:
            case chain_sampler::dry:
                break; // (modifiers)
        }
    }
    return CLOVER_OK;
}

void sampler_chain::accept(int32_t tok) {
    if (modifiers) {
        llama_sampler_accept(modifiers, tok);
    }
}

void sampler_chain::begin_step(const std::vector<int32_t> & canvas_tok) {
    if (step) {
        llama_sampler_free(step);
        step = nullptr;
    }
    if (!modifiers || std::none_of(canvas_tok.begin(), canvas_tok.end(), [](int32_t t) { return t >= 0; })) {
        return;
    }
    step = llama_sampler_clone(modifiers);
    for (int32_t t : canvas_tok) { // the unmasked tokens in position order (a masked one is skipped)
        if (t >= 0) {
            llama_sampler_accept(step, t);
        }
    }
}

// row (n_vocab logits) through sampler s: the survivors keep their new logits, the rest are -inf
void sampler_chain::run(llama_sampler * s, std::vector<float> & row) {
    const int32_t V = model->n_vocab;
    cur.resize(V);
    for (int32_t i = 0; i < V; ++i) {
        cur[i] = llama_token_data{ i, row[i], 0.0f };
    }
    llama_token_data_array arr{ cur.data(), (size_t) V, -1, false };
    llama_sampler_apply(s, &arr);
    std::fill(row.begin(), row.end(), -std::numeric_limits<float>::infinity());
    for (size_t j = 0; j < arr.size; ++j) {
        row[arr.data[j].id] = arr.data[j].logit;
    }
}

void sampler_chain::choose(const float * row, bool in_step, const clover_generate_params & gp,
                           std::mt19937_64 & rng, pick_work & w, int32_t & tok, double & conf) {
    const int32_t V    = model->n_vocab;
    const int32_t mask = model->mask;
    const float   NEG  = -std::numeric_limits<float>::infinity();
    proc.resize(V);
    for (int32_t i = 0; i < V; ++i) { // (the mask token and NaN never win, as in pick_candidate)
        proc[i] = i == mask || row[i] != row[i] ? NEG : row[i];
    }
    run(in_step && step ? step : modifiers, proc);
    if (mirostat) { // llama.cpp's Mirostat draws the token (and moves its target) itself
        for (int32_t i = 0; i < V; ++i) {
            cur[i] = llama_token_data{ i, proc[i], 0.0f };
        }
        llama_token_data_array arr{ cur.data(), (size_t) V, -1, false };
        llama_sampler_apply(filters, &arr);
        w.p.assign(V, 0.0);
        for (size_t j = 0; j < arr.size; ++j) {
            w.p[arr.data[j].id] = arr.data[j].p;
        }
        tok  = arr.selected >= 0 ? arr.data[arr.selected].id : greedy_candidate(proc.data(), V, mask);
        conf = w.p[tok];
        return;
    }
    if (llama_sampler_chain_n(filters) > 0) {
        run(filters, proc);
    }
    // temperature, top-k and top-p are the chain's: what is left is the distribution (T = 1), in double
    pick_candidate(proc.data(), V, mask, gp.temperature == 0.0 ? 0.0 : 1.0, 0, 1.0, rng, w, tok, conf);
}

} // namespace clover_impl

using namespace clover_impl;

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
        normalise_sampling(temperature, top_k, top_p, n_vocab);
        std::mt19937_64          rng(seed);
        pick_work w;
        pick_candidate(logits, n_vocab, mask_token, temperature, top_k, top_p, rng, w, *token_out, *confidence_out);
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
        return select_unmask(conf, n_masked, threshold, max_steps, step, order_out);
    });
}

} // extern "C"
