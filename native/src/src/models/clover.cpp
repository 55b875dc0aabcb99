// Clover: block-diffusion MoE with a restructured Gated DeltaNet token mixer (spec/model.md).
//
// A plain decode is the causal model: every token is processed as a block of one (memory read
// of the state before it, block softmax over the token alone, no look-ahead taps) and then
// written into the memory, and attention is causal; the logits at t predict the token at t+1.
// With llama_set_canvas(ctx, n_canvas, n_block), the last n_canvas tokens of each sequence of
// the ubatch are a canvas instead: a block pass of block size n_block against the memory of
// everything before it, bidirectional inside the canvas (KV mask, block softmax, look-ahead
// taps), and not written into the GDN state or conv tail (libclover drops the canvas's
// KV cells). So one llama_decode can commit a block causally and run the next block's first pass.
// A file with a canvas FFN (clover.canvas_feed_forward_length) adds it to the MoE output of the canvas
// rows, never to a committed token's.
// With llama_set_expert_coreset(ctx, C) (spec/model.md, "MoE"), the MoE layers of a canvas of two or
// more tokens route its tokens among the C experts of highest router probability summed over the
// canvas only; committed tokens keep full routing.
//
// clover.block_operator = "release-bd-softmax" (the released checkpoint, spec/gguf-layout.md): no
// ssm_mix / ssm_block_calib; the release's block softmax (ssm_bd_*) is loaded and never run. The
// GDN is then the trunk's (Qwen3.5) gated delta rule: a committed token's output is the read of
// the state after its write; a canvas continues the delta rule causally over its tokens from the
// committed state, not written back (the block softmax left out), with the look-ahead taps and
// bidirectional attention inside the canvas as for our operator.
#include "models.h"
#include "llama-memory-recurrent.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

// The gated delta rule of a GDN layer runs two steps per token: a read (beta = 0, no decay: the
// output is the memory read S^T q of the state before the token) and a write. A canvas token's
// write has beta = 0 and no decay too, so the final state is that of the committed tokens.
class llm_graph_input_clover_blocks : public llm_graph_input_i {
public:
    llm_graph_input_clover_blocks(const llama_cparams & cparams, const llama_ubatch & ub, int64_t n_expert,
                                  int64_t n_used) :
        n_tok(ub.n_seq_tokens), n_seqs(ub.n_seqs), n_canvas(canvas_len(cparams, n_tok)), n_expert(n_expert), n_used(n_used),
        n_coreset(coreset_of(cparams, n_canvas, n_expert, n_used)) {}

    // canvas tokens at the end of each sequence of a ubatch of n_tok tokens per sequence
    static int64_t canvas_len(const llama_cparams & cparams, int64_t n_tok) {
        return std::min<int64_t>(cparams.n_canvas, n_tok);
    }

    // the expert coreset of the canvas's MoE layers: 0 = full routing (no coreset, C >= n_expert,
    // or a canvas of fewer than two tokens); a C below the experts per token k is k (each token
    // keeps k experts: build_moe_ffn sums the model's k per layer)
    static int64_t coreset_of(const llama_cparams & cparams, int64_t n_canvas, int64_t n_expert, int64_t n_used) {
        const int64_t c = std::max<int64_t>(cparams.n_expert_coreset, n_used);
        return n_canvas >= 2 && cparams.n_expert_coreset > 0 && c < n_expert ? c : 0;
    }

    void set_input(const llama_ubatch * ubatch) override {
        GGML_ASSERT(ubatch->n_seq_tokens == (uint32_t) n_tok);
        if (!gdn_write) { // the release's layout: its delta rule needs no write mask
            return;
        }
        std::vector<float> v_write(2 * n_tok * n_seqs, 0.0f);
        for (int64_t s = 0; s < n_seqs; ++s) {
            for (int64_t t = 0; t < n_tok - n_canvas; ++t) {
                v_write[s * 2 * n_tok + 2 * t + 1] = 1.0f;
            }
        }
        ggml_backend_tensor_set(gdn_write, v_write.data(), 0, ggml_nbytes(gdn_write));
    }

    bool can_reuse(const llm_graph_params & params) override {
        return params.ubatch.n_seq_tokens == (uint32_t) n_tok && params.ubatch.n_seqs == (uint32_t) n_seqs &&
               canvas_len(params.cparams, n_tok) == n_canvas &&
               coreset_of(params.cparams, n_canvas, n_expert, n_used) == n_coreset;
    }

    const int64_t n_tok, n_seqs;
    const int64_t n_canvas; // the graph's shape: look-ahead taps, block softmax and conv tail depend on it
    const int64_t n_expert, n_used;
    const int64_t n_coreset; // the canvas's MoE routes among this many experts (0 = all): the graph's shape too

    ggml_tensor * gdn_write = nullptr; // F32 [1, 1, 2 n_tok, n_seqs]: 1 = the step writes (a committed token's write);
                                       // none for the release's layout (no ssm_mix)
};

