"""Block-diffusion sampling from a trained csbp model (``csbp generate``).

* :mod:`~csbp.generation.sampler`: the block-by-block loop (:func:`generate`);
* :mod:`~csbp.generation.block_denoising`: one block for a batch of sequences (per-sequence state,
  the denoising steps);
* :mod:`~csbp.generation.token_choice`: proposals (greedy / temperature, top-k, top-p; mask logit
  excluded) and confidence-based unmasking;
* :mod:`~csbp.generation.forward`: the model calls, with the clean-prefix KV cache or by
  recomputing the prefix (the reference);
* :mod:`~csbp.generation.kv_cache`: the cache, attached to the decoder as an ``AttentionFn``.
* :mod:`~csbp.generation.run_settings`: what a run trained with (objective, block size, mask token,
  window), from its ``config.yaml``.
"""

from csbp.generation.forward import CachedBlockForward, RecomputeBlockForward
from csbp.generation.kv_cache import CachedPrefixAttention, PrefixKVCache
from csbp.generation.sampler import GenerationConfig, GenerationResult, generate, generate_batch
from csbp.generation.token_choice import choose_unmasked, propose_tokens, unmask_count

__all__ = [
    "CachedBlockForward",
    "CachedPrefixAttention",
    "GenerationConfig",
    "GenerationResult",
    "PrefixKVCache",
    "RecomputeBlockForward",
    "choose_unmasked",
    "generate",
    "generate_batch",
    "propose_tokens",
    "unmask_count",
]
