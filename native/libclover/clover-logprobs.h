// clover-logprobs.h - the log-probabilities of a call's output tokens (clover-logprobs.cpp; not
// installed).
#pragma once

#include "clover.h"

#include <cstdint>
#include <vector>

struct clover_model;

namespace clover_impl {

// The log-probability (and the n_top_logprobs most likely tokens) of each output token of one
// clover_generate call, recorded from the row that predicted it as the canvas is unmasked, kept
// per block until the block joins the output (clover.h, clover_generate_params). Without logprob
// buffers every hook is a no-op.
class gen_logprobs {
  public:
    // the buffers' wish (their ranges: clover_impl::check_params, checked first)
    void init(const clover_model * m, const clover_generate_params & gp);
    // a denoising step unmasked canvas position p (tok, predicted by row)
    void unmasked(int32_t p, const float * row, int32_t tok);
    // the finished block's output is canvas[0, n)
    void block_from_canvas(int32_t n);
    // draft-self: the verification's output is rebuilt token by token
    void verify_begin();
    void verified(const float * row, int32_t tok);
    // the block's output joins the generation's
    void take_block();
    // the records of output tokens [from, to) into gp's logprob buffers (each block's as it is
    // committed, before the block callback: clover.h)
    void publish(const clover_generate_params & gp, int32_t from, int32_t to) const;

  private:
    void record(const float * row, int32_t tok, float & lp, int32_t * top_tok, float * top_lp);
    const clover_model * model   = nullptr;
    bool                 want_lp = false;
    int32_t              n_top   = 0;
    std::vector<int32_t> idx;                                        // top-n selection
    std::vector<float>   canvas_lp, block_lp, gen_lp;                // per position / output token
    std::vector<int32_t> canvas_top_tok, block_top_tok, gen_top_tok; // n_top per position / token
    std::vector<float>   canvas_top_lp, block_top_lp, gen_top_lp;
};

} // namespace clover_impl
