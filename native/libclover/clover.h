/*
 * clover.h - C API for block-diffusion decoding of "Clover" models on llama.cpp.
 *
 * Stable, C-linkage, no C++ types. Every function that can fail returns an int status
 * (CLOVER_OK = 0, negative = error) and, when the caller passes an `err` buffer, writes a
 * one-line, NUL-terminated message into it (truncated to err_len). No function aborts the
 * process on bad input: arguments are validated and C++ exceptions are caught at the API
 * boundary.
 *
 * Model:    a GGUF with general.architecture == "clover" (see spec/gguf-layout.md).
 * Context:  one llama.cpp context whose memory (recurrent GDN states + KV cache) holds the
 *           committed tokens, processed causally: the memory is that of autoregressive
 *           decoding of the committed text and does not depend on B. Sequence 0 (or 1) is
 *           the memory; sequence 2 is scratch for block passes. A block pass is a canvas
 *           (llama_set_canvas) at the end of a llama_decode. The ubatch holds max(512, 2B)
 *           tokens; changing B keeps the llama.cpp context while 2B fits, else recreates it;
 *           clover_set_block_size clears the memory either way.
 *
 * Decoding (see spec/decoding.md): the prompt is committed causally (L_last = the logits of
 * its last token predict the next position); decode blocks of B positions start right after
 * it. Position 0 of a block takes its candidate from L_last, position q > 0 from the block
 * pass's logits at q - 1, and a block pass runs only while some masked q > 0 exists, so
 * B = 1 is autoregressive decoding (one 1-token forward per token). Positions past the
 * budget stay masked and cost nothing. A finished block is committed causally by the same
 * llama_decode as the next block's first pass (the final block of a generation is not
 * committed).
 *
 * Threading: a clover_context must not be used from two threads at once; distinct contexts
 * (even on the same model) may be used concurrently.
 */
#ifndef CLOVER_H
#define CLOVER_H

#include <stddef.h>
#include <stdint.h>

#if defined(_WIN32) && !defined(__MINGW32__)
#  ifdef CLOVER_BUILD
#    define CLOVER_API __declspec(dllexport)
#  else
#    define CLOVER_API __declspec(dllimport)
#  endif
#else
#  define CLOVER_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Raised on every change of a public struct, function or constant. */
#define CLOVER_API_VERSION 10

/* ---------------------------------------------------------------- status codes */
enum clover_status {
    CLOVER_OK                   =  0,
    CLOVER_ERR_INVALID_ARG      = -1, /* bad parameter (block size, threshold, token id, NULL...) */
    CLOVER_ERR_LOAD             = -2, /* file missing / not a GGUF / wrong architecture / load failed */
    CLOVER_ERR_DECODE           = -3, /* llama_decode failed */
    CLOVER_ERR_CANCELLED        = -4, /* a callback returned nonzero (results so far are valid) */
    CLOVER_ERR_CONTEXT_FULL     = -5, /* the tokens would not fit in n_ctx */
    CLOVER_ERR_BUFFER_TOO_SMALL = -6, /* output buffer too small (the needed size is reported) */
    CLOVER_ERR_INTERNAL         = -7, /* unexpected exception / out of memory */
};

/* why a generation ended (clover_stats.finish_reason) */
enum clover_finish_reason {
    CLOVER_FINISH_NONE       = 0, /* did not run (max_tokens <= 0) or failed */
    CLOVER_FINISH_EOS        = 1, /* a block contained EOS (stop_at_eos) */
    CLOVER_FINISH_MAX_TOKENS = 2, /* the token budget was reached */
    CLOVER_FINISH_CANCELLED  = 3, /* a callback asked to stop */
    CLOVER_FINISH_STOP_TOKEN = 4, /* a block contained one of clover_generate_params.stop_tokens */
};

typedef struct clover_model   clover_model;
typedef struct clover_context clover_context;

/* CLOVER_API_VERSION of the library (a binding compares it with the header it was written for). */
CLOVER_API int32_t clover_api_version(void);

/* The ABI of this build, for a binding to compare with its own declarations at load:
 * "sizeof S" / "alignof S" (S a public struct: clover_model_params, clover_context_params,
 * clover_generate_params, clover_stats), "offsetof S.F" (F a field of S), "fields S" (how many
 * fields S has), "value N" (N a named constant: CLOVER_OK, CLOVER_ERR_*, CLOVER_FINISH_*,
 * CLOVER_MODE_*, CLOVER_BLOCK_SIZE_*, ...). Returns -1 for an unknown query; since a value may
 * be -1 itself, "known Q" returns 1 when Q is a known query, else 0. */
CLOVER_API int64_t clover_abi_query(const char * what);

/* Short, static description of a status code ("ok", "invalid argument", ...). */
CLOVER_API const char * clover_status_str(int status);

/* Route llama.cpp / ggml log output: 0 = silent (default; error lines are still kept for
 * error messages), 1 = errors and warnings to stderr, 2 = everything to stderr. */
CLOVER_API void clover_set_verbosity(int level);

/* Notices of a slow step before the first token (measuring the cost curve of block size auto,
 * once per process) on stderr: 1 = always (the command lines), 0 (default) = at verbosity >= 1 only. */
CLOVER_API void clover_set_notices(int on);

