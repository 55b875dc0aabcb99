/*
 * clover-testing.h - the pure functions the decoding loop is made of, exported by libclover for
 * tests and research (the Python tests call them through clover_cpp._native's stubs); not part of
 * the public API and not installed with clover.h.
 */
#ifndef CLOVER_TESTING_H
#define CLOVER_TESTING_H

#include "clover.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Candidate for one position: logits[n_vocab] (not modified); mask_token gets -inf
 * (pass -1 for none). temperature 0: argmax (lowest id on ties), confidence = its softmax
 * probability; > 0: logits / T, top-k (0 = off), top-p (1 = off: keep the smallest prefix of
 * the sorted distribution with cumulative probability >= top_p), renormalise, sample with one
 * uniform draw from std::mt19937_64(seed); confidence = the sampled token's probability in
 * that renormalised distribution. Computes in double. The parameters are normalised as
 * clover_generate's (CLOVER_MIN_TEMPERATURE, top_k >= n_vocab). */
CLOVER_API int clover_pick_candidate(const float * logits, int32_t n_vocab, int32_t mask_token,
                                     double temperature, int32_t top_k, double top_p, uint64_t seed,
                                     int32_t * token_out, double * confidence_out);

/* Unmask schedule: given the confidences of the n_masked masked positions (in position
 * order), how many to unmask and which (indices into conf, most confident first, ties
 * lowest index). Rule: all with conf >= threshold, at least one; with max_steps S > 0, at
 * step s at least ceil(n_masked / (S - s)) (all when s >= S). Writes the chosen indices into
 * order_out (n_masked entries: the ranking) and returns the count to unmask (>= 1), or a
 * negative status. */
CLOVER_API int32_t clover_select_unmask(const double * conf, int32_t n_masked, double threshold,
                                        int32_t max_steps, int32_t step, int32_t * order_out);

/* Coreset auto's measurements (spec/decoding.md, "The block expert coreset") set instead of measured, so that
 * its rule can be tested without timing: full_ms, a block pass with full routing; per candidate
 * C[i], its pass ms[i] and the share agree[i] of rows whose argmax equals full routing's. The next
 * decision of the context (clover_generate with coreset auto; after a clover_set_coreset) takes
 * them, unless the disk cache holds one. n = 0: measure again. CLOVER_OK or CLOVER_ERR_INVALID_ARG. */
CLOVER_API int clover_set_coreset_probe(clover_context * ctx, double full_ms, const int32_t * C, const double * ms,
                                        const double * agree, int32_t n);

#ifdef __cplusplus
}
#endif

#endif /* CLOVER_TESTING_H */
