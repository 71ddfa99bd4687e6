"""What a run trained with: the objective, block size, mask token and window that ``csbp generate``
samples with and ``csbp eval`` scores with by default.

A run's Hugging Face export is ``RUN/final``; the run config sits one directory up. The export also
records the same fields in its ``config.json`` under ``csbp_training`` (the run config's shape:
``objective``, ``topology.window``, ``data.document_mask``/``reset_positions``), so an export copied
or moved away from its run directory samples and scores as trained. A checkpoint with neither (a
model csbp did not train) has nothing known about its training, except a Fast-dLLM v2 release, whose
``config.json`` ``bd_size`` stands for such a record (``fast_dllm_v2`` at block size ``bd_size``;
``csbp.models.hf_release``) and whose mask token is the ``|<MASK>|`` its ``tokenizer.json`` adds.
The mask token is read apart (:func:`trained_mask_token`): a run config may leave ``objective.mask_token_id`` to the data
artifact's manifest, so the export's record, which holds the id the run used, comes first there.

The export's ``generation_config.json`` describes, for other readers, how ``csbp generate`` samples
a block-diffusion model by default (:func:`sampling_record_of`, under ``csbp_block_diffusion``): the
trained objective, block size, mask token and window above, with the defaults of ``csbp generate``'s
flags. It is a description, not read back: ``csbp generate`` takes the training record and its flags.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from csbp.config.loading import read_yaml_file
from csbp.models.hf_release import (
    RELEASE_MASK_TOKEN,
    is_fast_dllm_release,
    release_mask_id,
    release_training_record,
)

if TYPE_CHECKING:
    from csbp.config.schema import RunConfig

#: the block-diffusion objectives a model can be sampled and scored as, and whether each predicts
#: position ``i`` from row ``i - 1`` (token shift)
TOKEN_SHIFT_OBJECTIVES = {"bd3": False, "mdlm": False, "fast_dllm_v2": True}


class NotBlockDiffusionError(ValueError):
    """A training record whose objective is not one ``csbp generate`` samples or ``csbp eval`` scores."""


#: the ``config.json`` key of an export that records how it was trained
EXPORT_KEY = "csbp_training"

#: the ``generation_config.json`` key of an export that records how ``csbp generate`` samples it
SAMPLING_KEY = "csbp_block_diffusion"

#: ``csbp generate``'s flag defaults for what the training record does not fix (and one denoising
#: step per position of the block)
GENERATE_DEFAULTS: dict[str, Any] = {
    "threshold": None,
    "temperature": 0.0,
    "top_k": None,
    "top_p": 1.0,
    "unmask_order": "confidence",
    "sub_block_size": None,
}


def training_record_of(cfg: RunConfig, mask_token_id: int | None, *, eos_token_id: int | None = None) -> dict[str, Any]:
    """What ``csbp generate``/``csbp eval`` need to sample and score an export as trained, in the run
    config's shape (read back by :func:`training_record`); the trainer writes it into ``config.json``.
    ``eos_token_id``: the data artifact's EOS id (``data.eos_token_id``, not a run config field: the
    id ``csbp generate --eos-token`` is checked against), left out when not known."""
    objective = cfg.objective
    record: dict[str, Any] = {
        "objective": {
            "name": objective.name,
            "block_size": objective.block_size,
            "noise": objective.noise,
            "mask_token_id": mask_token_id,
        },
        "topology": {"window": cfg.topology.window},
        "data": {
            "document_mask": cfg.document_mask,
            "reset_positions": cfg.data.reset_positions,
            "seq_len": cfg.data.seq_len,
        },
    }
    if eos_token_id is not None:
        record["data"]["eos_token_id"] = int(eos_token_id)
    return record


def sampling_record_of(cfg: RunConfig, mask_token_id: int | None) -> dict[str, Any] | None:
    """How ``csbp generate`` samples an export of ``cfg`` by default (module docstring); None for an
    objective it does not sample (``ar``, ``dflash``)."""
    name = cfg.objective.name
    if name not in TOKEN_SHIFT_OBJECTIVES:
        return None
    block_size = int(cfg.objective.block_size or cfg.data.seq_len)
    return {
        "objective": name,
        "block_size": block_size,
        "mask_token_id": mask_token_id,
        "token_shift": TOKEN_SHIFT_OBJECTIVES[name],
        "window": cfg.topology.window,
        "steps_per_block": block_size,
        **GENERATE_DEFAULTS,
    }


def training_record(model_dir: Path) -> tuple[dict[str, Any], Path] | None:
    """The run config a model was trained with (or the part of it its export records) and the file
    it came from: ``RUN/config.yaml`` for ``RUN/final``, else ``config.json``'s ``csbp_training``."""
    config_file = model_dir.parent / "config.yaml"
    if model_dir.name == "final" and config_file.is_file():
        loaded = read_yaml_file(config_file) or {}
        return (loaded, config_file) if isinstance(loaded, dict) else None
    exported = model_dir / "config.json"
    try:
        config = json.loads(exported.read_text(encoding="utf-8"))
        record = config.get(EXPORT_KEY)
    except (OSError, ValueError, AttributeError):
        return None
    if record is None:  # a Fast-dLLM v2 release records its block size as bd_size
        record = release_training_record(config, str(exported))
    return (record, exported) if isinstance(record, dict) else None