/* ---------------------------------------------------------------- model */
typedef struct clover_model_params {
    int32_t n_gpu_layers; /* layers to offload (0 = CPU only, -1 = all); default 0 */
    int32_t use_mmap;     /* -1 = llama.cpp's automatic choice (default), 0 = read, 1 = mmap */
    int32_t use_mlock;    /* lock the weights in RAM; default 0 */
    /* llama.cpp RPC servers ("HOST:PORT[,HOST:PORT...]", each running ggml-rpc-server) whose
     * devices hold layers, before any local GPU; NULL or "" = none. Offloaded layers
     * (n_gpu_layers) are split over these devices; the rest stays on the local CPU. */
    const char *  rpc_servers;
    /* share of the offloaded layers per device (RPC devices first, then local GPUs), as
     * llama.cpp's --tensor-split; n_tensor_split = 0: by each device's free memory */
    const float * tensor_split;
    int32_t       n_tensor_split;
    /* "PATTERN=BUFFER[,PATTERN=BUFFER...]" as llama.cpp's -ot: tensors whose name matches the
     * regex go to that buffer type ("CPU", a device's, "RPC0[host:port]", ...); NULL = none.
     * E.g. "^output\.weight=CPU" keeps the output head on this machine (anchor it: the regex
     * is searched, so "output\.weight" alone also matches every attn_output.weight). */
    const char *  tensor_overrides;
} clover_model_params;

CLOVER_API clover_model_params clover_model_default_params(void);

/* Load a clover GGUF. `params` may be NULL (defaults). Returns NULL on failure, with the
 * reason in err (status CLOVER_ERR_LOAD, or CLOVER_ERR_INVALID_ARG for a NULL path). */
CLOVER_API clover_model * clover_model_load(const char * path, const clover_model_params * params,
                                            char * err, size_t err_len);
CLOVER_API void clover_model_free(clover_model * model);

CLOVER_API int32_t clover_n_vocab         (const clover_model * model);
CLOVER_API int32_t clover_mask_token      (const clover_model * model); /* tokenizer.ggml.mask_token_id, -1 if absent */
CLOVER_API int32_t clover_eos_token       (const clover_model * model); /* -1 if none */
CLOVER_API int32_t clover_bos_token       (const clover_model * model); /* the BOS a text starts with, -1 if the model adds none */
CLOVER_API int32_t clover_train_block_size(const clover_model * model); /* clover.diffusion.block_size, 0 if absent */
CLOVER_API int32_t clover_n_ctx_train     (const clover_model * model);

/* Metadata value as a string (NUL-terminated), as llama_model_meta_val_str: scalar keys only
 * (GGUF arrays are not available here). Returns the full length of the value, or -1 if the
 * key is absent; like snprintf, the value written is truncated to buf_size - 1 bytes. */
CLOVER_API int32_t clover_model_meta(const clover_model * model, const char * key, char * buf, size_t buf_size);

/* Tokenize `text` (text_len bytes; -1 = NUL-terminated). add_special: add BOS/EOS if the
 * model says so; parse_special: recognise special-token text. On success *n_out = the count.
 * If n_max is too small: CLOVER_ERR_BUFFER_TOO_SMALL and *n_out = the count needed. */
CLOVER_API int clover_tokenize(const clover_model * model, const char * text, int32_t text_len,
                               int32_t * tokens, int32_t n_max, int add_special, int parse_special,
                               int32_t * n_out);

/* Bytes of one token (not NUL-terminated; may be part of a UTF-8 sequence). special: render
 * special tokens. Returns CLOVER_OK with *n_out (if not NULL) = the bytes written; if buf is too
 * small, CLOVER_ERR_BUFFER_TOO_SMALL with *n_out = the size needed; CLOVER_ERR_INVALID_ARG for a
 * NULL model, a token outside [0, n_vocab) or a bad buffer. (As clover_tokenize and
 * clover_detokenize; not llama_token_to_piece's "count or -needed" return, whose negative sizes
 * would collide with the status codes.) */
CLOVER_API int clover_token_to_piece(const clover_model * model, int32_t token, char * buf, int32_t buf_size,
                                     int special, int32_t * n_out);

/* Text of a token sequence (NUL-terminated when it fits with the terminator). *n_out = the
 * number of bytes (without the terminator); CLOVER_ERR_BUFFER_TOO_SMALL with *n_out = bytes
 * needed (add one for the terminator). */
CLOVER_API int clover_detokenize(const clover_model * model, const int32_t * tokens, int32_t n_tokens,
                                 char * buf, int32_t buf_size, int remove_special, int unparse_special,
                                 int32_t * n_out);

/* ---------------------------------------------------------------- context */

/* Block size values besides a B >= 1, one meaning each wherever a block_size is taken
 * (clover_context_params.block_size takes B >= 1 or _TRAIN; clover_generate_params.block_size
 * any of them; clover_set_block_size B >= 1 only). */
#define CLOVER_BLOCK_SIZE_TRAIN   0    /* the model's training block size (clover.diffusion.block_size;
                                          32 when absent; 1 without a mask token), at most n_ctx */
#define CLOVER_BLOCK_SIZE_AUTO    (-1) /* chosen per block from the measured cost curve and the
                                          running tokens per pass (see clover_generate) */
#define CLOVER_BLOCK_SIZE_CONTEXT (-2) /* the context's current B (clover_block_size) */

/* clover_context_params.coreset: the model file's default block expert coreset (its GGUF key
 * clover.expert_coreset; off when the key is absent) */