void llama_model_clover::load_arch_hparams(llama_model_loader & ml) {
    ml.get_key_or_arr(LLM_KV_EXPERT_FEED_FORWARD_LENGTH, hparams.n_ff_exp_arr, hparams.n_layer_all, true);
    ml.get_key(LLM_KV_EXPERT_SHARED_FEED_FORWARD_LENGTH, hparams.n_ff_shexp);
    ml.get_key(LLM_KV_EXPERT_WEIGHTS_NORM,               hparams.expert_weights_norm, false);
    ml.get_key(LLM_KV_ATTENTION_LAYERNORM_RMS_EPS,       hparams.f_norm_rms_eps);

    ml.get_key(LLM_KV_SSM_CONV_KERNEL,      hparams.ssm_d_conv);
    ml.get_key(LLM_KV_SSM_CONV_LOOKAHEAD,   hparams.ssm_d_conv_look);
    ml.get_key(LLM_KV_SSM_INNER_SIZE,       hparams.ssm_d_inner);
    ml.get_key(LLM_KV_SSM_STATE_SIZE,       hparams.ssm_d_state);
    ml.get_key(LLM_KV_SSM_TIME_STEP_RANK,   hparams.ssm_dt_rank);
    ml.get_key(LLM_KV_SSM_GROUP_COUNT,      hparams.ssm_n_group);
    ml.get_key(LLM_KV_DIFFUSION_BLOCK_SIZE, hparams.diffusion_block_size);
    ml.get_key(LLM_KV_CANVAS_FEED_FORWARD_LENGTH, hparams.n_ff_canvas, false);
    ml.get_key_or_arr(LLM_KV_ATTENTION_RECURRENT_LAYERS, hparams.is_recr_impl, hparams.n_layer_all, true);
    {
        std::string op;
        ml.get_key(LLM_KV_BLOCK_OPERATOR, op, false);
        if (!op.empty() && op != "clover-mix-calib" && op != "release-bd-softmax") {
            throw std::runtime_error("clover: unknown clover.block_operator '" + op +
                                     "' (expected clover-mix-calib or release-bd-softmax)");
        }
    }

    // the weights' semantics (spec v2: causal commit, next-token shift); files of the retired
    // in-place semantics carry no key and would decode to garbage
    std::string semantics;
    ml.get_key(LLM_KV_MODEL_SEMANTICS, semantics, false);
    if (semantics != "causal-shift") {
        throw std::runtime_error("clover: this GGUF was made for the retired in-place semantics (no clover.semantics = "
                                 "\"causal-shift\"); convert a current checkpoint with `clover convert`");
    }

    auto fail = [](const std::string & what) { throw std::runtime_error("clover: invalid hyperparameter: " + what); };
    if (hparams.diffusion_block_size == 0)  fail("diffusion.block_size must be > 0");
    if (hparams.ssm_d_conv < 2)             fail("ssm.conv_kernel must be >= 2");
    if (hparams.ssm_n_group == 0 || hparams.ssm_dt_rank == 0 || hparams.ssm_dt_rank % hparams.ssm_n_group != 0) {
        fail("ssm.time_step_rank (value heads) must be a positive multiple of ssm.group_count (key heads)");
    }
    if (hparams.ssm_d_inner != hparams.ssm_dt_rank * hparams.ssm_d_state) {
        fail("ssm.inner_size must equal value heads * ssm.state_size (dk = dv)");
    }
    if (hparams.n_expert == 0 || hparams.n_expert_used() == 0 || hparams.n_expert_used() > hparams.n_expert) {
        fail("expert_used_count must be in [1, expert_count]");
    }
    if (hparams.n_ff_exp() == 0 || hparams.n_ff_shexp == 0) fail("expert feed-forward lengths must be > 0");

    type = hparams.n_layer() == 40 ? LLM_TYPE_35B_A3B : LLM_TYPE_UNKNOWN;
}

