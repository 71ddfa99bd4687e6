"""The tokenizer files a model export carries: ``AutoTokenizer.from_pretrained(export)`` must give
the tokenizer the data was tokenized with, its special tokens, the run's mask token and the chat
template the data's chat records were rendered with, with no remote code.

The rule (:func:`export_tokenizer_for_run`, resolved with the other input checks, before training):

* ``tokenizer.json`` is always the data artifact's own copy, whose sha256 must be the manifest's
  tokenizer fingerprint: it is what every token id of the data means.
* The rest of a Hugging Face tokenizer directory (:data:`COMPANION_FILES`: ``tokenizer_config.json``,
  ``special_tokens_map.json``, chat template files, ``vocab.json``/``merges.txt``/``tokenizer.model``)
  comes from the first *source directory* that holds the data's tokenizer: ``data.tokenizer``, else
  the directory ``csbp data prepare --tokenizer`` read (the manifest's ``tokenizer.source``), else
  ``model.init_from`` (a decoder) or ``objective.dflash.target`` (a drafter). A directory holds the
  data's tokenizer when its ``tokenizer.json`` has the artifact's fingerprint (without one: when
  transformers converts its files to it). ``data.tokenizer`` naming another tokenizer is refused;
  the other candidates are passed over when they hold another one (a checkpoint whose tokenizer
  the data extended with a mask token).
* ``tokenizer_config.json`` names the run's mask token as ``mask_token`` (rewritten when it names
  none or another one), so the tokenizer's ``mask_token_id`` is the model's; this is done only
  when that id is an added token of ``tokenizer.json`` (naming a plain vocabulary entry would make
  transformers split it out of text). Its eos/pad/bos tokens stay the source's. An ``auto_map``
  (Python code of the directory, which csbp never runs: it reads ``tokenizer.json``) is dropped, so
  loading the export never asks to run code it does not hold.
* Chat template: when the data's chat records were rendered with one (the manifest's
  ``chat_template`` sha256), the export's is that one: the source directory's when it is the same,
  else the recorded source file's (``--chat-template PATH``) as ``chat_template.jinja``; when it is
  not found none is shipped, with a warning, rather than another.
* No source directory (a tokenizer trained by ``csbp data prepare --train-tokenizer``, or one whose
  directory is gone): a ``tokenizer_config.json`` is written naming the generic fast tokenizer class
  (``PreTrainedTokenizerFast``) and the data's eos/pad/mask tokens. Without it transformers would
  pick the architecture's tokenizer class, whose own pre-tokenizer can split text differently
  (transformers 5 loads the bare ``tokenizer.json`` of a ``qwen3`` export as a ``Qwen2Tokenizer``).
  When the data came from a tokenizer directory that is not found, a warning says what is lost.

The files are read here, once, and written into the export as read (:class:`ExportTokenizer`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from csbp.config.schema import RunConfig
from csbp.data.artifact import TOKENIZER_FILE, Artifact
from csbp.data.chat_template import (
    CONFIG_FILE,
    TEMPLATE_FILE,
    TEMPLATE_JSON_FILE,
    read_template_file,
    template_in_file,
)
from csbp.data.tokenizer import fingerprint_bytes, load_tokenizer, special_tokens_from_names

COMPANION_FILES = (
    CONFIG_FILE,
    "special_tokens_map.json",
    "added_tokens.json",
    TEMPLATE_FILE,
    TEMPLATE_JSON_FILE,
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)
"""The files of a HF tokenizer directory besides ``tokenizer.json`` that an export copies."""
GENERIC_CLASS = "PreTrainedTokenizerFast"


@dataclass(frozen=True)
class ExportTokenizer:
    """What an export writes for its tokenizer.

    Attributes:
        files: file name -> contents (``tokenizer.json`` always).
        source: the directory the companion files came from, None when ``tokenizer_config.json`` was
            generated.
        eos_id: the id of the ``eos_token`` the written ``tokenizer_config.json`` (else
            ``special_tokens_map.json``) names, None when it names none in ``tokenizer.json``: a chat
            tokenizer's end-of-turn token (``<|im_end|>``), which may differ from the data's EOS.
    """

    files: dict[str, bytes] = field(repr=False)
    source: Path | None
    eos_id: int | None = None


def export_tokenizer_for_run(
    cfg: RunConfig, artifact: Artifact, mask_token_id: int | None, warn: Callable[[str], None] | None = None
) -> ExportTokenizer:
    """The tokenizer files of ``cfg``'s exports (module docstring); ``mask_token_id``: the run's
    (None for ``ar``). One-line ``ValueError`` when ``data.tokenizer`` is not the data's tokenizer."""
    explicit = Path(cfg.data.tokenizer) if cfg.data.tokenizer is not None else None
    others: list[tuple[str, Path]] = []
    recorded = str(artifact.manifest["tokenizer"].get("source", "trained"))
    if recorded != "trained":
        others.append((f"the tokenizer {artifact.directory} was prepared with", Path(recorded)))
    if cfg.objective.dflash is not None:
        others.append(("objective.dflash.target", Path(cfg.objective.dflash.target)))
    elif cfg.model.init_from is not None:
        others.append(("model.init_from", Path(str(cfg.model.init_from))))
    return export_tokenizer(artifact, explicit, others, mask_token_id=mask_token_id, warn=warn)


