// clover-grammar.h - a call's token choice under its grammar: the GBNF check, the grammar sampler
// and draft-self's clone of it, over llama.cpp's sampler chain (clover-grammar.cpp; not installed).
#pragma once

#include "clover-sampling.h"

struct clover_context;

namespace clover_impl {

// A GBNF grammar checked before llama.cpp's grammar engine gets it (clover-grammar.cpp): true, or
// false with msg one line naming the rule ("invalid grammar: ..."): size, nesting and rule count,
// a repetition whose minimum is above its maximum, the size once repetitions are written out, left
// recursion (through rules that can match nothing too, as ("a"?)*), and ambiguity past what the
// engine can follow (it keeps one parse stack per reading of the text so far); a syntax error in
// llama.cpp's parser's words. vocab: for <token> references (NULL: none). A missing root passes
// (llama_sampler_init_grammar says so).
bool grammar_check(const char * grammar, const char * root, const llama_vocab * vocab, std::string & msg);

// Grammar (constrained decoding) and the sampler chain of one clover_generate call, for the decode
// loop (spec/decoding.md, "Grammar"; clover.h, clover_generate_params). Without a grammar every hook
// but the chain's is a no-op and pick() is pick_candidate() (or the chain's choice).
class gen_grammar {
  public:
    gen_grammar() = default;
    gen_grammar(const gen_grammar &) = delete;
    gen_grammar & operator=(const gen_grammar &) = delete;
    ~gen_grammar();
    // a grammar without draft-self, or Mirostat: the call decodes at block size 1
    static bool forces_ar(const clover_generate_params & gp);
    // parse the grammar, build the sampler chain (its penalties see the prompt): CLOVER_OK or
    // CLOVER_ERR_INVALID_ARG + msg
    int init(const clover_context * ctx, const clover_generate_params & gp, const int32_t * prompt, int32_t n_prompt,
             std::string & msg);
    // the candidate of a position; next = it is the next output position (the grammar applies)
    void pick(const float * row, bool next, const clover_generate_params & gp, std::mt19937_64 & rng,
              pick_work & w, int32_t & tok, double & conf);
    // pick() for canvas position p of a block: draft-self constrains a draft position whose left
    // neighbours are all drafted, with the grammar run over them (a clone)
    void pick_at(const float * row, int32_t p, const clover_generate_params & gp, std::mt19937_64 & rng,
                 pick_work & w, int32_t & tok, double & conf);
    // a denoising step unmasked canvas position p
    void unmasked(int32_t p, int32_t tok);
    // the finished block's output is canvas[0, n)
    void block_from_canvas(int32_t n);
    // draft-self: the verification's output is rebuilt token by token (the grammar accepts each)
    void verify_begin();
    void verified(int32_t tok);
    // the block's output joins the generation's (the grammar accepts it, unless a verification did)
    void take_block();
    // stats->grammar_mode
    void report(clover_stats * stats) const;

  private:
    bool allows(llama_sampler * g, int32_t tok) const;
    void pick_in(llama_sampler * g, const float * row, const clover_generate_params & gp, std::mt19937_64 & rng,
                 pick_work & w, int32_t & tok, double & conf);
    void accept(int32_t tok);
    // a candidate from a row: the sampler chain's when on, else pick_candidate's
    void choose(const float * row, const clover_generate_params & gp, std::mt19937_64 & rng, pick_work & w,
                int32_t & tok, double & conf);
    sampler_chain chain;
    bool          step_stale = true;  // the canvas or the committed tokens changed since chain.begin_step
    bool          verifying  = false; // draft-self: a verification chooses from the committed history
    const clover_model * model = nullptr;
    llama_sampler *      smpl  = nullptr;
    llama_sampler *      draft = nullptr; // draft-self: the grammar over the drafted prefix (draft_n tokens)
    int32_t              draft_n    = 0;
    bool                 draft_dead = false;
    std::vector<int32_t> step_cand;        // draft-self: this step's candidate per canvas position
    void note_candidate(int32_t p, int32_t tok);
    bool    draft_self = false;
    std::vector<llama_token_data> cur;       // the grammar's candidates
    std::vector<float>            constrained;
    std::vector<int32_t> canvas_tok, block_tok; // the canvas's unmasked tokens, the block's output
    bool                 block_verified = false; // the block's tokens came from a verification (accepted there)
};

} // namespace clover_impl