void llama_model_clover::load_arch_tensors(llama_model_loader & ml) {
    LLAMA_LOAD_LOCALS;
    GGML_UNUSED(ml);

    tok_embd    = create_tensor(tn(LLM_TENSOR_TOKEN_EMBD,  "weight"), { n_embd, n_vocab }, 0);
    output_norm = create_tensor(tn(LLM_TENSOR_OUTPUT_NORM, "weight"), { n_embd }, 0);
    output      = create_tensor(tn(LLM_TENSOR_OUTPUT,      "weight"), { n_embd, n_vocab }, TENSOR_NOT_REQUIRED);
    if (output == nullptr) {
        output = create_tensor(tn(LLM_TENSOR_TOKEN_EMBD, "weight"), { n_embd, n_vocab }, TENSOR_DUPLICATED);
    }

    const int64_t d_state   = hparams.ssm_d_state;   // dk = dv
    const int64_t n_k_heads = hparams.ssm_n_group;
    const int64_t n_v_heads = hparams.ssm_dt_rank;
    const int64_t key_dim   = d_state * n_k_heads;
    const int64_t value_dim = d_state * n_v_heads;
    const int64_t conv_dim  = 2 * key_dim + value_dim;
    const int64_t n_ff_exp  = hparams.n_ff_exp();
    const int64_t n_ff_sh   = hparams.n_ff_shexp;

    std::string block_op;
    ml.get_key(LLM_KV_BLOCK_OPERATOR, block_op, false);
    const bool release = block_op == "release-bd-softmax";
    // the release's block softmax tensors: their shape is the checkpoint's (the math is not public)
    auto keep_as_is = [&](llm_tensor t, int il) -> ggml_tensor * {
        const std::string name = tn(t, il).str();
        const ggml_tensor * meta = ml.get_tensor_meta(name.c_str());
        if (!meta) {
            throw std::runtime_error("clover: missing tensor '" + name + "' (clover.block_operator = release-bd-softmax)");
        }
        const int64_t * ne = meta->ne;
        switch (ggml_n_dims(meta)) {
            case 1:  return create_tensor(tn(t, il), { ne[0] }, 0);
            case 2:  return create_tensor(tn(t, il), { ne[0], ne[1] }, 0);
            case 3:  return create_tensor(tn(t, il), { ne[0], ne[1], ne[2] }, 0);
            default: return create_tensor(tn(t, il), { ne[0], ne[1], ne[2], ne[3] }, 0);
        }
    };

    for (int il = 0; il < n_layer; ++il) {
        auto & layer = layers[il];

        layer.attn_norm      = create_tensor(tn(LLM_TENSOR_ATTN_NORM,      "weight", il), { n_embd }, 0);
        layer.attn_post_norm = create_tensor(tn(LLM_TENSOR_ATTN_POST_NORM, "weight", il), { n_embd }, 0);

        if (!hparams.is_recr(il)) {
            create_tensor_qkv(layer, il, n_embd, n_embd_head_k * n_head * 2, n_embd_k_gqa, n_embd_v_gqa, 0);
            layer.wo          = create_tensor(tn(LLM_TENSOR_ATTN_OUT,    "weight", il), { n_embd_head_k * n_head, n_embd }, 0);
            layer.attn_q_norm = create_tensor(tn(LLM_TENSOR_ATTN_Q_NORM, "weight", il), { n_embd_head_k }, 0);
            layer.attn_k_norm = create_tensor(tn(LLM_TENSOR_ATTN_K_NORM, "weight", il), { n_embd_head_k }, 0);
        } else {
            layer.wqkv            = create_tensor(tn(LLM_TENSOR_ATTN_QKV,         "weight", il), { n_embd, conv_dim }, 0);
            layer.wqkv_gate       = create_tensor(tn(LLM_TENSOR_ATTN_GATE,        "weight", il), { n_embd, value_dim }, 0);
            layer.ssm_beta        = create_tensor(tn(LLM_TENSOR_SSM_BETA,         "weight", il), { n_embd, n_v_heads }, 0);
            layer.ssm_alpha       = create_tensor(tn(LLM_TENSOR_SSM_ALPHA,        "weight", il), { n_embd, n_v_heads }, 0);
            if (!release) {
                layer.ssm_mix     = create_tensor(tn(LLM_TENSOR_SSM_MIX,          "weight", il), { n_embd, n_v_heads }, 0);
            }
            layer.ssm_conv1d      = create_tensor(tn(LLM_TENSOR_SSM_CONV1D,       "weight", il), { hparams.ssm_d_conv, conv_dim }, 0);
            if (hparams.ssm_d_conv_look > 0) {
                layer.ssm_conv1d_look = create_tensor(tn(LLM_TENSOR_SSM_CONV1D_LOOK, "weight", il), { hparams.ssm_d_conv_look, conv_dim }, 0);
            }
            layer.ssm_dt          = create_tensor(tn(LLM_TENSOR_SSM_DT,           "bias",   il), { n_v_heads }, 0);
            layer.ssm_a           = create_tensor(tn(LLM_TENSOR_SSM_A_NOSCAN,               il), { n_v_heads }, 0);
            if (!release) {
                layer.ssm_block_calib = create_tensor(tn(LLM_TENSOR_SSM_BLOCK_CALIB,          il), { n_v_heads, 2 }, 0);
            } else {
                layer.ssm_bd_logit_scale  = keep_as_is(LLM_TENSOR_SSM_BD_LOGIT_SCALE,  il);
                layer.ssm_bd_history_bias = keep_as_is(LLM_TENSOR_SSM_BD_HISTORY_BIAS, il);
                layer.ssm_bd_history_c    = keep_as_is(LLM_TENSOR_SSM_BD_HISTORY_C,    il);
            }
            layer.ssm_norm        = create_tensor(tn(LLM_TENSOR_SSM_NORM,         "weight", il), { d_state }, 0);
            layer.ssm_out         = create_tensor(tn(LLM_TENSOR_SSM_OUT,          "weight", il), { value_dim, n_embd }, 0);
        }

        layer.ffn_gate_inp  = create_tensor(tn(LLM_TENSOR_FFN_GATE_INP,  "weight", il), { n_embd, n_expert }, 0);
        layer.ffn_down_exps = create_tensor(tn(LLM_TENSOR_FFN_DOWN_EXPS, "weight", il), { n_ff_exp, n_embd, n_expert }, 0);
        create_tensor_gate_up_exps(layer, il, n_embd, n_ff_exp, n_expert, 0);

        layer.ffn_gate_inp_shexp = create_tensor(tn(LLM_TENSOR_FFN_GATE_INP_SHEXP, "weight", il), { n_embd }, 0);
        layer.ffn_gate_shexp     = create_tensor(tn(LLM_TENSOR_FFN_GATE_SHEXP,     "weight", il), { n_embd, n_ff_sh }, 0);
        layer.ffn_up_shexp       = create_tensor(tn(LLM_TENSOR_FFN_UP_SHEXP,       "weight", il), { n_embd, n_ff_sh }, 0);
        layer.ffn_down_shexp     = create_tensor(tn(LLM_TENSOR_FFN_DOWN_SHEXP,     "weight", il), { n_ff_sh, n_embd }, 0);

        if (hparams.n_ff_canvas > 0) {
            const int64_t n_ff_cv = hparams.n_ff_canvas;
            layer.ffn_gate_canvas = create_tensor(tn(LLM_TENSOR_FFN_GATE_CANVAS, "weight", il), { n_embd, n_ff_cv }, 0);
            layer.ffn_up_canvas   = create_tensor(tn(LLM_TENSOR_FFN_UP_CANVAS,   "weight", il), { n_embd, n_ff_cv }, 0);
            layer.ffn_down_canvas = create_tensor(tn(LLM_TENSOR_FFN_DOWN_CANVAS, "weight", il), { n_ff_cv, n_embd }, 0);
        }
    }
}