def export_tokenizer(
    artifact: Artifact,
    explicit: Path | None,
    others: Sequence[tuple[str, Path]],
    *,
    mask_token_id: int | None,
    warn: Callable[[str], None] | None = None,
) -> ExportTokenizer:
    """The tokenizer files for data ``artifact``: companions from ``explicit`` (``data.tokenizer``,
    which must hold the data's tokenizer) or else the first of ``others`` (``(what, path)``) that
    holds it; a generated ``tokenizer_config.json`` when none does (module docstring)."""
    json_file = artifact.directory / TOKENIZER_FILE
    json_bytes = json_file.read_bytes() if json_file.is_file() else b""
    if fingerprint_bytes(json_bytes) != artifact.tokenizer_fingerprint:
        raise ValueError(
            f"data.train: {json_file} is not the tokenizer its manifest records (fingerprints differ); the artifact "
            "is damaged (fix: re-run csbp data prepare)"
        )
    backend = Tokenizer.from_str(json_bytes.decode("utf-8"))
    source = None
    if explicit is not None:
        check_data_tokenizer(explicit, artifact)
        source = _tokenizer_directory(explicit)
    else:
        recorded = Path(str(artifact.manifest["tokenizer"].get("source", "trained")))
        for _, path in others:
            directory = _tokenizer_directory(path)
            # converting a directory without tokenizer.json runs transformers: only for the one prepare converted
            if directory is not None and _holds(directory, artifact, convert=path == recorded):
                source = directory
                break
    files = {TOKENIZER_FILE: json_bytes}
    if source is None and explicit is None and warn is not None:
        _warn_when_lost(artifact, others, warn)
    if source is not None:
        files.update({name: (source / name).read_bytes() for name in COMPANION_FILES if (source / name).is_file()})
    generated = CONFIG_FILE not in files
    where = source or artifact.directory
    config = _generated_config(artifact, backend, mask_token_id) if generated else _config(where, files[CONFIG_FILE])
    changed = config.pop("auto_map", None) is not None  # csbp never ran that code: the export names none
    changed = _name_mask_token(config, backend, mask_token_id) or changed
    changed = _use_data_template(files, config, where, artifact, warn) or changed
    if generated or changed:
        files[CONFIG_FILE] = _json_bytes(config)
    return ExportTokenizer(files=files, source=source, eos_id=_eos_id(config, files, backend))


def check_data_tokenizer(path: Path, artifact: Artifact) -> None:
    """``ValueError`` (field ``data.tokenizer``) unless ``path``, a tokenizer file or directory, is the
    tokenizer ``artifact`` was prepared with."""
    if not path.exists():
        raise ValueError(f"data.tokenizer: {path} does not exist (fix: remove data.tokenizer, or correct the path)")
    same = path.is_dir() and _holds(path, artifact)
    if path.is_file():
        same = fingerprint_bytes(path.read_bytes()) == artifact.tokenizer_fingerprint
    if not same:
        raise ValueError(
            f"data.tokenizer: {path} is not the tokenizer {artifact.directory} was prepared with (fingerprints "
            "differ) (fix: remove data.tokenizer or re-run csbp data prepare with it)"
        )


def _tokenizer_directory(path: Path) -> Path | None:
    """The directory whose companion files go with tokenizer ``path`` (a directory, or its
    ``tokenizer.json``); None for a tokenizer file of another name or a path that is gone."""
    if path.is_dir():
        return path
    if path.is_file() and path.name == TOKENIZER_FILE:
        return path.parent
    return None


def _holds(directory: Path, artifact: Artifact, *, convert: bool = True) -> bool:
    """Whether ``directory`` holds the tokenizer ``artifact`` was prepared with (module docstring);
    ``convert``: one without ``tokenizer.json`` may be converted by transformers to find out."""
    json_file = directory / TOKENIZER_FILE
    if json_file.is_file():
        return fingerprint_bytes(json_file.read_bytes()) == artifact.tokenizer_fingerprint
    if not convert or not any((directory / name).is_file() for name in COMPANION_FILES if name != CONFIG_FILE):
        return False
    names = special_tokens_from_names(artifact.manifest["tokenizer"]["special_names"])
    try:  # a directory without tokenizer.json: as csbp data prepare converted it
        return load_tokenizer(directory, special=names).fingerprint == artifact.tokenizer_fingerprint
    except ValueError:
        return False


def _added_token(backend: Tokenizer, token_id: int | None) -> str | None:
    """The content of ``token_id`` when it is an added token of ``backend`` (None otherwise)."""
    if token_id is None:
        return None
    added = backend.get_added_tokens_decoder()
    return str(added[token_id].content) if token_id in added else None


