"""The GGUF metadata of our own (spec/gguf-layout.md): the architecture name, our keys and their
values. One owner for the file format's names: the converter writes them (clover_convert.config
re-exports this module's names) and the readers read them (clover_gguf.reader, ``clover inspect``);
the standard keys are gguf-py's (GGUFWriter.add_*, gguf.Keys). No imports: cheap for both.
"""

from __future__ import annotations

__all__ = [
    "ARCH",
    "CAUSAL_ARCHS",
    "KEY_RECURRENT_LAYERS",
    "KEY_CONV_LOOKAHEAD",
    "KEY_DIFFUSION_BLOCK_SIZE",
    "KEY_SEMANTICS",
    "SEMANTICS",
    "KEY_BLOCK_OPERATOR",
    "BLOCK_OPERATOR_CLOVER",
    "BLOCK_OPERATOR_RELEASE",
    "BLOCK_OPERATORS",
    "KEY_EXPERT_CORESET",
    "KEY_CANVAS_FFN_LENGTH",
    "CONFIG_EXPERT_CORESET",
]

ARCH = "clover"
# architectures the runtime also loads, for causal decoding only (llama.cpp's own graph, no canvas):
# Qwen3.5/3.6-MoE, which the release's converter and every conversion of those models write
CAUSAL_ARCHS = ("qwen35moe",)
KEY_RECURRENT_LAYERS = "{arch}.attention.recurrent_layers"  # bool per layer: GDN (linear_attention)
KEY_CONV_LOOKAHEAD = "{arch}.ssm.conv_lookahead"            # R, the lookahead conv taps
KEY_DIFFUSION_BLOCK_SIZE = "{arch}.diffusion.block_size"    # B0, the training block size
KEY_SEMANTICS = "{arch}.semantics"                          # string: SEMANTICS, what the weights were trained for
KEY_EXPERT_CORESET = "{arch}.expert_coreset"                # uint32: the file's default block expert coreset C
                                                            # (spec/model.md "MoE"; 0 or absent = off)
KEY_CANVAS_FFN_LENGTH = "{arch}.canvas_feed_forward_length"  # uint32: the canvas FFN's width (spec/model.md,
                                                                # "The canvas FFN"); absent = none
CONFIG_EXPERT_CORESET = "expert_coreset"                    # config.json's key for it (the converter writes it)

# Which semantics the weights were trained for (spec/model.md): the GGUF's KEY_SEMANTICS (and
# config.json's clover_convert.config.CONFIG_SEMANTICS). "causal-shift" (spec v2) is the only
# current one: a causal committed prefix, logits at t predict the token at t+1. Weights of the
# retired in-place semantics (spec v1: logits at t for the token at t, bidirectional commits)
# have no such key.
SEMANTICS = "causal-shift"

# Which block operator the GGUF carries (docs/release-checkpoint.md, spec/gguf-layout.md), written
# as KEY_BLOCK_OPERATOR; a file without the key is Clover's (every GGUF made before the key existed):
# * BLOCK_OPERATOR_CLOVER: ours, the mixing gate in_proj_m and the calibrated block softmax
#   block_calib (spec/model.md); the GDN output of a committed token is
#   lambda * (memory read of the state before it) + (1 - lambda) * v. Runs B = 1, block
#   diffusion and draft-self.
# * BLOCK_OPERATOR_RELEASE: the released checkpoint's (CloverMoeModelLM), whose block softmax
#   (linear_attn.bd_softmax_logit_scale / history_bias / history_c) is not public. The tensors are
#   kept (blk.{i}.ssm_bd_*), never run. The trunk is Qwen3.5-MoE's: the GDN output of a committed
#   token is the gated delta rule's read of the state AFTER the token's write; a block pass runs
#   the trunk with the block softmax left out (the delta rule continued causally over the canvas,
#   not written back; look-ahead taps and full attention bidirectional inside the canvas). Runs
#   B = 1 and draft-self; block diffusion is refused.
KEY_BLOCK_OPERATOR = "{arch}.block_operator"
BLOCK_OPERATOR_CLOVER = "clover-mix-calib"
BLOCK_OPERATOR_RELEASE = "release-bd-softmax"
BLOCK_OPERATORS = (BLOCK_OPERATOR_CLOVER, BLOCK_OPERATOR_RELEASE)
