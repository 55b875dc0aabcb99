"""Numpy reference implementation of Clover (the oracle for the native code).

Follows /work/shared/clover-architecture.md, spec v2 (spec/model.md: causal commit,
next-token shift, decode blocks right after the committed text). It is meant to be
obviously correct, not fast: all math is float64, loops are written out per token and per
head where that reads more clearly. Only numpy is used.

API::

    cfg = CloverConfig.from_dict(config_json_dict)
    model = CloverReference(cfg, weights)          # or CloverReference.from_pretrained(folder)
    mem = model.new_memory()
    logits = model.commit(mem, tokens)                   # [n, vocab]: causal, writes mem
    logits = model.block_pass(mem, tokens, block_size)   # [n, vocab]: canvas, mem unchanged
    logits, layers = model.trace(mem, tokens, block_size)  # block pass + intermediates
    logits = causal_logits(model, tokens)                # commit on a fresh memory
    ppl = perplexity(model, tokens)
    res = generate(model, prompt_tokens, max_tokens=..., block_size=...)

The package is cut by job: the numeric primitives (:mod:`.primitives`), the forward model
(:mod:`.model`: config, memory, commit, block pass, causal logits, perplexity; its docstring
gives the conventions) and the decoding loop (:mod:`.decode`: generate, its result, the
candidate rule). Their public names are importable from here.
"""

from clover_testkit.reference.decode import GenerateResult, candidates, generate, ubatch_tokens
from clover_testkit.reference.model import (FULL, LINEAR, CloverConfig, CloverReference, Memory, causal_logits,
                                            coreset_select, hf_tensor_shapes, perplexity)
from clover_testkit.reference.primitives import (QK_NORM_EPS, bidirectional_conv, block_tau, l2_norm, rms_norm_1p,
                                                 rope_neox, sigmoid, silu, softmax, softplus)

__all__ = ["CloverConfig", "CloverReference", "Memory", "FULL", "LINEAR", "causal_logits", "coreset_select",
           "hf_tensor_shapes", "perplexity", "GenerateResult", "candidates", "generate", "ubatch_tokens",
           "QK_NORM_EPS", "bidirectional_conv", "block_tau", "l2_norm", "rms_norm_1p", "rope_neox", "sigmoid",
           "silu", "softmax", "softplus"]