#define CLOVER_CORESET_MODEL (-1)
/* clover_context_params.coreset: measured at the context's first clover_generate (spec/decoding.md,
 * "The block expert coreset"): the first of 3k, 4k, 6k below the expert count (k experts per
 * token) whose block pass is >= 10% faster than full routing's and agrees with its argmax on
 * >= 95% of the rows, else off; kept in the calibration cache */
#define CLOVER_CORESET_AUTO (-2)

typedef struct clover_context_params {
    int32_t n_ctx;      /* positions the memory can hold (prompt + generation), >= 3, or 0 = the model's
                           training context (clover_n_ctx_train, as llama.cpp's n_ctx = 0); default 4096 */
    int32_t n_threads;  /* CPU threads; <= 0 = a default from the hardware; default 4 */
    int32_t block_size; /* B >= 1, or CLOVER_BLOCK_SIZE_TRAIN (default) */
    int32_t flash_attn; /* -1 auto (default), 0 off, 1 on */
    int32_t kv_f32;     /* 1 = keep the KV cache in f32 (exact parity runs), 0 = f16 (default) */
    int32_t calib_cache;/* 1 (default) = block_size = auto keeps its cost curve in a disk cache
                           ($CLOVER_CACHE_DIR, else $XDG_CACHE_HOME/clover-cpp, else
                           ~/.cache/clover-cpp), keyed by model file, backend, build and threads;
                           0 = measure once per context */
    int32_t coreset;    /* the block expert coreset C of every block pass (spec/model.md "MoE",
                           spec/decoding.md): each MoE layer of a canvas routes among the C experts
                           of highest summed router probability only; committed tokens keep full
                           routing (draft-self's output never changes). 0 = off, C >= 1,
                           CLOVER_CORESET_AUTO, or CLOVER_CORESET_MODEL (default: the GGUF's
                           clover.expert_coreset) */
    int32_t expert_stats; /* 1 = count the routed experts of every block pass (clover_stats.experts_per_pass,
                           expert_bytes_per_pass); default 0. Its cost: llama.cpp's graph scheduler
                           stops after each MoE layer's expert selection of a block pass to read it (a
                           synchronisation per MoE layer; on a GPU no captured graph), so leave it off
                           when timing */
} clover_context_params;

CLOVER_API clover_context_params clover_context_default_params(void);

/* The rules of clover_context_params (clover_context_new checks them first; front ends call this
 * to refuse bad options before loading anything): n_ctx 0 or >= 3; block_size >= 1 and at most n_ctx,
 * or CLOVER_BLOCK_SIZE_TRAIN (at most n_ctx by definition); flash_attn -1, 0 or 1; coreset >= 0 or
 * CLOVER_CORESET_MODEL or CLOVER_CORESET_AUTO; expert_stats 0 or 1. CLOVER_OK, or
 * CLOVER_ERR_INVALID_ARG and the first broken rule in err ("n_ctx must be 0 (the model's training context)
 * or >= 3, got 2"). */
CLOVER_API int clover_context_params_check(const clover_context_params * params, char * err, size_t err_len);

CLOVER_API clover_context * clover_context_new(clover_model * model, const clover_context_params * params,
                                               char * err, size_t err_len);
CLOVER_API void clover_context_free(clover_context * ctx);

CLOVER_API int32_t clover_block_size(const clover_context * ctx);
CLOVER_API int32_t clover_n_ctx     (const clover_context * ctx);
/* Change B (>= 1, at most n_ctx): the memory is cleared; the llama.cpp context is recreated only
 * when a commit and a pass of B no longer fit its ubatch. No-op if unchanged (the memory stays). */
CLOVER_API int clover_set_block_size(clover_context * ctx, int32_t block_size, char * err, size_t err_len);
CLOVER_API int clover_set_n_threads (clover_context * ctx, int32_t n_threads);
/* The block expert coreset of the passes from now on (clover_context_params.coreset's values and
 * rule): the memory stays. clover_coreset: the C in use (0 = off; a C >= the model's expert count
 * routes fully), CLOVER_CORESET_AUTO while auto is not yet decided (off until then), -1 for a NULL
 * context. */
CLOVER_API int     clover_set_coreset(clover_context * ctx, int32_t coreset, char * err, size_t err_len);
CLOVER_API int32_t clover_coreset    (const clover_context * ctx);

/* ---------------------------------------------------------------- low-level passes
 * For research and parity tests. Positions are implicit: a pass or commit starts at
 * clover_n_committed(ctx). Token ids must be in [0, n_vocab). Logits row t predicts the
 * token at position t + 1 (the next-token shift). */

/* A block pass: the canvas of 1 <= n <= B tokens (B = the context's block size) at positions
 * n_committed .. n_committed+n-1 against the memory, which is left unchanged. logits_out:
 * n * n_vocab floats, row t = position n_committed+t. */
CLOVER_API int clover_block_pass(clover_context * ctx, const int32_t * tokens, int32_t n,
                                 float * logits_out, char * err, size_t err_len);
/* Commit n >= 1 tokens causally (n_committed += n), one llama_decode per ubatch; the numbers
 * are those of one-by-one commits. logits_out (n * n_vocab floats, may be NULL): the logits
 * of every committed position, as llama.cpp's causal decoding of the same text gives them. */
CLOVER_API int clover_commit_logits(clover_context * ctx, const int32_t * tokens, int32_t n, float * logits_out,
                                    char * err, size_t err_len);