std::unique_ptr<llm_graph_context> llama_model_clover::build_arch_graph(const llm_graph_params & params) const {
    return std::make_unique<graph>(*this, params);
}

llama_model_clover::graph::graph(const llama_model & model, const llm_graph_params & params) :
    llm_build_delta_net_base(params), model(model) {
    GGML_ASSERT(cparams.n_rs_seq == 0 && "clover keeps no per-token state snapshots");
    GGML_ASSERT(ubatch.equal_seqs());
    {
        auto inp = std::make_unique<llm_graph_input_clover_blocks>(cparams, ubatch, n_expert, n_expert_used);
        bool release = false; // clover.block_operator = release-bd-softmax: GDN layers without ssm_mix
        for (int il = 0; il < n_layer; ++il) {
            release = release || (hparams.is_recr(il) && model.layers[il].ssm_mix == nullptr);
        }
        if (!release) {
            inp->gdn_write = ggml_new_tensor_4d(ctx0, GGML_TYPE_F32, 1, 1, 2 * inp->n_tok, inp->n_seqs);
            ggml_set_input(inp->gdn_write);
        }
        blocks = inp.get();
        res->add_input(std::move(inp));
    }

    ggml_tensor * inpL = build_inp_embd(model.tok_embd);

    auto * inp         = build_inp_mem_hybrid();
    ggml_tensor * pos  = build_inp_pos();
    ggml_tensor * outs = build_inp_out_ids();
    // the coreset sums the router over all canvas rows, and the canvas FFN runs on the canvas rows: the
    // last layer keeps every row until its MoE ran
    const bool rows_after_moe = blocks->n_coreset > 0 || (blocks->n_canvas > 0 && hparams.n_ff_canvas > 0);

    for (int il = 0; il < n_layer; ++il) {
        const auto & layer = model.layers[il];

        ggml_tensor * cur = build_norm(inpL, layer.attn_norm, nullptr, LLM_NORM_RMS, il);
        cb(cur, "attn_norm", il);

        cur = hparams.is_recr(il) ? build_layer_gdn(inp->get_recr(), cur, il)
                                  : build_layer_attn(inp->get_attn(), cur, pos, il);

        if (il == n_layer - 1 && outs && !rows_after_moe) {
            cur  = ggml_get_rows(ctx0, cur,  outs);
            inpL = ggml_get_rows(ctx0, inpL, outs);
        }

        ggml_tensor * h = ggml_add(ctx0, cur, inpL);
        cb(h, "attn_residual", il);

        cur = build_norm(h, layer.attn_post_norm, nullptr, LLM_NORM_RMS, il);
        cb(cur, "attn_post_norm", il);

        cur = ggml_add(ctx0, build_layer_moe(cur, il), h);
        if (il == n_layer - 1 && outs && rows_after_moe) {
            cur = ggml_get_rows(ctx0, cur, outs);
        }
        cur = build_cvec(cur, il);
        cb(cur, "l_out", il);

        inpL = cur;
    }

    ggml_tensor * cur = build_norm(inpL, model.output_norm, nullptr, LLM_NORM_RMS, -1);
    cb(cur, "result_norm", -1);
    res->t_embd = cur;

    cur = build_lora_mm(model.output, cur);
    cb(cur, "result_output", -1);
    res->t_logits = cur;

    ggml_build_forward_expand(gf, cur);
}

// Gated full attention: causal, a canvas sees the whole canvas too (the KV mask).
ggml_tensor * llama_model_clover::graph::build_layer_attn(
        llm_graph_input_attn_kv * inp,
        ggml_tensor *             cur,
        ggml_tensor *             inp_pos,
        int                       il) {
    const auto & layer = model.layers[il];
    const int64_t n_embd_head = hparams.n_embd_head_k();

    auto [q_full, Kcur, Vcur] = build_qkv(layer, cur,
            n_embd_head * 2, n_head, n_embd_head, n_head_kv, n_embd_head, n_head_kv, il, false);

    // q_proj rows per head: [dh query rows, dh gate rows]
    const size_t es = ggml_element_size(q_full);
    ggml_tensor * Qcur = ggml_view_3d(ctx0, q_full, n_embd_head, n_head, n_tokens,
            es * n_embd_head * 2, es * n_embd_head * 2 * n_head, 0);
    ggml_tensor * gate = ggml_view_3d(ctx0, q_full, n_embd_head, n_head, n_tokens,
            es * n_embd_head * 2, es * n_embd_head * 2 * n_head, es * n_embd_head);
    gate = ggml_cont_2d(ctx0, gate, n_embd_head * n_head, n_tokens);

    Qcur = build_norm(Qcur, layer.attn_q_norm, nullptr, LLM_NORM_RMS, il);
    Kcur = ggml_reshape_3d(ctx0, Kcur, n_embd_head, n_head_kv, n_tokens);
    Kcur = build_norm(Kcur, layer.attn_k_norm, nullptr, LLM_NORM_RMS, il);
    Vcur = ggml_reshape_3d(ctx0, Vcur, n_embd_head, n_head_kv, n_tokens);

    Qcur = ggml_rope_ext(ctx0, Qcur, inp_pos, nullptr, n_rot, rope_type, n_ctx_orig,
            freq_base, freq_scale, ext_factor, attn_factor, beta_fast, beta_slow);
    Kcur = ggml_rope_ext(ctx0, Kcur, inp_pos, nullptr, n_rot, rope_type, n_ctx_orig,
            freq_base, freq_scale, ext_factor, attn_factor, beta_fast, beta_slow);
    cb(Qcur, "Qcur", il);
    cb(Kcur, "Kcur", il);

    cur = build_attn(inp, nullptr, nullptr, nullptr, Qcur, Kcur, Vcur, nullptr, nullptr, nullptr,
            1.0f / sqrtf(float(n_embd_head)), il);
    cur = ggml_mul(ctx0, cur, ggml_sigmoid(ctx0, gate));
    cb(cur, "attn_gated", il);

    return build_lora_mm(layer.wo, cur);
}