def run_objective_settings(model_dir: Path) -> dict[str, Any]:
    """``{"objective", "block_size", "window", "seq_len", "eos_token_id", "source"}`` (those set) from
    the training record (:func:`training_record`; ``eos_token_id``: :func:`recorded_eos_id`; the mask
    token: :func:`trained_mask_token`, which also reads checkpoints without a record); empty for a
    model without one. ``seq_len`` is the
    training row length: positions at or past it are ones the model never attended to (an export
    written before the record held it has none)."""
    found = training_record(model_dir)
    if found is None:
        return {}
    loaded, config_file = found
    objective = loaded.get("objective")
    if not isinstance(objective, dict) or "name" not in objective:
        return {}
    name = str(objective["name"])
    if name not in TOKEN_SHIFT_OBJECTIVES:
        raise NotBlockDiffusionError(
            f"{config_file} trained objective {name!r}, not a block-diffusion model ({', '.join(TOKEN_SHIFT_OBJECTIVES)})"
        )
    settings: dict[str, Any] = {"objective": name, "source": config_file}
    if objective.get("block_size") is not None:
        settings["block_size"] = int(objective["block_size"])
    topology = loaded.get("topology")
    if isinstance(topology, dict) and topology.get("window") is not None:
        settings["window"] = int(topology["window"])
    data = loaded.get("data")
    if isinstance(data, dict) and type(data.get("seq_len")) is int:
        settings["seq_len"] = data["seq_len"]
    eos = recorded_eos_id(model_dir)
    if eos is not None:
        settings["eos_token_id"] = eos
    return settings