/* clover_commit_logits without the logits. */
CLOVER_API int clover_commit(clover_context * ctx, const int32_t * tokens, int32_t n, char * err, size_t err_len);
/* The logits of the last committed position (n_vocab floats): the prediction of the next
 * one. CLOVER_ERR_INVALID_ARG when nothing is committed. */
CLOVER_API int clover_last_logits(const clover_context * ctx, float * logits_out);
/* Clear the memory (n_committed = 0). */
CLOVER_API int     clover_reset(clover_context * ctx);
CLOVER_API int32_t clover_n_committed(const clover_context * ctx);
/* The committed tokens (the text the memory holds; after clover_generate: the prompt and every
 * finished decode block but the last): copies min(n_committed, n_max) of them, from the first,
 * into out (may be NULL when n_max <= 0) and returns n_committed (0 for a NULL context). */
CLOVER_API int32_t clover_committed_tokens(const clover_context * ctx, int32_t * out, int32_t n_max);

/* The memory as bytes (llama.cpp's llama_state_seq_* of the committed sequence, with the committed
 * tokens and the last logits, behind a versioned header naming the model and the KV type):
 * clover_state_load into a context of the same model (any block size) continues a generation
 * exactly as without the calls in between, and reads none of the tokens again.
 * clover_state_size: the bytes clover_state_save writes now (0 for a NULL context).
 * clover_state_save: CLOVER_ERR_BUFFER_TOO_SMALL when size is less; *n_written (may be NULL) = the
 * bytes written. clover_state_load: CLOVER_ERR_INVALID_ARG and one line for bytes of another
 * model, KV type, format version or size, damaged (checksum) or truncated; the memory is then
 * unchanged (cleared if llama.cpp itself refuses the sequence's bytes). */
CLOVER_API size_t clover_state_size(clover_context * ctx);
CLOVER_API int    clover_state_save(clover_context * ctx, uint8_t * dst, size_t size, size_t * n_written, char * err,
                                    size_t err_len);
CLOVER_API int    clover_state_load(clover_context * ctx, const uint8_t * src, size_t size, char * err,
                                    size_t err_len);

/* ---------------------------------------------------------------- block size auto */

/* Measure the cost curve for block_size = auto (ignores the disk cache): at each candidate B,
 * the time of one denoising step (ms, fastest of 10 over two sweeps, candidates included) as
 * a plain block pass (ms_out) and as a commit fused with the next pass (ms_fused_out). Clears
 * the memory. Writes up to cap entries to each non-NULL array; *n_out = the number of
 * candidates. */
CLOVER_API int clover_calibrate(clover_context * ctx, int32_t * sizes_out, double * ms_out, double * ms_fused_out,
                                int32_t cap, int32_t * n_out, char * err, size_t err_len);
/* Set the cost curve instead of measuring it: n entries, sizes 1, 2, 4, ..., costs in (0, 1e9] ms;
 * ms_fused may be NULL (then a fused step of B costs a pass of 2B). Resets the running
 * figures. */
CLOVER_API int clover_set_cost_curve(clover_context * ctx, const int32_t * sizes, const double * ms,
                                     const double * ms_fused, int32_t n, char * err, size_t err_len);

/* ---------------------------------------------------------------- generation */

/* Called after every denoising step: block_start = absolute position of the block,
 * canvas = its block_size tokens (masked positions hold the mask token; valid during the
 * call only), n_masked = masks left. Return nonzero to cancel. */
typedef int (*clover_step_callback)(int32_t block_start, const int32_t * canvas, int32_t block_size,
                                    int32_t n_masked, void * user_data);
/* Called once per finished block with the tokens it adds to the output (the generated
 * positions, already cut at EOS / max_tokens; n_tokens may be 0; valid during the call
 * only). The concatenation of everything passed to it equals the final output. Called
 * before the block is committed; return nonzero to cancel (stop now). With logprobs buffers
 * (clover_generate_params.logprobs / top_*), the block's tokens' entries are written before
 * the call: output token i (counted over the whole output, tokens[0] is the output's token
 * n_before, the sum of the n_tokens of the calls before) is read at logprobs[i] and row i of
 * top_tokens / top_logprobs, during the call or later. */
typedef int (*clover_block_callback)(int32_t block_start, const int32_t * tokens, int32_t n_tokens,
                                     void * user_data);
/* Draft-self: called with each draft before its verification (block_start = its first position, draft =
 * the n_draft drafted tokens, valid during the call only). The verification keeps the draft's first k
 * tokens (k = n_draft: all of it) and, when it rejects one (k < n_draft), the model's own token at
 * position k: those are the block callback's tokens (spec/decoding.md, "Draft-self"). Return nonzero to
 * cancel (nothing of the draft is kept). */
typedef int (*clover_draft_callback)(int32_t block_start, const int32_t * draft, int32_t n_draft, void * user_data);

/* clover_generate_params.draft_self: the mode chosen per block with block_size = auto */
#define CLOVER_DRAFT_SELF_AUTO (-1)

/* clover_stats.mode: how the last block was decoded */
enum clover_decode_mode {
    CLOVER_MODE_NONE           = 0, /* nothing decoded */
    CLOVER_MODE_AUTOREGRESSIVE = 1, /* B = 1 */
    CLOVER_MODE_DIFFUSION      = 2, /* block diffusion at B > 1 */
    CLOVER_MODE_DRAFT_SELF     = 3, /* draft-self at B > 1 */
};

