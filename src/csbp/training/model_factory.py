"""Build the decoder a run trains, from ``cfg.model`` and the data artifact's vocabulary.

Two ways in:

* from scratch: the shape fields of ``cfg.model`` (``vocab_size`` unset: the artifact's tokenizer
  vocabulary), weights drawn by ``Decoder(..., seed=run.seed)``;
* ``model.init_from``: a local Hugging Face Qwen3/Qwen2/Llama/Mistral checkpoint directory (safetensors
  only). Shape fields left unset come from its ``config.json``; fields that are set must agree with
  it, except ``model.rope_theta`` and ``model.rope_scaling``, which replace the checkpoint's RoPE
  (how a short-context checkpoint is trained on longer sequences; the export records the new RoPE).
  The architecture always comes from the checkpoint.

Under YaRN (the run's ``model.rope_scaling``, the checkpoint's, or a dflash target's) ``factor x
original_max_position_embeddings`` must be a whole number of at least ``data.seq_len``
(:func:`check_yarn_context`): the export writes it as ``max_position_embeddings``, the extended
context, and would otherwise claim fewer positions than the run trains at. Without YaRN, a
checkpoint's ``max_position_embeddings`` below ``data.seq_len`` (:func:`check_position_limit`) refuses
a dflash run (its frozen target's features past its trained context are out of distribution) and
warns for a decoder run (training there extends the checkpoint's context, a legitimate use).

Either way every token id of the data must be an embedding row: an artifact whose tokenizer has
more ids than the model embeds is rejected before any weight is loaded.

Memory: the decoder is built on the ``meta`` device and sharded (FSDP2) before it is materialised,
so no rank ever holds the whole model on its device when ``train.fsdp`` is on; the weights (seeded
draws or the checkpoint's tensors) are then copied in one parameter at a time, each rank keeping
only its shard.

Dtypes: training keeps float32 master weights (float64 for ``precision: fp64``); bf16 compute
happens under autocast. ``model.dtype`` is the dtype the ``final/`` HF export is written in.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch import Tensor, nn

from csbp.config.schema import ModelSection, RunConfig
from csbp.data.artifact import Artifact
from csbp.models.config import DecoderConfig
from csbp.models.decoder import Decoder
from csbp.models.hf_config import check_exportable, yarn_context_problem
from csbp.models.hf_io import (
    decoder_config_from_hf,
    read_generation_config,
    read_hf_config,
    read_hf_weights,
    read_json_object,
)
from csbp.parallel.comm import TrafficCounter
from csbp.training.activation_checkpointing import checkpoint_layers
from csbp.training.compile_regions import compile_layers
from csbp.training.input_hints import checkpoint_directory_fix

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
_CHECKED_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "rms_norm_eps",
    "qk_norm",
    "tie_embeddings",
)


def master_dtype(cfg: RunConfig) -> torch.dtype:
    """Dtype of the trained parameters: float64 for fp64, float32 otherwise (bf16 autocasts)."""
    return torch.float64 if cfg.train.precision == "fp64" else torch.float32


def with_trained_arch(cfg: RunConfig, config: DecoderConfig) -> RunConfig:
    """``cfg`` with ``model.arch`` the family of the ``model.init_from`` checkpoint it trains
    (``config``), as the run records it (``RUN/config.yaml``, each checkpoint): the recipe's arch is
    never read there and would misstate the model (``qwen3`` for a Qwen2 checkpoint). Resuming ignores
    ``model.arch`` next to ``model.init_from`` (:mod:`csbp.training.resume_config`), so a run resumes
    from the recipe as written as well as from its record."""
    if cfg.model.init_from is None or cfg.model.arch == config.arch:
        return cfg
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"arch": config.arch})})


def export_dtype(cfg: RunConfig) -> torch.dtype:
    """Dtype of the exported HF checkpoint (``model.dtype``)."""
    return _DTYPES[cfg.model.dtype]


def decoder_config_for_run(cfg: RunConfig, artifact: Artifact) -> DecoderConfig:
    """The decoder shape of this run, checked against the artifact's vocabulary (``ValueError``)."""
    model = cfg.model
    if model.init_from is not None:
        config = _config_from_checkpoint(model)
    else:
        config = DecoderConfig(
            vocab_size=model.vocab_size if model.vocab_size is not None else artifact.vocab_size,
            hidden_size=_required(model, "hidden_size"),
            intermediate_size=_required(model, "intermediate_size"),
            num_layers=_required(model, "num_layers"),
            num_heads=_required(model, "num_heads"),
            num_kv_heads=_required(model, "num_kv_heads"),
            head_dim=_required(model, "head_dim"),
            rope_theta=float(model.rope_theta if model.rope_theta is not None else 10000.0),
            rope_scaling=model.rope_scaling.to_rope_scaling() if model.rope_scaling is not None else None,
            rms_norm_eps=float(model.rms_norm_eps if model.rms_norm_eps is not None else 1e-6),
            qk_norm=bool(model.qk_norm),
            tie_embeddings=bool(model.tie_embeddings),
            arch=model.arch,
            qkv_bias=model.arch == "qwen2",
        )
        try:
            check_exportable(config)
        except ValueError as exc:  # the final export would fail after training otherwise
            fix = "" if "(fix:" in str(exc) else " (fix: change model.arch or model.qk_norm)"
            raise ValueError(f"model.arch: {exc}{fix}") from None
    if artifact.vocab_size > config.vocab_size:
        if model.init_from is not None:
            past = mask_past_embedding("model.init_from", Path(str(model.init_from)), config.vocab_size, artifact)
            if past is not None:
                raise ValueError(past)
        if model.init_from is not None:
            raise ValueError(
                f"model.init_from: the data artifact {artifact.directory} has token ids up to "
                f"{artifact.vocab_size - 1} but the checkpoint {model.init_from} embeds only {config.vocab_size} ids "
                f"(fix: prepare the data with the checkpoint's tokenizer, csbp data prepare --tokenizer {model.init_from})"
            )
        raise ValueError(
            f"model.vocab_size: {config.vocab_size} ids, but the data artifact {artifact.directory} has token ids up "
            f"to {artifact.vocab_size - 1} (fix: set model.vocab_size >= {artifact.vocab_size}, or leave it unset to "
            "take the data tokenizer's)"
        )
    if model.init_from is not None:
        check_checkpoint_tokenizer(Path(str(model.init_from)), artifact)
    return config