// Clover GDN mixer: o = lambda * (memory read S^T q) + (1 - lambda) * (block attention), with
// a causal short convolution (plus look-ahead taps inside the canvas); the gated delta rule
// updates the memory with the committed tokens. A committed token is a block of one: its block
// attention is its own v.
ggml_tensor * llama_model_clover::graph::build_layer_gdn(
        llm_graph_input_rs * inp,
        ggml_tensor *        cur,
        int                  il) {
    const auto & layer = model.layers[il];
    const auto * mctx  = inp->mctx;

    const int64_t d_state   = hparams.ssm_d_state;
    const int64_t n_k_heads = hparams.ssm_n_group;
    const int64_t n_v_heads = hparams.ssm_dt_rank;
    const int64_t n_conv    = hparams.ssm_d_conv;
    const int64_t n_look    = hparams.ssm_d_conv_look;
    const int64_t conv_dim  = 2 * d_state * n_k_heads + d_state * n_v_heads;
    const int64_t n_seqs    = ubatch.n_seqs;
    const int64_t n_tok     = ubatch.n_seq_tokens;
    const int64_t n_canvas  = blocks->n_canvas;
    const int64_t n_commit  = n_tok - n_canvas;
    const int64_t B         = cparams.n_block > 0 ? cparams.n_block : hparams.diffusion_block_size;

    // the canvas rows [n_commit, n_tok) of a [ne0, ne1, n_tok, n_seqs] tensor
    auto canvas_rows = [&](ggml_tensor * x) {
        return ggml_view_4d(ctx0, x, x->ne[0], x->ne[1], n_canvas, x->ne[3], x->nb[1], x->nb[2], x->nb[3],
                            n_commit * x->nb[2]);
    };

    // projections
    ggml_tensor * u = ggml_reshape_3d(ctx0, build_lora_mm(layer.wqkv, cur), conv_dim, n_tok, n_seqs);
    ggml_tensor * z = build_lora_mm(layer.wqkv_gate, cur);

    ggml_tensor * beta  = ggml_sigmoid(ctx0, build_lora_mm(layer.ssm_beta, cur));          // [Hv, n]
    ggml_tensor * decay = ggml_softplus(ctx0, ggml_add(ctx0, build_lora_mm(layer.ssm_alpha, cur), layer.ssm_dt));
    decay = ggml_mul(ctx0, decay, layer.ssm_a);                                               // ssm_a = -exp(A_log)

    const bool release = layer.ssm_mix == nullptr; // clover.block_operator = release-bd-softmax

    // causal taps over [committed conv tail ; u]; the new tail ends before the canvas
    ggml_tensor * conv_states_all = mctx->get_r_l(il);
    ggml_tensor * tail = build_rs(inp, conv_states_all, hparams.n_embd_r(), n_seqs);
    tail = ggml_reshape_3d(ctx0, tail, n_conv - 1, conv_dim, n_seqs);
    ggml_tensor * conv_in = ggml_concat(ctx0, tail, ggml_transpose(ctx0, u), 0);            // [K-1+n, C, n_seqs]
    {
        const int64_t row_count = (n_conv - 1) * conv_dim;
        ggml_tensor * new_tail = ggml_view_3d(ctx0, conv_in, n_conv - 1, conv_dim, n_seqs,
                conv_in->nb[1], conv_in->nb[2], ggml_row_size(conv_in->type, n_commit));
        ggml_build_forward_expand(gf, ggml_cpy(ctx0, new_tail,
                ggml_view_2d(ctx0, conv_states_all, row_count, n_seqs, conv_states_all->nb[1],
                        mctx->get_head() * ggml_row_size(conv_states_all->type, row_count))));
    }
    ggml_tensor * conv = ggml_ssm_conv(ctx0, conv_in, layer.ssm_conv1d);                     // [C, n, n_seqs]
    // ... plus look-ahead taps on the next rows of the canvas (zero past its end; none for one token)
    if (n_look > 0 && n_canvas > 1) {
        ggml_tensor * conv4 = ggml_reshape_4d(ctx0, conv, conv_dim, 1, n_tok, n_seqs);
        ggml_tensor * u_pad = ggml_pad(ctx0, ggml_cont(ctx0, canvas_rows(ggml_reshape_4d(ctx0, u, conv_dim, 1, n_tok, n_seqs))),
                                       0, 0, (int) n_look, 0);                                 // [C, 1, n_canvas+R, .]
        ggml_tensor * taps  = ggml_cont(ctx0, ggml_transpose(ctx0, layer.ssm_conv1d_look));    // [C, R]
        ggml_tensor * look  = canvas_rows(conv4);
        for (int64_t j = 0; j < n_look; ++j) {
            ggml_tensor * ahead = ggml_view_4d(ctx0, u_pad, conv_dim, 1, n_canvas, n_seqs,
                    u_pad->nb[1], u_pad->nb[2], u_pad->nb[3], (j + 1) * u_pad->nb[2]);
            look = ggml_add(ctx0, look, ggml_mul(ctx0, ahead, ggml_view_1d(ctx0, taps, conv_dim, j * taps->nb[1])));
        }
        if (n_commit > 0) {
            ggml_tensor * committed = ggml_view_4d(ctx0, conv4, conv_dim, 1, n_commit, n_seqs,
                    conv4->nb[1], conv4->nb[2], conv4->nb[3], 0);
            look = ggml_concat(ctx0, committed, look, 2);
        }
        conv = ggml_reshape_3d(ctx0, look, conv_dim, n_tok, n_seqs);
    }
    conv = ggml_silu(ctx0, conv);
    cb(conv, "conv_out", il);

    const size_t es  = ggml_element_size(conv);
    const size_t nb1 = ggml_row_size(conv->type, conv_dim);
    ggml_tensor * q = ggml_view_4d(ctx0, conv, d_state, n_k_heads, n_tok, n_seqs, es * d_state, nb1, nb1 * n_tok, 0);
    ggml_tensor * k = ggml_view_4d(ctx0, conv, d_state, n_k_heads, n_tok, n_seqs, es * d_state, nb1, nb1 * n_tok,
            es * d_state * n_k_heads);
    ggml_tensor * v = ggml_view_4d(ctx0, conv, d_state, n_v_heads, n_tok, n_seqs, es * d_state, nb1, nb1 * n_tok,
            es * 2 * d_state * n_k_heads);
    v = ggml_cont(ctx0, v);

    // q / sqrt(sum q^2 + 1e-6); key heads tiled over value heads (the converter re-orders value heads)
    q = build_gdn_l2_norm(ctx0, q, 1e-6f);
    k = build_gdn_l2_norm(ctx0, k, 1e-6f);

    ggml_tensor * state = build_rs(inp, mctx->get_s_l(il), hparams.n_embd_s(), n_seqs);
    state = ggml_reshape_4d(ctx0, state, d_state, d_state, n_v_heads, n_seqs);
    auto store_state = [&](ggml_tensor * new_state) {
        ggml_build_forward_expand(gf, ggml_cpy(ctx0, new_state,
                ggml_view_2d(ctx0, mctx->get_s_l(il), hparams.n_embd_s(), n_seqs, mctx->get_s_l(il)->nb[1],
                        mctx->get_head() * hparams.n_embd_s() * ggml_element_size(mctx->get_s_l(il)))));
    };

    ggml_tensor * o = nullptr;
    if (release) {
        // the trunk's gated delta rule, one step per token, output = read of the state after the
        // token's write (S_t^T q / sqrt(dk)): over the committed rows (their final state is kept),
        // then continued over the canvas rows from there (not kept)
        ggml_tensor * g4 = ggml_reshape_4d(ctx0, decay, 1, n_v_heads, n_tok, n_seqs);
        ggml_tensor * b4 = ggml_reshape_4d(ctx0, beta,  1, n_v_heads, n_tok, n_seqs);
        auto rows = [&](ggml_tensor * x, int64_t t0, int64_t n) {
            return ggml_cont(ctx0, ggml_view_4d(ctx0, x, x->ne[0], x->ne[1], n, x->ne[3], x->nb[1], x->nb[2], x->nb[3],
                                                t0 * x->nb[2]));
        };
        ggml_tensor * kept = state;
        for (const auto [t0, n] : { std::pair<int64_t, int64_t>{ 0, n_commit }, { n_commit, n_canvas } }) {
            if (n == 0) {
                continue;
            }
            auto [o_part, s_part] = n == n_tok ? build_delta_net_fused(q, k, v, g4, b4, kept, il)
                                               : build_delta_net_fused(rows(q, t0, n), rows(k, t0, n), rows(v, t0, n),
                                                                       rows(g4, t0, n), rows(b4, t0, n), kept, il);
            o = o ? ggml_concat(ctx0, o, o_part, 2) : o_part;
            if (t0 == 0) {
                kept = s_part;
            }
        }
        store_state(kept);
        o = ggml_reshape_4d(ctx0, ggml_cont(ctx0, o), d_state, n_v_heads, n_tok, n_seqs);
        cb(o, "o_trunk", il);
    } else {
        ggml_tensor * lambda = ggml_sigmoid(ctx0, build_lora_mm(layer.ssm_mix, cur));
        lambda = ggml_reshape_4d(ctx0, lambda, 1, n_v_heads, n_tok, n_seqs);

        // memory: two delta-rule steps per token, a read (S^T q / sqrt(dk) of the state before the
        // token) and a write (committed tokens only)
        auto twice = [&](ggml_tensor * x, int64_t width) { // [width, n_tok, n_seqs] -> [width, 2 n_tok, n_seqs], rows 2t, 2t+1 = row t
            x = ggml_reshape_4d(ctx0, x, width, 1, n_tok, n_seqs);
            return ggml_reshape_3d(ctx0, ggml_repeat_4d(ctx0, x, width, 2, n_tok, n_seqs), width, 2 * n_tok, n_seqs);
        };
        ggml_tensor * q2 = ggml_reshape_4d(ctx0, twice(q, d_state * n_k_heads), d_state, n_k_heads, 2 * n_tok, n_seqs);
        ggml_tensor * k2 = ggml_reshape_4d(ctx0, twice(k, d_state * n_k_heads), d_state, n_k_heads, 2 * n_tok, n_seqs);
        ggml_tensor * v2 = ggml_reshape_4d(ctx0, twice(v, d_state * n_v_heads), d_state, n_v_heads, 2 * n_tok, n_seqs);
        ggml_tensor * w  = blocks->gdn_write;
        ggml_tensor * g2 = ggml_mul(ctx0, ggml_reshape_4d(ctx0, twice(decay, n_v_heads), 1, n_v_heads, 2 * n_tok, n_seqs), w);
        ggml_tensor * b2 = ggml_mul(ctx0, ggml_reshape_4d(ctx0, twice(beta,  n_v_heads), 1, n_v_heads, 2 * n_tok, n_seqs), w);

        auto [gdn_out, new_state] = build_delta_net_fused(q2, k2, v2, g2, b2, state, il);
        store_state(new_state);

        // the read steps' outputs (even rows)
        ggml_tensor * o_mem = ggml_reshape_4d(ctx0, ggml_cont(ctx0, gdn_out), d_state * n_v_heads, 2, n_tok, n_seqs);
        o_mem = ggml_view_4d(ctx0, o_mem, d_state * n_v_heads, 1, n_tok, n_seqs, o_mem->nb[1], o_mem->nb[2], o_mem->nb[3], 0);
        o_mem = ggml_reshape_4d(ctx0, ggml_cont(ctx0, o_mem), d_state, n_v_heads, n_tok, n_seqs);
        cb(o_mem, "o_mem", il);

        // block attention: a committed token's is its own v; the canvas attends bidirectionally over
        // itself with the calibrated temperature tau = exp(theta + phi * ln(B / B0)):
        // per head [d, n_canvas, Hv, n_seqs]
        ggml_tensor * o_blk = v;
        if (n_canvas > 1) {
            if (n_k_heads != n_v_heads) {
                q = ggml_repeat_4d(ctx0, q, d_state, n_v_heads, n_tok, n_seqs);
                k = ggml_repeat_4d(ctx0, k, d_state, n_v_heads, n_tok, n_seqs);
            }
            ggml_tensor * qh = ggml_cont(ctx0, ggml_permute(ctx0, canvas_rows(q), 0, 2, 1, 3));
            ggml_tensor * kh = ggml_cont(ctx0, ggml_permute(ctx0, canvas_rows(k), 0, 2, 1, 3));
            ggml_tensor * vt = ggml_cont(ctx0, ggml_permute(ctx0, canvas_rows(v), 1, 2, 0, 3));     // [n_canvas, dv, Hv, .]

            const float log_ratio = logf(float(B) / float(hparams.diffusion_block_size));
            ggml_tensor * theta = ggml_view_1d(ctx0, layer.ssm_block_calib, n_v_heads, 0);
            ggml_tensor * phi   = ggml_view_1d(ctx0, layer.ssm_block_calib, n_v_heads, layer.ssm_block_calib->nb[1]);
            ggml_tensor * tau   = ggml_exp(ctx0, ggml_add(ctx0, theta, ggml_scale(ctx0, phi, log_ratio)));
            tau = ggml_reshape_4d(ctx0, tau, 1, 1, n_v_heads, 1);

            ggml_tensor * kq = ggml_mul_mat(ctx0, kh, ggml_mul(ctx0, qh, tau));  // [keys, queries, Hv, .]
            kq = ggml_soft_max(ctx0, kq);
            ggml_tensor * o_canvas = ggml_mul_mat(ctx0, vt, kq);                 // [dv, n_canvas, Hv, .]
            o_canvas = ggml_cont(ctx0, ggml_permute(ctx0, o_canvas, 0, 2, 1, 3)); // [dv, Hv, n_canvas, .]
            if (n_commit > 0) {
                ggml_tensor * v_commit = ggml_view_4d(ctx0, v, d_state, n_v_heads, n_commit, n_seqs, v->nb[1], v->nb[2], v->nb[3], 0);
                o_canvas = ggml_concat(ctx0, v_commit, o_canvas, 2);
            }
            o_blk = o_canvas;
        }
        cb(o_blk, "o_blk", il);

        // o = lambda * o_mem + (1 - lambda) * o_blk
        o = ggml_add(ctx0, o_blk, ggml_mul(ctx0, ggml_sub(ctx0, o_mem, o_blk), lambda));
    }

    // y = norm_w * rmsnorm(o) * silu(z), then the output projection
    z = ggml_reshape_4d(ctx0, z, d_state, n_v_heads, n_tok, n_seqs);
    o = ggml_mul(ctx0, build_norm(o, layer.ssm_norm, nullptr, LLM_NORM_RMS, il), ggml_silu(ctx0, z));
    o = ggml_reshape_2d(ctx0, o, d_state * n_v_heads, n_tok * n_seqs);
    cb(o, "gdn_out", il);

    return build_lora_mm(layer.ssm_out, o);
}