/* temperatures below this are greedy (temperature 0): the tempered distribution is the argmax
 * but for logits a few float ulps apart, and logits / T could overflow */
#define CLOVER_MIN_TEMPERATURE 1e-6

typedef struct clover_generate_params {
    int32_t  block_size;   /* B >= 1, CLOVER_BLOCK_SIZE_CONTEXT (default: the context's B),
                              CLOVER_BLOCK_SIZE_TRAIN or CLOVER_BLOCK_SIZE_AUTO (chosen per block); a B
                              other than the context's becomes the context's (see clover_generate) */
    double   threshold;    /* unmask every position with confidence >= threshold, in [0, 1]; default 0.9 */
    int32_t  max_steps;    /* per-block step cap S (0 = none): step s unmasks >= ceil(masked / (S - s)) */
    double   temperature;  /* 0 = greedy (default); > 0 = sampling; below CLOVER_MIN_TEMPERATURE = greedy */
    int32_t  top_k;        /* 0 = off; >= n_vocab = off */
    double   top_p;        /* [0, 1]; 1 = off; 0 keeps the argmax alone (as top_k = 1) */
    uint64_t seed;         /* std::mt19937_64 seed, once per generate call; default 0 */
    int32_t  max_tokens;   /* token budget, >= 0 (0 generates nothing); default CLOVER_DEFAULT_MAX_TOKENS */
    int32_t  stop_at_eos;  /* default 1 */
    clover_step_callback  step_callback;  /* may be NULL */
    clover_block_callback block_callback; /* may be NULL */
    void *   user_data;
    int32_t  reuse_prefix; /* 1 (default): when the prompt starts with the context's committed
                              tokens, keep them and commit only the rest (stats.n_reused); the
                              memory is the same for every B; 0 = always start from an empty memory */
    int32_t  draft_self;   /* CLOVER_DRAFT_SELF_AUTO (-1) = with block_size = auto, the mode too is chosen
                              per block (B = 1, block diffusion or draft-self, whichever the cost curve
                              and the running figures make cheapest per token); with a fixed B, block
                              diffusion. 1 = draft-self (lossless self-speculative decoding, spec/decoding.md):
                              each block is drafted by block passes, then verified by its causal
                              commit; the output equals block_size = 1 decoding (token for token at
                              temperature 0, in distribution otherwise: speculative sampling's
                              acceptance against the draft's distributions, seeded); with block_size =
                              auto, B = 1 or draft-self at some B (both lossless). In a draft-self
                              block the step callback sees only the verified tokens (once per
                              verification; a draft is never output). 0 (default) = block diffusion
                              (with block_size = auto: B = 1 or block diffusion) */
    /* Constrained decoding (spec/decoding.md, "Grammar"): a GBNF grammar (llama.cpp's format, as
     * llama-server's `grammar` field; applied by llama.cpp's grammar sampler over the model's
     * vocabulary), NULL or "" = none; grammar_root: its start rule, NULL or "" = "root". Every
     * output token is one the grammar allows after the output before it (EOS only where the
     * grammar is complete; when no token can continue it, the output ends there as at EOS). The
     * grammar needs the text left to right: with draft_self != 1 a constrained call decodes at
     * block size 1 (autoregressive; block_size is not used and the context's B is not changed;
     * stats.grammar_mode = 1); with draft_self = 1 the drafts follow the grammar left to right
     * and the verification chooses from the grammar-constrained distribution, so the output is
     * that of the constrained block size 1 decoding (stats.grammar_mode = 2). A grammar that does
     * not parse, or is past the bounds of spec/decoding.md (1 MiB, 500 nested groups, 5,000
     * rules, a repetition {m,n} with m > n, 4M symbols once repetitions are written out, 8,192
     * ways for a rule to begin, left recursion or a repetition of what can match nothing, more
     * than 64 readings of one character at once): CLOVER_ERR_INVALID_ARG with a one-line reason naming the rule. */
    const char * grammar;
    const char * grammar_root;
    /* Log-probabilities (as llama-server's `logprobs`): for output token i, logprobs[i] = its log
     * probability under the distribution it was chosen from: the log-softmax (temperature 1, no
     * top-k / top-p / grammar; the mask token excluded) of the logits row that predicted it, at
     * the denoising step that unmasked it (draft-self: the verifying causal row, i.e. that of
     * block size 1). NULL = not computed; else max_tokens floats. n_top_logprobs in [0, 20]:
     * top_tokens / top_logprobs (max_tokens * n_top_logprobs entries each; row i = output token
     * i) receive the n most probable tokens of that distribution and their log-probabilities,
     * most probable first (ties: lower id first); both must be non-NULL when n > 0. Written
     * block by block: a finished block's entries before the block callback sees its tokens (a
     * stream hands each piece its own); the rest of the buffers is not written. */
    float *   logprobs;
    int32_t   n_top_logprobs;
    int32_t * top_tokens;
    float *   top_logprobs;
    /* draft-self: the step cap of a draft (default 1: every position of the block from one
     * block pass, which rides on the previous verification's forward); S > 1: at most S passes
     * per draft (threshold, then the cap rule of max_steps with S); 0 = threshold and max_steps
     * as block diffusion does */
    int32_t   draft_steps;
    /* Stop tokens (besides EOS): the output ends before the first of them, as at EOS, with
     * stats.finish_reason = CLOVER_FINISH_STOP_TOKEN (stop_at_eos does not apply to them); the
     * block holding it is not committed. n_stop_tokens >= 0 ids in [0, n_vocab), stop_tokens may be
     * NULL when it is 0; read during the call only. Default none. */
    const int32_t * stop_tokens;
    int32_t         n_stop_tokens;
    /* llama.cpp's sampler chain (spec/decoding.md, "Sampler chain"): llama-server's samplers, names
     * and defaults; every one off by default. When any is on (or `samplers` is given) a position's
     * row goes through llama.cpp's llama_sampler_init_* samplers: logit_bias first, then the
     * `samplers` order (default llama-server's "penalties;dry;top_n_sigma;top_k;typ_p;top_p;min_p;
     * xtc;temperature", temperature last as there); else temperature, top_k, top_p as above. */
    double  min_p;              /* [0, 1]; 0 = off */
    double  typical_p;          /* (0, 1]; 1 = off */
    double  top_n_sigma;        /* <= 0 = off (default -1) */
    double  xtc_probability;    /* [0, 1]; 0 = off */
    double  xtc_threshold;      /* [0, 1]; default 0.1; > 0.5 = off */
    int32_t repeat_last_n;      /* tokens (prompt included) the penalties look back over; 0 = off, -1 = n_ctx
                                   (more is n_ctx); default 64 */
    double  repeat_penalty;     /* > 0; 1 = off */
    double  frequency_penalty;  /* [-2, 2]; 0 = off */
    double  presence_penalty;   /* [-2, 2]; 0 = off */
    double  dry_multiplier;     /* >= 0; 0 = off */
    double  dry_base;           /* >= 1; default 1.75 */
    int32_t dry_allowed_length; /* >= 0; default 2 */
    int32_t dry_penalty_last_n; /* 0 = off, -1 = n_ctx (more is n_ctx); default -1 (llama-server's) */
    /* DRY's sequence breakers; NULL with n = 0: llama.cpp's default "\n", ":", "\"", "*" */
    const char * const * dry_sequence_breakers;
    int32_t              n_dry_sequence_breakers;
    int32_t mirostat;           /* 0 = off, 1 = Mirostat, 2 = Mirostat 2.0 (replaces the chain but
                                   logit_bias and the penalties; decodes at block size 1; greedy at temperature 0) */
    double  mirostat_tau;       /* > 0; default 5 */
    double  mirostat_eta;       /* > 0; default 0.1 */
    /* added to a token's logit (-INFINITY bans it), as llama-server's logit_bias; ids in [0, n_vocab) */
    const int32_t * logit_bias_tokens;
    const float *   logit_bias;
    int32_t         n_logit_bias;
    /* the chain's order: llama-server's names ("top_k;min_p;temperature", ';' or ',' separated) or
     * llama-cli's letters ("kmt": e penalties, d dry, s top_n_sigma, k top_k, y typ_p, p top_p,
     * m min_p, x xtc, t temperature); NULL or "" = the default order */
    const char * samplers;
    /* dynamic temperature (llama.cpp's llama_sampler_init_temp_ext, llama-server's dynatemp_range and
     * dynatemp_exponent): the chain's temperature becomes T - range .. T + range (at least 0) by the
     * candidates' normalized entropy to the power exponent; range >= 0, 0 = off; exponent >= 0, default 1 */
    double  dynatemp_range;
    double  dynatemp_exponent;
    int32_t min_keep;           /* top_p, min_p, typical_p and xtc keep at least this many candidates (> 0 runs
                                   the chain); >= 0, default 0 */
    clover_draft_callback draft_callback; /* draft-self: each draft before its verification; may be NULL */
} clover_generate_params;