def _yaml(value: object) -> str:
    """A config value as YAML writes it (``true``, not Python's ``True``)."""
    return str(value).lower() if isinstance(value, bool) else repr(value)


def mask_past_embedding(label: str, directory: Path, vocab_size: int, artifact: Artifact) -> str | None:
    """The refusal when the data's mask token (the ``<|mask|>`` the docs say to add after a checkpoint's
    ids) is past the ``vocab_size`` rows ``directory`` embeds, else None. Its fix names ``--mask-token``:
    the checkpoint's own tokenizer has no mask token for ``csbp data prepare`` to take."""
    mask_id = artifact.special_ids.get("mask")
    if mask_id is None or mask_id < vocab_size:
        return None
    name = artifact.manifest.get("tokenizer", {}).get("special_names", {}).get("mask", "<|mask|>")
    return (
        f"{label}: the checkpoint {directory} embeds {vocab_size} ids, and the data's mask "
        f"token {name!r} is id {mask_id}, past the embedding: the model has no row for it (fix: prepare the "
        f"data naming a token of the checkpoint's tokenizer that the data never holds, such as an unused "
        f"reserved token, as the mask: csbp data prepare --tokenizer {directory} --mask-token TOKEN)"
    )


def check_checkpoint_tokenizer(directory: Path, artifact: Artifact, label: str = "model.init_from") -> None:
    """``ValueError`` when the checkpoint's ``tokenizer.json`` (if it has one) maps a token to another
    id than the data's tokenizer does: its embeddings were trained for its own ids. The data's
    tokenizer may add tokens (a ``<|mask|>`` for block diffusion) but not renumber them. ``label``
    names the option that gave ``directory`` (``--model`` for ``csbp eval``)."""
    from tokenizers import Tokenizer  # noqa: PLC0415

    ckpt_file, data_file = directory / "tokenizer.json", artifact.directory / "tokenizer.json"
    if not ckpt_file.is_file() or not data_file.is_file():
        return
    if ckpt_file.read_bytes() == data_file.read_bytes():
        return
    ours = Tokenizer.from_file(str(data_file)).get_vocab(with_added_tokens=True)
    theirs = Tokenizer.from_file(str(ckpt_file)).get_vocab(with_added_tokens=True)
    moved = sorted((index, token) for token, index in theirs.items() if ours.get(token) != index)
    if moved:
        index, token = moved[0]
        found = ours.get(token)
        where = "lacks it" if found is None else f"has it as id {found}"
        raise ValueError(
            f"{label}: {ckpt_file} has token {token!r} as id {index} but the tokenizer of the data "
            f"{artifact.directory} {where} ({len(moved)} of {len(theirs)} tokens differ) (fix: prepare the data with "
            f"the checkpoint's tokenizer, csbp data prepare --tokenizer {directory}, adding tokens only after its ids)"
        )