def _eos_id(config: dict[str, Any], files: dict[str, bytes], backend: Tokenizer) -> int | None:
    """The id of the EOS token the exported tokenizer files name (``ExportTokenizer.eos_id``)."""
    names = [config.get("eos_token")]
    if "special_tokens_map.json" in files:
        try:
            special_map = json.loads(files["special_tokens_map.json"].decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            special_map = None
        if isinstance(special_map, dict):
            names.append(special_map.get("eos_token"))
    for name in names:
        name = name.get("content") if isinstance(name, dict) else name
        if isinstance(name, str):
            return backend.token_to_id(name)
    return None


def _config(directory: Path, data: bytes) -> dict[str, Any]:
    """The parsed ``tokenizer_config.json`` of ``directory`` (one-line ``ValueError`` when malformed)."""
    try:
        config = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        config = None
    if not isinstance(config, dict):
        raise ValueError(f"{directory / CONFIG_FILE}: not a JSON object (fix: restore the file)")
    return config


def _generated_config(artifact: Artifact, backend: Tokenizer, mask_token_id: int | None) -> dict[str, Any]:
    """``tokenizer_config.json`` for a bare ``tokenizer.json``: the generic fast class and the
    special tokens of the data that are added tokens."""
    special = artifact.special_ids
    config: dict[str, Any] = {"tokenizer_class": GENERIC_CLASS, "clean_up_tokenization_spaces": False}
    for key, token_id in (("eos_token", special["eos"]), ("pad_token", special["pad"]), ("mask_token", mask_token_id)):
        name = _added_token(backend, token_id)
        if name is not None:
            config[key] = name
    return config


def _name_mask_token(config: dict[str, Any], backend: Tokenizer, mask_token_id: int | None) -> bool:
    """Set ``config``'s ``mask_token`` to the run's (module docstring); whether it changed."""
    name = _added_token(backend, mask_token_id)
    current = config.get("mask_token")
    current = current.get("content") if isinstance(current, dict) else current
    if mask_token_id is None or current == name:
        return False
    if name is None:  # the model's mask id is no token of the tokenizer: name none rather than another
        if current is None or backend.token_to_id(str(current)) == mask_token_id:
            return False
        del config["mask_token"]
        return True
    config["mask_token"] = name
    return True


def _use_data_template(
    files: dict[str, bytes],
    config: dict[str, Any],
    source: Path,
    artifact: Artifact,
    warn: Callable[[str], None] | None,
) -> bool:
    """Make the export's chat template the one the data was rendered with (module docstring);
    whether ``config`` changed."""
    recorded = artifact.chat_template
    if recorded is None:
        return False
    own = _own_template(files, source)
    if own is not None and _sha256(own) == recorded["sha256"]:
        return False
    text = read_template_file(Path(recorded["source"]))
    files.pop(TEMPLATE_FILE, None)
    files.pop(TEMPLATE_JSON_FILE, None)
    changed = config.pop("chat_template", None) is not None
    if text is not None and _sha256(text) == recorded["sha256"]:
        files[TEMPLATE_FILE] = text.encode("utf-8")
    elif warn is not None:
        warn(
            f"export: the chat template {artifact.directory} was rendered with ({recorded['source']}, sha256 "
            f"{recorded['sha256'][:12]}) is not found; exports carry no chat template (fix: restore it, or set "
            "data.tokenizer to a directory holding it)"
        )
    return changed


def _own_template(files: dict[str, bytes], source: Path) -> str | None:
    """The chat template of the copied files, in the order ``--chat-template auto`` reads them."""
    for name in (TEMPLATE_FILE, TEMPLATE_JSON_FILE, CONFIG_FILE):
        text = template_in_file(str(source / name), files[name]) if name in files else None
        if text is not None:
            return text
    return None


def _sha256(text: str) -> str:
    return fingerprint_bytes(text.encode("utf-8"))


def _json_bytes(value: dict[str, Any]) -> bytes:
    return (json.dumps(value, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


def _warn_when_lost(artifact: Artifact, others: Sequence[tuple[str, Path]], warn: Callable[[str], None]) -> None:
    """One line when the data came from a tokenizer directory that no candidate holds any more."""
    recorded = str(artifact.manifest["tokenizer"].get("source", "trained"))
    path = Path(recorded)
    if recorded == "trained" or (path.suffix == ".json" and path.name != TOKENIZER_FILE):
        return  # a trained tokenizer, or a bare tokenizer file: there was nothing more to carry
    state = "holds another tokenizer now" if _tokenizer_directory(path) is not None else "is not found"
    also = [what for what, candidate in others if candidate != path]
    nor = f" (nor does {' or '.join(also)} hold it)" if also else ""
    warn(
        f"export: {recorded}, the tokenizer {artifact.directory} was prepared with, {state}{nor}; exports carry "
        "the data's tokenizer.json with a generated tokenizer_config.json (generic class, the data's special "
        "tokens) instead of its directory's (fix: set data.tokenizer to a directory holding the data's tokenizer files)"
    )