#define CLOVER_MAX_TOP_LOGPROBS 20
/* clover_generate_params.max_tokens's default (the Python bindings' generate() default too) */
#define CLOVER_DEFAULT_MAX_TOKENS 256

/* The defaults: the one place they are defined (bindings read them from here). */
CLOVER_API clover_generate_params clover_generate_default_params(void);

/* The parameter rules that need no context, one message each (clover_generate applies them
 * first; front ends call this to refuse bad options before loading anything): block_size >= 1 or
 * a CLOVER_BLOCK_SIZE_* value; threshold in [0, 1]; temperature finite and >= 0; top_p in [0, 1];
 * top_k, max_steps, max_tokens, draft_steps >= 0; draft_self 0, 1 or CLOVER_DRAFT_SELF_AUTO;
 * n_top_logprobs in [0, CLOVER_MAX_TOP_LOGPROBS] with both top buffers when > 0; n_stop_tokens
 * >= 0 with stop_tokens when > 0; the sampler chain's ranges (each field's comment), its arrays
 * given when their count is > 0, `samplers` only known names. CLOVER_OK, or CLOVER_ERR_INVALID_ARG and the first broken rule
 * in err ("threshold must be in [0, 1], got 2": each message starts with the field's name). */
CLOVER_API int clover_generate_params_check(const clover_generate_params * params, char * err, size_t err_len);