def _required(model: ModelSection, name: str) -> int:
    value = getattr(model, name)
    if value is None:  # the schema already requires it; keep the type checker and the error honest
        raise ValueError(f"model.{name}: required when model.init_from is unset (fix: set model.{name})")
    return int(value)


def _config_from_checkpoint(model: ModelSection) -> DecoderConfig:
    directory = Path(str(model.init_from))
    config_file = directory / "config.json"
    if not config_file.is_file():
        fix = checkpoint_directory_fix(
            directory, "point it at a local directory with config.json and model.safetensors", "model.init_from"
        )
        raise ValueError(f"model.init_from: {directory} is not a HF checkpoint directory (no config.json) (fix: {fix})")
    hf_config = read_json_object(config_file)  # a damaged file is named
    try:
        config = decoder_config_from_hf(hf_config)
    except ValueError as exc:
        raise ValueError(f"model.init_from: {directory}: {exc}") from None
    read_generation_config(directory)  # the final export carries it: a damaged one fails now, not after training
    for name in _CHECKED_FIELDS:
        wanted = getattr(model, name)
        found = getattr(config, name)
        if wanted is not None and wanted != found:
            raise ValueError(
                f"model.{name}: the config sets {_yaml(wanted)} but the checkpoint {directory} has {_yaml(found)} "
                f"(fix: remove model.{name} to use the checkpoint's value)"
            )
    return with_rope_overrides(config, model)


def with_rope_overrides(config: DecoderConfig, model: ModelSection) -> DecoderConfig:
    """``config`` with the RoPE the run sets (``model.rope_theta``/``model.rope_scaling``) in place
    of the checkpoint's."""
    changes: dict[str, object] = {}
    if model.rope_theta is not None:
        changes["rope_theta"] = float(model.rope_theta)
    if model.rope_scaling is not None:
        changes["rope_scaling"] = model.rope_scaling.to_rope_scaling()
    return dataclasses.replace(config, **changes) if changes else config


def build_model(
    cfg: RunConfig,
    config: DecoderConfig,
    *,
    device: torch.device,
    shard: Callable[[Decoder], None] | None = None,
    counter: TrafficCounter | None = None,
) -> Decoder:
    """The decoder in its master dtype on ``device``: seeded random init, or the ``init_from`` weights.

    The module is built on the ``meta`` device (no memory), given its compiled regions
    (``train.compile``, :mod:`csbp.training.compile_regions`) and activation checkpointing
    (``train.activation_checkpointing``; recomputed collectives are counted in ``counter``) and passed to ``shard`` (FSDP2's ``fully_shard``) while
    still on meta; only then is it materialised on ``device``, and each rank fills only its own
    shards (:func:`load_full_weights`). The values equal an unsharded ``Decoder(config, seed=...)``
    or ``load_hf_checkpoint`` exactly.
    """
    dtype = master_dtype(cfg)
    model = Decoder(config, dtype=dtype, device="meta")
    compile_layers(model.layers, cfg.train.compile)
    checkpoint_layers(model.layers, cfg.train.activation_checkpointing, counter)
    if shard is not None:
        shard(model)
    model.to_empty(device=device)
    if cfg.model.init_from is None:
        generator = torch.Generator(device="cpu")
        generator.manual_seed(cfg.run.seed)
        load_full_weights(model, model.initial_weights(generator))
        return model
    if with_rope_overrides(read_hf_config(cfg.model.init_from), cfg.model) != config:
        raise ValueError(
            f"model.init_from: {cfg.model.init_from} changed while the run was starting "
            "(fix: do not modify the checkpoint during training)"
        )
    load_full_weights(model, read_hf_weights(cfg.model.init_from, model, dtype=dtype).items())
    return model


