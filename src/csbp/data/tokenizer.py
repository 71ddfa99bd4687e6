"""Tokenizers for ``csbp data prepare``: load a local one, or train a byte-level BPE.

Every tokenizer is held as a ``tokenizers.Tokenizer`` plus the exact bytes of its
``tokenizer.json``; the sha256 of those bytes is the tokenizer *fingerprint* recorded in an
artifact's manifest. Loading an artifact with a tokenizer of another fingerprint is an error.

Special tokens (names configurable through ``SpecialTokens``):

* ``<|endoftext|>``: EOS, appended after every document (the document separator);
* ``<|mask|>``: the diffusion mask token ``[M]``;
* ``<|pad|>``: fills the tail of the last packed row (falls back to EOS when absent);
* ``<|system|>``, ``<|user|>``, ``<|assistant|>``: chat role markers (needed only for chat data).

Local directories only, never a hub: ``DIR/tokenizer.json`` is read with
``tokenizers.Tokenizer.from_file``; a directory without one goes through
``transformers.AutoTokenizer.from_pretrained(DIR, local_files_only=True, trust_remote_code=False)``
(fast tokenizers only; no Python code from the directory ever runs). For such directories, csbp's
default EOS/pad/mask names (:class:`SpecialTokens`) missing from the vocabulary fall back to
``eos_token``/``pad_token``/``mask_token`` of ``tokenizer_config.json``/``special_tokens_map.json``;
a name given explicitly (``--eos-token X``) that the vocabulary lacks is an error.

Literal special-token strings inside document text are recognised as those tokens (the usual
``tokenizers`` behaviour).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from csbp.data.sources import CHAT_ROLES


@dataclass(frozen=True)
class SpecialTokens:
    """Names of the special tokens csbp uses."""

    eos: str = "<|endoftext|>"
    mask: str = "<|mask|>"
    pad: str = "<|pad|>"
    system: str = "<|system|>"
    user: str = "<|user|>"
    assistant: str = "<|assistant|>"

    def names(self) -> list[str]:
        """All names, in the id order a trained tokenizer gives them (0, 1, 2, ...)."""
        return [self.eos, self.mask, self.pad, self.system, self.user, self.assistant]

    def role(self, role: str) -> str:
        """The marker name of a chat role (``system``/``user``/``assistant``)."""
        return str(getattr(self, role))


#: csbp's default name of each special token: the only names a tokenizer config's own stand in for
_DEFAULT_NAMES = {field: str(getattr(SpecialTokens, field)) for field in ("eos", "mask", "pad", "system", "user", "assistant")}


def fingerprint_bytes(data: bytes) -> str:
    """sha256 hex digest: the fingerprint of a ``tokenizer.json``."""
    return hashlib.sha256(data).hexdigest()


class CsbpTokenizer:
    """A tokenizer with resolved special ids, its fingerprint and its ``tokenizer.json`` bytes.

    Attributes:
        backend: the underlying ``tokenizers.Tokenizer``.
        json_bytes: the exact ``tokenizer.json`` contents (what ``save`` writes).
        fingerprint: sha256 of ``json_bytes``.
        vocab_size: number of ids including added tokens; every id is in ``[0, vocab_size)``.
        eos_id, pad_id, mask_token_id: resolved special ids.
        role_ids: chat role -> marker id, for the roles whose marker is in the vocabulary.
        special: the requested special token names.
        special_names: field -> token name actually used (eos, pad, mask and present roles).
        source: where it came from (a path, or ``"trained"``).
    """

    def __init__(
        self,
        backend: Tokenizer,
        json_bytes: bytes,
        *,
        special: SpecialTokens,
        source: str,
        fallback_names: dict[str, str] | None = None,
        mask_id: int | None = None,
    ) -> None:
        self.backend = backend
        self.json_bytes = json_bytes
        self.fingerprint = fingerprint_bytes(json_bytes)
        self.vocab_size = int(backend.get_vocab_size(with_added_tokens=True))
        self.source = source
        self.special = special
        fallback = fallback_names or {}
        names: dict[str, str] = {}

        def resolve(field: str, required: bool) -> int | None:
            if field == "mask" and mask_id is not None:  # an id a run recorded wins over any name
                names[field] = backend.id_to_token(mask_id) or f"id {mask_id}"
                return mask_id
            wanted = getattr(special, field)
            # the tokenizer config's names stand in for csbp's default names only: an explicit name
            # (--eos-token X) the tokenizer lacks is refused, not silently replaced by the config's
            explicit = wanted != _DEFAULT_NAMES[field]
            for name in (wanted,) if explicit else (wanted, fallback.get(field)):
                token_id = backend.token_to_id(name) if name else None
                if token_id is not None:
                    names[field] = name
                    return int(token_id)
            if required or (explicit and field in ("eos", "mask", "pad")):
                raise ValueError(
                    f"tokenizer {source} has no {field} token {getattr(special, field)!r} (fix: add it to the "
                    f"tokenizer, or name an existing token with --{field}-token)"
                )
            return None

        self.eos_id: int = resolve("eos", required=True)  # type: ignore[assignment]
        self.mask_token_id: int = resolve("mask", required=True)  # type: ignore[assignment]
        pad_id = resolve("pad", required=False)
        if pad_id is None:
            names["pad"] = names["eos"]
        self.pad_id: int = self.eos_id if pad_id is None else pad_id
        self.role_ids: dict[str, int] = {}
        for role in CHAT_ROLES:
            role_id = resolve(role, required=False)
            if role_id is not None:
                self.role_ids[role] = role_id
        self.special_names = names

    def special_ids(self) -> dict[str, int]:
        """``{"eos": .., "mask": .., "pad": .., <role>: ..}`` for the manifest."""
        ids = {"eos": self.eos_id, "mask": self.mask_token_id, "pad": self.pad_id}
        ids.update(self.role_ids)
        return ids

    def role_marker_name(self, role: str) -> str:
        """The marker token name this tokenizer uses (or would need) for a chat role."""
        return self.special.role(role)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without any added BOS/EOS."""
        return list(self.backend.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """``encode`` for many texts at once (parallel inside ``tokenizers``)."""
        return [list(e.ids) for e in self.backend.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``, special tokens spelled out."""
        return str(self.backend.decode(list(ids), skip_special_tokens=False))

    def save(self, directory: Path) -> Path:
        """Write ``tokenizer.json`` (byte-identical, so the fingerprint is preserved)."""
        path = Path(directory) / "tokenizer.json"
        path.write_bytes(self.json_bytes)
        return path


def load_tokenizer(
    path: str | Path, *, special: SpecialTokens | None = None, mask_id: int | None = None
) -> CsbpTokenizer:
    """Load a local tokenizer: a ``tokenizer.json`` file, or a directory (see module docstring).
    ``mask_id`` (the ``mask_token_id`` a run trained with) is the mask token instead of the id of
    ``special.mask``, which the tokenizer then need not hold."""
    path = Path(path)
    special = special or SpecialTokens()
    json_file = path if path.is_file() else path / "tokenizer.json"
    if json_file.is_file():
        try:
            backend = Tokenizer.from_file(str(json_file))
        except Exception as exc:  # the tokenizers library raises a bare Exception for a malformed file
            raise ValueError(
                f"{json_file}: not a tokenizer file the tokenizers library can read ({exc}) (fix: pass a "
                "directory holding a valid tokenizer.json)"
            ) from None
        fallback = _config_special_names(json_file.parent)
        return CsbpTokenizer(
            backend, json_file.read_bytes(), special=special, source=str(path), fallback_names=fallback,
            mask_id=mask_id,
        )
    if not path.is_dir():
        raise ValueError(f"tokenizer path {path} {_not_a_tokenizer(path)} (fix: {_TOKENIZER_FIX})")
    if not any((path / name).is_file() for name in ("tokenizer_config.json", "config.json")):
        # transformers would guess a tokenizer class and fail in its own words ("Couldn't instantiate ...")
        fix = f"pass its model's, {path / 'final'}" if (path / "final" / "tokenizer.json").is_file() else _TOKENIZER_FIX
        raise ValueError(
            f"could not load a tokenizer from {path}: the directory holds no tokenizer.json, "
            f"tokenizer_config.json or config.json (fix: {fix})"
        )
    return _load_with_transformers(path, special, mask_id)


_TOKENIZER_FIX = "pass a tokenizer.json file, or a directory holding tokenizer.json"


def _not_a_tokenizer(path: Path) -> str:
    """What ``path``, neither a file nor a directory, is: missing, a dangling link, a device, ..."""
    if path.is_symlink() and not path.exists():
        return f"is a symbolic link to {os.readlink(path)}, which does not exist"
    if not path.exists():
        return "does not exist"
    mode = path.stat().st_mode
    kinds = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a named pipe"),
             (stat.S_ISSOCK, "a socket"))
    kind = next((name for test, name in kinds if test(mode)), "not a regular file")
    return f"is {kind}, not a tokenizer.json file or a tokenizer directory"


def _load_with_transformers(path: Path, special: SpecialTokens, mask_id: int | None) -> CsbpTokenizer:
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ValueError(
            f"tokenizer directory {path} has no tokenizer.json and transformers is not installed; "
            "install csbp[hf] or provide tokenizer.json"
        ) from None
    try:
        # trust_remote_code=False: a tokenizer_config.json `auto_map` naming Python code in the directory
        # is refused (left unset, transformers asks "run the custom code? [y/N]" on a terminal)
        hf_tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as exc:
        # transformers' messages run over several lines (the first alone can end in "one of:"): one line
        reason = " ".join(str(exc).split())
        raise ValueError(
            f"could not load a tokenizer from {path}: {reason} (fix: pass a directory holding tokenizer.json)"
        ) from None
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(f"tokenizer in {path} is not a fast tokenizer; save it with tokenizer.json")
    fallback = {
        field: str(token)
        for field, token in (
            ("eos", hf_tokenizer.eos_token),
            ("pad", hf_tokenizer.pad_token),
            ("mask", getattr(hf_tokenizer, "mask_token", None)),
        )
        if token
    }
    json_bytes = backend.to_str().encode("utf-8")
    return CsbpTokenizer(
        Tokenizer.from_str(json_bytes.decode("utf-8")),
        json_bytes,
        special=special,
        source=str(path),
        fallback_names=fallback,
        mask_id=mask_id,
    )


def _config_special_names(directory: Path) -> dict[str, str]:
    """eos/pad/mask names from HF config files next to a tokenizer.json (if any)."""
    names: dict[str, str] = {}
    for file_name in ("special_tokens_map.json", "tokenizer_config.json"):
        config_path = directory / file_name
        if not config_path.is_file():
            continue
        config = _read_config(config_path)
        for field in ("eos", "pad", "mask"):
            value = config.get(f"{field}_token")
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str) and field not in names:
                names[field] = value
    return names


def _read_config(path: Path) -> dict[str, Any]:
    """A tokenizer directory's JSON config file; ``ValueError`` naming it when it is not a JSON object."""
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON ({exc}) (fix: repair the file)".splitlines()[0]) from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(config).__name__} (fix: repair the file)")
    return config


def min_trained_vocab_size(special: SpecialTokens | None = None) -> int:
    """256 byte symbols plus the special tokens."""
    return 256 + len((special or SpecialTokens()).names())


def train_bpe_tokenizer(
    texts: Iterable[str], *, vocab_size: int, special: SpecialTokens | None = None
) -> CsbpTokenizer:
    """Train a byte-level BPE tokenizer on ``texts`` (deterministic for a fixed text order).

    The special tokens get ids ``0 .. 5`` in ``SpecialTokens.names()`` order; every byte is in the
    initial alphabet, so any text is encodable.
    """
    special = special or SpecialTokens()
    if vocab_size < min_trained_vocab_size(special):
        raise ValueError(
            f"vocab_size is {vocab_size}; a byte-level BPE needs at least {min_trained_vocab_size(special)}"
            " (256 bytes + special tokens)"
        )
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special.names(),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    json_bytes = backend.to_str().encode("utf-8")
    return CsbpTokenizer(
        Tokenizer.from_str(json_bytes.decode("utf-8")), json_bytes, special=special, source="trained"
    )


def special_tokens_from_names(names: dict[str, str]) -> SpecialTokens:
    """Rebuild ``SpecialTokens`` from ``CsbpTokenizer.special_names`` (as stored in a manifest)."""
    defaults = asdict(SpecialTokens())
    defaults.update({field: name for field, name in names.items() if field in defaults})
    return SpecialTokens(**defaults)