typedef struct clover_stats {
    int32_t n_prompt;           /* prompt tokens */
    int32_t n_generated;        /* tokens in the output */
    int32_t n_forward;          /* llama_decode calls: prompt, block passes, commits that rode on no pass */
    int32_t n_decode_passes;    /* block passes during decoding */
    int32_t n_steps;            /* denoising steps (= n_decode_passes) */
    int32_t n_commits;          /* decode blocks committed (most ride on the next block's first pass) */
    int32_t n_blocks;           /* decode blocks started */
    int32_t finish_reason;      /* enum clover_finish_reason */
    double  tokens_per_forward; /* n_generated / the forwards after the prompt's */
    double  t_prefill_ms;
    double  t_decode_ms;
    double  tokens_per_second;  /* n_generated / t_decode */
    int32_t block_size;         /* B of the last block */
    int32_t n_block_switches;   /* B changes during the generation (block_size = auto) */
    int32_t calibration;        /* this call's cost curve: 0 = already set, 1 = measured, 2 = disk cache */
    int32_t n_reused;           /* prompt tokens kept from the previous call's memory (reuse_prefix) */
    int32_t n_verifications;    /* draft-self: causal commits that verified a draft */
    int32_t n_drafted;          /* draft-self: drafted tokens verified */
    int32_t n_accepted;         /* draft-self: drafted tokens accepted (each verification adds one more token
                                   of its own when it rejects one) */
    int32_t n_decode_forwards;  /* llama_decode calls after the prompt's: block passes and commits that rode on
                                   no pass (tokens_per_forward = n_generated / this) */
    int32_t grammar_mode;       /* 0 = no grammar, 1 = grammar at block size 1 (autoregressive), 2 = grammar with
                                   draft-self */
    int32_t mode;               /* enum clover_decode_mode of the last block (with block_size: the B and mode
                                   block_size = auto chose last) */
    int32_t n_blocks_ar;        /* decode blocks per mode: autoregressive (B = 1), */
    int32_t n_blocks_diffusion; /* block diffusion, */
    int32_t n_blocks_draft_self;/* draft-self (each verification is one block) */
    double  tokens_per_verification; /* draft-self: (n_accepted + n_verifications) / n_verifications, the
                                        tokens each verification kept (its accepted drafts and one of its
                                        own); 0 without verifications */
    int32_t n_graphs_reused;    /* forwards after the prompt's that ran llama.cpp's previous graph again (the
                                   same shape: no rebuild; a GPU backend replays its captured graph). Every
                                   pass of a block has one shape; a block's first pass, which carries the
                                   previous block's commit, has another */
    /* the routed experts of the block passes (canvases of >= 2 rows, draft-self's drafts included), counted
       with clover_context_params.expert_stats (else 0): */
    int32_t n_expert_passes;    /* block passes counted */
    double  experts_per_pass;   /* distinct routed experts per MoE layer of a pass's canvas rows (mean over
                                   passes and layers); 0 without passes */
    double  expert_bytes_per_pass; /* bytes of routed-expert weights those experts are (per layer: distinct x
                                   the bytes of one expert of ffn_gate_exps + ffn_up_exps + ffn_down_exps),
                                   summed over the layers, mean over passes */
    double  expert_bytes_b1;    /* the same for a B = 1 step (k experts per layer): the unit of
                                   expert_bytes_per_pass ("x B = 1") */
} clover_stats;

/* Block-diffusion generation from `prompt` (n_prompt >= 1 tokens when max_tokens > 0).
 *
 * block_size: as clover_generate_params says. A fixed B other than the context's becomes the
 * context's B (clover_set_block_size: the memory is cleared, unless the prompt reuses it, see
 * Memory); with a grammar and without draft-self the call decodes at B = 1 and keeps the
 * context's B.
 *
 * block_size = CLOVER_BLOCK_SIZE_AUTO: B is chosen from the candidates 1, 2, 4, ... up to
 * max(32, training B) to minimise the expected time per token,
 * (fused(B) + (B/tpf(B) - 1) * pass(B)) / B (B/tpf passes per block, the first carrying the
 * previous block's commit), where pass and fused are the context's cost curve (from the disk
 * cache or measured on the first auto call, not counted in the stats) and tpf(B) the running
 * tokens per pass seen at that B (else at any B >= 2, capped at B; else 1). B is re-planned
 * at each block boundary, only for a gain of at least 10%; a switch keeps the memory (which
 * does not depend on B; usually only the canvas's block size changes, else the seq state is
 * saved, the context rebuilt and the state restored). The running figures live in the
 * context across calls.
 *
 * Memory: the memory is cleared first, unless reuse_prefix is set and the prompt starts with
 * every committed token; then only the rest of the prompt is committed. Either way the result
 * equals that of a cleared memory (the memory is the causal processing of the committed text).
 * Afterwards the memory holds the prompt and each finished decode block but the last; it is
 * cleared after an error. Writes at most max_tokens tokens into
 * out (out_cap must be >= max_tokens), *n_out = their count; stats and n_out may be NULL.
 *
 * Cancellation: when a callback returns nonzero, generation stops and the function returns
 * CLOVER_ERR_CANCELLED; out / *n_out / stats are still valid and hold the output of the
 * blocks finished so far (a block interrupted mid-denoising contributes nothing), with
 * finish_reason = CLOVER_FINISH_CANCELLED.
 *
 * Errors (nothing generated): CLOVER_ERR_INVALID_ARG (a rule of clover_generate_params_check;
 * a B > n_ctx; a token id outside the vocabulary in the prompt or stop_tokens; no mask token for
 * B > 1 or draft-self; an empty prompt; out_cap < max_tokens; a grammar that does not parse),
 * CLOVER_ERR_CONTEXT_FULL (prompt + max_tokens rounded up to whole blocks exceeds n_ctx; with
 * draft_self = 1 or block_size = auto, prompt + max_tokens: see clover_generate_room),
 * CLOVER_ERR_DECODE. */