@torch.no_grad()
def load_full_weights(model: nn.Module, weights: Iterable[tuple[str, Tensor]]) -> None:
    """Copy full (unsharded) tensors into ``model``'s parameters, one at a time: a parameter sharded
    by FSDP2 (a ``DTensor``) receives only this rank's shard of it. Every parameter must be given."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    params = dict(model.named_parameters())
    missing = set(params)
    for name, full in weights:
        param = params[name]
        if isinstance(param, DTensor):
            value = full.to(device=param.device, dtype=param.dtype)
            shard = distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(shard.to_local())
        else:
            param.copy_(full)
        missing.discard(name)
    if missing:
        raise ValueError(f"no initial value for parameters {sorted(missing)[:3]}")


def check_yarn_context(cfg: RunConfig, config: DecoderConfig, *, target: str | None = None) -> None:
    """``ValueError`` (one line naming the field the YaRN rule came from) when ``config``'s YaRN rule
    has no export consistent with training at ``data.seq_len`` (:func:`yarn_context_problem`):
    checked before training, since the export at its end would otherwise fail. ``target``: a dflash
    run's target directory, whose RoPE its drafter takes."""
    gap = yarn_context_problem(config.rope_scaling, cfg.data.seq_len)
    if gap is None:
        return
    shorter = f"set data.seq_len: {gap.longest} or less" if gap.longest is not None else None
    if target is not None:
        field = f"objective.dflash.target: {target}/config.json rope_scaling"
        fixes = [shorter or "a target whose yarn factor x original_max_position_embeddings is whole"]
    elif cfg.model.rope_scaling is not None:
        field, fixes = "model.rope_scaling", [f"set model.rope_scaling.factor: {gap.factor}", shorter]
    else:
        original = config.rope_scaling.original_max_position_embeddings if config.rope_scaling else None
        field = f"model.init_from: {cfg.model.init_from}/config.json rope_scaling"
        fixes = [
            f"set model.rope_scaling: {{type: yarn, factor: {gap.factor}, original_max_position_embeddings: {original}}}",
            shorter,
        ]
    raise ValueError(f"{field}: {gap.why} (fix: {', or '.join(f for f in fixes if f)})")


def check_position_limit(
    cfg: RunConfig, config: DecoderConfig, *, target: str | None = None, warn: Callable[[str], None] | None = None
) -> None:
    """The checkpoint's ``max_position_embeddings`` (``model.init_from``'s, or a dflash ``target``'s)
    below ``data.seq_len`` with no YaRN rule extending it (YaRN is :func:`check_yarn_context`'s): a
    ``ValueError`` for a dflash target, which is frozen, so its features at positions it never saw are
    out of distribution and the drafter would learn from them; for a decoder run one ``warn`` line
    (training there extends the checkpoint's context, which the export then records), unless the run
    sets ``model.rope_scaling`` or ``model.rope_theta`` itself. None recorded: no limit."""
    source = target if target is not None else cfg.model.init_from
    if source is None or (config.rope_scaling is not None and config.rope_scaling.rope_type == "yarn"):
        return
    limit = read_json_object(Path(source) / "config.json").get("max_position_embeddings")
    seq_len = cfg.data.seq_len
    if type(limit) is not int or limit >= seq_len:
        return
    yarn = f"{{type: yarn, factor: {math.ceil(seq_len / limit)}, original_max_position_embeddings: {limit}}}"
    why = f"{source}/config.json max_position_embeddings {limit} is below data.seq_len {seq_len} and no YaRN rope_scaling extends it"
    if target is not None:
        raise ValueError(
            f"objective.dflash.target: {why}: the frozen target never saw positions past {limit}, so its features "
            f"there, which the drafter learns from, are out of distribution (fix: set data.seq_len: {limit} or less, "
            f"or use a copy of the target whose config.json has rope_scaling: {yarn})"
        )
    if warn is not None and cfg.model.rope_scaling is None and cfg.model.rope_theta is None:
        warn(
            f"model.init_from: {why}: the run trains the checkpoint at positions it never saw, extending its context "
            f"(the export records max_position_embeddings {seq_len}) (to extend it by RoPE scaling instead: set "
            f"model.rope_scaling: {yarn}; to stay inside: set data.seq_len: {limit} or less)"
        )