def trained_mask_token(model_dir: Path) -> tuple[int, Path] | None:
    """The mask token id ``model_dir`` was trained with and the file that records it, from the most
    authoritative record that holds one: the export's ``csbp_training.objective.mask_token_id``
    (written at train time with the id the run used, the data artifact's when the run config left it
    unset), then the run config's ``objective.mask_token_id`` (``RUN/config.yaml`` for ``RUN/final``),
    then ``config.json``'s top-level ``mask_token_id`` (a training export writes it too; other
    block-diffusion checkpoints declare theirs there); None when none does. ``csbp generate`` and
    ``csbp eval`` both take it. Two records that disagree, or a value that is not a token id, are a
    ``ValueError`` naming the files: the model learnt to fill one mask token only."""
    exported = model_dir / "config.json"
    try:
        config = json.loads(exported.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        config = None
    config = config if isinstance(config, dict) else {}
    record = config.get(EXPORT_KEY)
    records: list[tuple[Any, Path, str]] = [(_mask_field(record), exported, f"{EXPORT_KEY}.objective.mask_token_id")]
    run_config = model_dir.parent / "config.yaml"
    if model_dir.name == "final" and run_config.is_file():
        loaded = read_yaml_file(run_config)
        records.append((_mask_field(loaded), run_config, "objective.mask_token_id"))
    records.append((config.get("mask_token_id"), exported, "mask_token_id"))
    if record is None and is_fast_dllm_release(config):  # the release's tokenizer adds |<MASK>|
        records.append((release_mask_id(model_dir), model_dir / "tokenizer.json", f"added token {RELEASE_MASK_TOKEN}"))
    found: tuple[int, Path, str] | None = None
    for value, where, field in records:
        if value is None:
            continue
        if type(value) is not int or value < 0:
            raise ValueError(
                f"{where}: {field} is {value!r}, not a token id (fix: set it to the id of the mask token the "
                "model was trained with, or remove it)"
            )
        if found is None:
            found = (value, where, field)
        elif value != found[0]:
            raise ValueError(
                f"{found[1]}: {found[2]} is {found[0]}, but {where}: {field} is {value}, and a model trains with one "
                "mask token (fix: correct or remove the record that is not the id it was trained with)"
            )
    return None if found is None else (found[0], found[1])


def _mask_field(record: Any) -> Any:
    """``objective.mask_token_id`` of a run config or training record (None where absent)."""
    objective = record.get("objective") if isinstance(record, dict) else None
    return objective.get("mask_token_id") if isinstance(objective, dict) else None


def recorded_eos_id(model_dir: Path) -> int | None:
    """The data EOS id the export's ``csbp_training`` records (``data.eos_token_id``; the run config
    ``RUN/config.yaml`` has no such field, so ``config.json`` is read for ``RUN/final`` too); None for
    an export written before the record, or a model csbp did not train. A value that is not a token
    id is a ``ValueError`` naming the file."""
    exported = model_dir / "config.json"
    try:
        record = json.loads(exported.read_text(encoding="utf-8")).get(EXPORT_KEY)
    except (OSError, ValueError, AttributeError):
        return None
    data = record.get("data") if isinstance(record, dict) else None
    if not isinstance(data, dict) or data.get("eos_token_id") is None:
        return None
    value = data["eos_token_id"]
    if type(value) is not int or value < 0:
        raise ValueError(
            f"{exported}: {EXPORT_KEY}.data.eos_token_id is {value!r}, not a token id (fix: set it to the id of the "
            "data's EOS token, or remove it)"
        )
    return value


def beyond_training_note(command: str, settings: dict[str, Any], used: int, fix: str) -> str | None:
    """One stderr line when a command runs the model at positions ``0 … used−1`` reaching past the
    ``seq_len`` it was trained on (``settings`` of :func:`run_objective_settings`), else None. A note,
    not a refusal: RoPE runs any position up to ``max_position_embeddings`` (which the commands do
    refuse past), and length extrapolation is a legitimate experiment; but the output there is not
    what training measured."""
    seq_len = settings.get("seq_len")
    if seq_len is None or used <= seq_len:
        return None
    return (
        f"csbp {command}: runs the model at positions up to {used - 1}, past the {seq_len}-token rows it was "
        f"trained on ({settings['source']}): it never attended that far, so quality may drop there ({fix})"
    )


HF_DEFAULT_POSITIONS = {
    "qwen3": ("Qwen3Config", 32768),
    "qwen2": ("Qwen2Config", 32768),
    "llama": ("LlamaConfig", 2048),
    "mistral": ("MistralConfig", 131072),
    "Fast_dLLM_Qwen": ("Qwen2Config", 32768),  # a Fast-dLLM v2 release: a patched Qwen2Config
}
"""``max_position_embeddings`` transformers reads for a config.json that sets none (its config class's
default, by ``model_type``); csbp's exports always write one."""


def position_limit(model_dir: Path) -> tuple[int, str]:
    """The positions the model at ``model_dir`` may use and where that number comes from: its
    config.json's ``max_position_embeddings``, else the default transformers' config class of its
    ``model_type`` reads (a config.json without one left ``--block-size`` and ``--max-new-tokens``
    unbounded: a 10**9-token block was an allocation traceback)."""
    from csbp.models.hf_io import read_json_object

    config_file = model_dir / "config.json"
    loaded = read_json_object(config_file)
    limit = loaded.get("max_position_embeddings")
    if type(limit) is int and limit > 0:
        return limit, f"of {config_file}"
    name, default = HF_DEFAULT_POSITIONS.get(str(loaded.get("model_type")), ("Qwen3Config", 32768))
    return default, f"(transformers' {name} default: {config_file} sets none)"
