// clover-sampling.h - candidates and confidences, unmask selection, draft acceptance and
// llama.cpp's sampler chain (clover-sampling.cpp; not installed).
#pragma once

#include "clover.h"
#include "llama.h"

#include <cstdint>
#include <random>
#include <string>
#include <vector>

struct clover_model;

namespace clover_impl {

struct pick_work {
    std::vector<double>  p;
    std::vector<int32_t> idx;
};

// temperature / top_k / top_p as decoding uses them (a tiny temperature = greedy, top_k >= n_vocab = off)
void normalise_sampling(double & T, int32_t & top_k, double & top_p, int32_t n_vocab);
// the candidate token of one masked position and its confidence (spec/decoding.md)
void pick_candidate(const float * logits, int32_t V, int32_t mask, double T, int32_t top_k, double top_p,
                    std::mt19937_64 & rng, pick_work & w, int32_t & tok, double & conf);
// pick_candidate's token at temperature 0 without its confidence (the softmax over the vocabulary):
// for the rows whose confidence nothing reads (a verification, a step that unmasks every position)
int32_t greedy_candidate(const float * logits, int32_t V, int32_t mask);
// pick_candidate at temperature 0: the argmax and its softmax probability (a pure function of the row)
void greedy_pick(const float * logits, int32_t V, int32_t mask, int32_t & tok, double & conf);
// the softmax denominator of pick_candidate's greedy confidence (1 / this): e^(logit - bl) summed
// over the candidates, bl = the highest candidate logit (vectorized; about 2 ulp a term)
double greedy_exp_sum(const float * logits, int32_t V, int32_t mask, double bl);
// draft-self at temperature > 0: keep drafted token x (true) or draw `other` from the residual
bool accept_draft(const double * p, const float * q, int32_t V, int32_t x, std::mt19937_64 & rng, int32_t & other);
// which of n masked positions a denoising step unmasks (most confident first); returns the count
int32_t select_unmask(const double * conf, int32_t n, double threshold, int32_t max_steps, int32_t step,
                      int32_t * order_out);

// ---- llama.cpp's sampler chain (clover-sampling.cpp; spec/decoding.md, "Sampler chain")

// the samplers `samplers` may name, llama-server's names and llama-cli's letters
enum class chain_sampler { penalties, dry, top_n_sigma, top_k, typ_p, top_p, min_p, xtc, temperature };
// `samplers` (NULL / "" = llama-server's default order) -> order; false with msg on an unknown name
bool parse_samplers(const char * samplers, std::vector<chain_sampler> & order, std::string & msg);

// A call's sampler chain, built from clover_generate_params by llama.cpp's llama_sampler_init_*:
// the modifiers (logit_bias, penalties, DRY: they change logits and keep the token history) and
// the filters (the rest of the `samplers` order, and temperature; or Mirostat). choose() runs a
// row through both and picks with pick_candidate (double precision, our seeded draw) from what is
// left; Mirostat draws itself (llama.cpp's). Off (active() false): the callers use pick_candidate.
class sampler_chain {
  public:
    sampler_chain() = default;
    sampler_chain(const sampler_chain &) = delete;
    sampler_chain & operator=(const sampler_chain &) = delete;
    ~sampler_chain();
    // whether gp asks for the chain (at temperature 0: only what can change the argmax)
    static bool active(const clover_generate_params & gp);
    // Mirostat keeps a state per drawn token: the call decodes at block size 1
    static bool forces_ar(const clover_generate_params & gp);
    int  init(const clover_model * m, const clover_generate_params & gp, int32_t n_ctx, std::string & msg);
    bool on() const { return modifiers != nullptr; }
    // a committed token (the prompt's too): the penalties and DRY count it
    void accept(int32_t tok);
    // the history a block's step sees: the committed tokens then the canvas's unmasked ones (-1: masked)
    void begin_step(const std::vector<int32_t> & canvas_tok);
    // the candidate of a row and its confidence; in_step: with begin_step's history, else the committed one
    void choose(const float * row, bool in_step, const clover_generate_params & gp, std::mt19937_64 & rng,
                pick_work & w, int32_t & tok, double & conf);

  private:
    void run(llama_sampler * s, std::vector<float> & row);
    const clover_model *          model     = nullptr;
    llama_sampler *               modifiers = nullptr; // logit_bias, penalties, DRY; accepts the committed tokens
    llama_sampler *               step      = nullptr; // a clone of modifiers with the step's canvas accepted
    llama_sampler *               filters   = nullptr; // the rest of the order (temperature last by default)
    bool                          mirostat  = false;
    std::vector<llama_token_data> cur;
    std::vector<float>            proc;
};

} // namespace clover_impl