CLOVER_API int clover_generate(clover_context * ctx, const int32_t * prompt, int32_t n_prompt,
                               const clover_generate_params * params,
                               int32_t * out, int32_t out_cap, int32_t * n_out,
                               clover_stats * stats, char * err, size_t err_len);

/* The largest max_tokens clover_generate accepts after n_prompt prompt tokens with these params
 * (NULL = the defaults; their max_tokens is not used): n_ctx - n_prompt, in whole blocks of the B
 * the call starts with unless it runs draft-self or block_size = auto (which picks only a B that
 * fits); 0 when nothing fits; -1 for a NULL context, n_prompt < 0 or params that break a rule of
 * clover_generate_params_check. The one "does it fit" rule. */
CLOVER_API int32_t clover_generate_room(const clover_context * ctx, const clover_generate_params * params,
                                        int32_t n_prompt);

/* The stats of a generation whose output the caller ended at n_generated tokens (a stop string
 * found by clover_stop_matcher while the call ran; the caller cancelled it, so the tokens may run
 * into the block it interrupted): n_generated, tokens_per_forward and tokens_per_second with the
 * same forwards and time (the formulas of clover_stats); the rest unchanged. CLOVER_ERR_INVALID_ARG
 * for NULL or n_generated < 0. */
CLOVER_API int clover_stats_cut(clover_stats * stats, int32_t n_generated);

/* The routed experts of the block passes run since the counter last started (a clover_generate's
 * start or the last call of this; the low-level clover_block_pass included), on a context with
 * clover_context_params.expert_stats: fills stats's n_expert_passes, experts_per_pass,
 * expert_bytes_per_pass and expert_bytes_b1 (the rest untouched), then starts counting afresh.
 * CLOVER_ERR_INVALID_ARG for NULL or a context without expert_stats. */
CLOVER_API int clover_expert_stats(clover_context * ctx, clover_stats * stats);

/* ---------------------------------------------------------------- stop strings
 * The output is cut before the first of the stop strings (as llama.cpp's reverse prompt / the
 * `stop` of llama-server), which may span the pieces of text it arrives in: text that could
 * still begin one is held back until a later piece decides. Bytes in, bytes out (fed valid
 * UTF-8, every piece out ends at a character boundary). */
typedef struct clover_stop_matcher clover_stop_matcher;

/* n_stops NUL-terminated strings (copied; empty or NULL ones ignored). NULL on bad arguments. */
CLOVER_API clover_stop_matcher * clover_stop_matcher_new(const char * const * stops, int32_t n_stops);
CLOVER_API void clover_stop_matcher_free(clover_stop_matcher * m);
/* Feed len bytes of text: returns the part of the held text and this text that is final (*n_out
 * bytes, valid until the next call on m; not NUL-terminated as far as the caller may rely); after
 * a stop string was seen (clover_stop_matcher_hit) nothing more comes out. NULL on bad arguments. */
CLOVER_API const char * clover_stop_matcher_feed(clover_stop_matcher * m, const char * text, int32_t len,
                                                 int32_t * n_out);
/* The end of the text: what was held back (the start of a stop string that never came); empty
 * after a hit. Valid until the next call on m. */
CLOVER_API const char * clover_stop_matcher_flush(clover_stop_matcher * m, int32_t * n_out);
/* 1 once a stop string was seen, else 0. */
CLOVER_API int32_t clover_stop_matcher_hit(const clover_stop_matcher * m);

/* ---------------------------------------------------------------- JSON schema
 * A JSON schema as a GBNF grammar for clover_generate_params.grammar, by llama.cpp's own converter
 * (common/json-schema-to-grammar.cpp, that of llama-server's json_schema and response_format).
 * What it enforces: type (one or a list), properties / required / additionalProperties, items
 * (a schema, or a tuple: an array or prefixItems) with minItems / maxItems, integer minimum /
 * maximum / exclusiveMinimum / exclusiveMaximum (|bound| <= 1e15), string pattern (^...$ without
 * lookarounds), minLength / maxLength and format date, time, date-time, uuid (a date's day is
 * 01-31 whatever the month), const, enum, $ref into the same document ($defs), anyOf, oneOf whose
 * alternatives exclude each other (by type, constants, or a required property's const), allOf of
 * objects or of enums; counts (minItems, maxItems, minLength, maxLength, a pattern's {m,n}) up to
 * 2000, the most llama.cpp's grammar repeats; annotations (title, description, ...) are ignored.
 * Any other keyword, or one where the converter would not enforce it (a number's minimum,
 * multipleOf, not, format email, pattern beside format, ...), is refused, never dropped:
 * CLOVER_ERR_INVALID_ARG with err naming the keyword and its path ("JSON schema: 'multipleOf'
 * at #/properties/age: ..."), as for a schema that is not valid JSON or that the converter
 * refuses. Otherwise CLOVER_OK with the grammar in buf (NUL-terminated) and *n_out (if not NULL)
 * = its length without the terminator; CLOVER_ERR_BUFFER_TOO_SMALL with *n_out = that length
 * when buf_size is below it + 1 (buf may be NULL with buf_size 0 to ask). */
CLOVER_API int clover_json_schema_to_grammar(const char * schema_json, char * buf, int32_t buf_size, int32_t * n_out,
                                             char * err, size_t err_len);

#ifdef __cplusplus
}
#endif

#endif /* CLOVER_H */
