"""``train.generate_after``: one greedy sample from the trained model when a run ends (rank 0).

The prompt is the start of the first validation row (the first training row when there is no
validation data): up to one block for BD3-LM and Fast-dLLM v2, 8 tokens for MDLM. The model then
fills two blocks (BD3-LM, Fast-dLLM v2) or the rest of its single ``seq_len`` block (MDLM) with
:func:`csbp.generation.sampler.generate`, greedily. ``ar`` models are not block-diffusion samplers
and get no sample (the summary says so). It stops where ``csbp generate`` on the run's export stops
(:func:`csbp.models.hf_io.stop_token_ids`): at the data's EOS and at every ``eos_token_id`` of the
export's ``generation_config.json``, a chat tokenizer's ``eos_token`` (``<|im_end|>``) among them.
"""

from __future__ import annotations

from pathlib import Path

from csbp.config.schema import RunConfig
from csbp.generation.sampler import GenerationConfig, generate
from csbp.generation.token_choice import NonFiniteLogits
from csbp.models.decoder import Decoder
from csbp.models.hf_io import stop_token_ids
from csbp.training.preflight import RunInputs

MDLM_PROMPT_TOKENS = 8
MAX_STEPS_PER_BLOCK = 16


SAMPLE_TEMPERATURE = 0.8
"""Greedy decoding of a small, briefly trained model repeats its most frequent token; sample."""
SAMPLE_TOP_K = 40


def sample_after_training(cfg: RunConfig, inputs: RunInputs, model: Decoder, export_dir: Path) -> str:
    """``"<prompt> => <completion>"`` decoded with the artifact's tokenizer (or why there is none);
    ``export_dir``: the run's export, whose ``generation_config.json`` lists the stop tokens."""
    name = cfg.objective.name
    if name == "ar" or inputs.mask_token_id is None:
        return "(no sample: ar models are not sampled by block diffusion; use a causal decoder)"
    tokenizer = inputs.artifact.load_tokenizer()
    split = inputs.val_split if inputs.val_split is not None else inputs.artifact.split("train")
    seq_len = cfg.data.seq_len
    block_size = seq_len if name == "mdlm" else int(cfg.objective.block_size or seq_len)
    prompt_length = MDLM_PROMPT_TOKENS if name == "mdlm" else block_size
    special = {inputs.mask_token_id, tokenizer.pad_id}
    prompt = [int(t) for t in split.tokens[0][:prompt_length] if int(t) not in special]
    new_tokens = seq_len - len(prompt) if name == "mdlm" else 2 * block_size
    config = GenerationConfig(
        max_new_tokens=max(1, new_tokens),
        block_size=block_size,
        steps_per_block=min(block_size, MAX_STEPS_PER_BLOCK),
        temperature=SAMPLE_TEMPERATURE,
        top_k=SAMPLE_TOP_K,
        seed=cfg.run.seed,
        token_shift=name == "fast_dllm_v2",
        window=cfg.topology.window,
    )
    stops = stop_token_ids(export_dir, tokenizer.eos_id, model.config.vocab_size, inputs.mask_token_id)
    try:
        result = generate(model.eval(), prompt, mask_token_id=inputs.mask_token_id, eos_id=stops, config=config)
    except NonFiniteLogits:  # a run whose weights diverged under train.nan_policy: skip still ends normally
        return "(no sample: the model's logits are not finite, its weights diverged; lower optim.lr)"
    return f"{tokenizer.decode(prompt)!r} => {tokenizer.decode(result.token_ids)!r}"