ggml_tensor * llama_model_clover::graph::build_layer_moe(ggml_tensor * cur, int il) {
    const auto & layer = model.layers[il];
    const int64_t n_tok = blocks->n_tok, n_seqs = blocks->n_seqs, n_canvas = blocks->n_canvas;
    const int64_t n_commit = n_tok - n_canvas;

    // rows [t0, t0 + n) of every sequence of x [n_embd, n_tok * n_seqs], contiguous [n_embd, n * n_seqs]
    // (the coreset and the canvas FFN treat the canvas rows apart: x must still have every row)
    auto rows = [&](ggml_tensor * x, int64_t t0, int64_t n) {
        GGML_ASSERT(x->ne[1] == n_tok * n_seqs); // the output rows are taken after the last MoE
        ggml_tensor * x3 = ggml_reshape_3d(ctx0, x, n_embd, n_tok, n_seqs);
        ggml_tensor * v  = ggml_view_3d(ctx0, x3, n_embd, n, n_seqs, x3->nb[1], x3->nb[2], t0 * x3->nb[1]);
        return ggml_reshape_2d(ctx0, ggml_cont(ctx0, v), n_embd, n * n_seqs);
    };

    // routed experts of rows x: selection bias (0 / -inf per expert and row, nullptr = none), router
    // logits (nullptr = computed here), experts per row
    auto routed_ffn = [&](ggml_tensor * x, ggml_tensor * bias, ggml_tensor * logits, int64_t n_used) {
        return build_moe_ffn(x,
                layer.ffn_gate_inp, layer.ffn_up_exps, layer.ffn_gate_exps, layer.ffn_down_exps,
                bias, n_expert, n_used, LLM_FFN_SILU, hparams.expert_weights_norm,
                hparams.expert_weights_scale, LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX, il,
                logits, layer.ffn_gate_up_exps, layer.ffn_up_exps_s, layer.ffn_gate_exps_s, layer.ffn_down_exps_s);
    };

    ggml_tensor * routed = nullptr;
    const int64_t C = blocks->n_coreset;
    if (C == 0) {
        routed = routed_ffn(cur, nullptr, nullptr, n_expert_used);
    } else {
        // the block expert coreset (spec/model.md, "MoE"): the canvas rows of each sequence elect the
        // C >= k experts of highest summed router probability; each canvas row routes its top k
        // among them (a -inf selection bias elsewhere; the weights stay the rows' own
        // probabilities, renormalised as the model says). The committed rows route fully.
        ggml_tensor * xc     = rows(cur, n_commit, n_canvas);
        ggml_tensor * logits = build_lora_mm(layer.ffn_gate_inp, xc);                             // [E, n_canvas * n_seqs]
        ggml_tensor * probs  = ggml_reshape_3d(ctx0, ggml_soft_max(ctx0, logits), n_expert, n_canvas, n_seqs);
        ggml_tensor * score  = ggml_sum_rows(ctx0, ggml_cont(ctx0, ggml_permute(ctx0, probs, 1, 0, 2, 3))); // [1, E, n_seqs]
        ggml_tensor * core   = ggml_argsort_top_k(ctx0, ggml_reshape_2d(ctx0, score, n_expert, n_seqs), C); // [C, n_seqs]
        cb(core, "ffn_moe_coreset", il);
        ggml_tensor * bias = ggml_set_rows(ctx0, ggml_fill(ctx0, score, -INFINITY),
                                           ggml_fill(ctx0, ggml_get_rows(ctx0, score, core), 0.0f), core); // [1, E, n_seqs]
        bias = ggml_repeat_4d(ctx0, ggml_reshape_3d(ctx0, bias, n_expert, 1, n_seqs), n_expert, n_canvas, n_seqs, 1);
        bias = ggml_reshape_2d(ctx0, bias, n_expert, n_canvas * n_seqs);
        cb(bias, "ffn_moe_coreset_bias", il);
        routed = ggml_reshape_3d(ctx0, routed_ffn(xc, bias, logits, n_expert_used), n_embd, n_canvas, n_seqs);
        if (n_commit > 0) {
            ggml_tensor * rm = routed_ffn(rows(cur, 0, n_commit), nullptr, nullptr, n_expert_used);
            routed = ggml_concat(ctx0, ggml_reshape_3d(ctx0, rm, n_embd, n_commit, n_seqs), routed, 1);
        }
        routed = ggml_reshape_2d(ctx0, routed, n_embd, n_tok * n_seqs);
    }
    cb(routed, "ffn_moe_out", il);

    ggml_tensor * shared = build_ffn(cur,
            layer.ffn_up_shexp,   nullptr, layer.ffn_up_shexp_s,
            layer.ffn_gate_shexp, nullptr, layer.ffn_gate_shexp_s,
            layer.ffn_down_shexp, nullptr, layer.ffn_down_shexp_s,
            nullptr, LLM_FFN_SILU, LLM_FFN_PAR, il);
    shared = ggml_mul(ctx0, shared, ggml_sigmoid(ctx0, build_lora_mm(layer.ffn_gate_inp_shexp, cur)));
    cb(shared, "ffn_shexp_gated", il);

    ggml_tensor * out = ggml_add(ctx0, routed, shared);
    if (layer.ffn_gate_canvas == nullptr || blocks->n_canvas == 0) {
        return out;
    }

    // the canvas FFN (spec/model.md): a dense SwiGLU on the MoE's input, added on the canvas rows only
    ggml_tensor * canvas = build_ffn(rows(cur, n_commit, n_canvas),
            layer.ffn_up_canvas,   nullptr, nullptr,
            layer.ffn_gate_canvas, nullptr, nullptr,
            layer.ffn_down_canvas, nullptr, nullptr,
            nullptr, LLM_FFN_SILU, LLM_FFN_PAR, il);
    cb(canvas, "ffn_canvas", il);
    canvas = ggml_reshape_3d(ctx0, ggml_add(ctx0, rows(out, n_commit, n_canvas), canvas), n_embd, n_canvas, n_seqs);
    if (n_commit > 0) {
        canvas = ggml_concat(ctx0, ggml_reshape_3d(ctx0, rows(out, 0, n_commit), n_embd, n_commit, n_seqs), canvas, 1);
    }
    return ggml_reshape_2d(ctx0, canvas, n_embd, n_tok * n_seqs);
}
