"""Prepared-data artifacts: the on-disk layout written by ``csbp data prepare`` and read-only,
memory-mapped access to it.

Layout of an artifact directory::

    manifest.json                 format version, tokenizer fingerprint, counts, fingerprints ...
    tokenizer.json                the tokenizer used (byte-identical: same fingerprint)
    {split}.tokens.bin            uint32 [rows, seq_len]  token ids
    {split}.loss_mask.bin         uint8  [rows, seq_len]  1 = token is supervised
    {split}.doc_ids.bin           int32  [rows, seq_len]  document ordinal within the split, -1 = pad

for ``split`` in ``train`` and ``val``. Rows are consecutive ``seq_len`` windows of one token
stream: documents concatenated greedily, each followed by EOS (which carries its document's id),
the last row padded with the pad id (loss mask 0, doc id -1). Document ids increase along the
stream, so a document boundary inside a row is exactly where ``doc_ids`` changes; a document
continued from the previous row keeps its id.

The *content fingerprint* is a sha256 over the per-file sha256 digests of all six array files
(``content_fingerprint``); ``open_artifact(..., verify=True)`` recomputes it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from csbp.data.tokenizer import CsbpTokenizer, load_tokenizer, special_tokens_from_names

FORMAT_NAME = "csbp-packed-tokens"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
SPLITS = ("train", "val")
ARRAY_DTYPES: dict[str, np.dtype] = {
    "tokens": np.dtype("<u4"),
    "loss_mask": np.dtype("u1"),
    "doc_ids": np.dtype("<i4"),
}


def array_file_name(split: str, field: str) -> str:
    """File name of one array of one split, e.g. ``train.tokens.bin``."""
    return f"{split}.{field}.bin"


def content_fingerprint(directory: Path) -> str:
    """sha256 over ``name:sha256(file)`` lines of every array file, in a fixed order."""
    lines = []
    for split in SPLITS:
        for field in ARRAY_DTYPES:
            name = array_file_name(split, field)
            digest = hashlib.sha256()
            with open(Path(directory) / name, "rb") as handle:
                for chunk in iter(lambda: handle.read(1 << 22), b""):
                    digest.update(chunk)
            lines.append(f"{name}:{digest.hexdigest()}")
    return hashlib.sha256("\n".join(lines).encode("utf-8")).hexdigest()


def max_token_id(directory: Path, split: str) -> int:
    """The largest token id in ``{split}.tokens.bin`` of ``directory`` (-1 when it is empty)."""
    path = Path(directory) / array_file_name(split, "tokens")
    if path.stat().st_size == 0:
        return -1
    return int(np.memmap(path, dtype=ARRAY_DTYPES["tokens"], mode="r").max())


def count_supervised(directory: Path, split: str, token_id: int) -> int:
    """Supervised positions of ``{split}`` in ``directory`` holding ``token_id`` (read in chunks)."""
    path = Path(directory) / array_file_name(split, "tokens")
    if path.stat().st_size == 0:
        return 0
    tokens = np.memmap(path, dtype=ARRAY_DTYPES["tokens"], mode="r")
    loss_mask = np.memmap(Path(directory) / array_file_name(split, "loss_mask"), dtype=ARRAY_DTYPES["loss_mask"], mode="r")
    found = 0
    for start in range(0, tokens.shape[0], _SCAN_CHUNK):
        stop = start + _SCAN_CHUNK
        found += int(np.count_nonzero((tokens[start:stop] == token_id) & (loss_mask[start:stop] != 0)))
    return found


_SCAN_CHUNK = 1 << 24


@dataclass(frozen=True)
class ArtifactSplit:
    """Row access to one split. Arrays are read-only memmaps of shape ``[num_rows, seq_len]``
    (``tokens[i]``, ``loss_mask[i]``, ``doc_ids[i]`` give row ``i``)."""

    name: str
    seq_len: int
    tokens: np.ndarray
    loss_mask: np.ndarray
    doc_ids: np.ndarray
    fingerprint: str

    @property
    def num_rows(self) -> int:
        return int(self.tokens.shape[0])

    def __len__(self) -> int:
        return self.num_rows


class Artifact:
    """An opened artifact directory (see the module docstring for the layout)."""

    def __init__(self, directory: Path, manifest: dict[str, Any]) -> None:
        self.directory = directory
        self.manifest = manifest
        self._splits: dict[str, ArtifactSplit] = {}

    @property
    def seq_len(self) -> int:
        return int(self.manifest["seq_len"])

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["tokenizer"]["vocab_size"])

    @property
    def special_ids(self) -> dict[str, int]:
        return {name: int(value) for name, value in self.manifest["special_ids"].items()}

    @property
    def mask_token_id(self) -> int:
        return self.special_ids["mask"]

    @property
    def fingerprint(self) -> str:
        """The content fingerprint (what a training checkpoint records)."""
        return str(self.manifest["content_fingerprint"])

    @property
    def chat_template(self) -> dict[str, str] | None:
        """``{"source", "sha256"}`` of the chat template chat records were formatted with, or None
        (csbp's role markers, or an artifact older than the ``chat_template`` manifest field)."""
        entry = self.manifest.get("chat_template")
        return dict(entry) if isinstance(entry, dict) else None

    @property
    def tokenizer_fingerprint(self) -> str:
        return str(self.manifest["tokenizer"]["fingerprint"])

    def split(self, name: str) -> ArtifactSplit:
        """Memory-mapped rows of ``train`` or ``val``."""
        if name not in SPLITS:
            raise ValueError(f"split is {name!r}; use one of {SPLITS}")
        if name not in self._splits:
            rows = int(self.manifest["splits"][name]["rows"])
            arrays = {field: self._map(name, field, rows) for field in ARRAY_DTYPES}
            self._splits[name] = ArtifactSplit(name, self.seq_len, fingerprint=self.fingerprint, **arrays)
        return self._splits[name]

    def _map(self, split: str, field: str, rows: int) -> np.ndarray:
        shape = (rows, self.seq_len)
        if rows == 0:  # numpy cannot memory-map an empty file
            return np.zeros(shape, dtype=ARRAY_DTYPES[field])
        path = self.directory / array_file_name(split, field)
        return np.memmap(path, dtype=ARRAY_DTYPES[field], mode="r", shape=shape)

    def load_tokenizer(self) -> CsbpTokenizer:
        """The artifact's own tokenizer (special names as recorded at prepare time); ``ValueError``
        when its ``tokenizer.json`` is not the file the manifest's fingerprint records (a replaced
        file would decode every row, and sample, with other tokens)."""
        names = self.manifest["tokenizer"]["special_names"]
        path = self.directory / TOKENIZER_FILE
        tokenizer = load_tokenizer(path, special=special_tokens_from_names(names))
        if tokenizer.fingerprint != self.tokenizer_fingerprint:
            raise ValueError(
                f"{path}: fingerprint {tokenizer.fingerprint[:12]}... is not the manifest's tokenizer.fingerprint "
                f"{self.tokenizer_fingerprint[:12]}...: the file was replaced (fix: restore it, or re-run csbp data prepare)"
            )
        return tokenizer

    def check_tokenizer(self, tokenizer: CsbpTokenizer) -> None:
        """``ValueError`` if ``tokenizer`` is not the one this artifact was prepared with."""
        if tokenizer.fingerprint != self.tokenizer_fingerprint:
            raise ValueError(
                f"tokenizer fingerprint {tokenizer.fingerprint} does not match artifact {self.directory} "
                f"(manifest: {self.tokenizer_fingerprint}); re-run csbp data prepare with this tokenizer"
            )

    def max_token_id(self) -> int:
        """The largest token id of both splits: the manifest's record (``splits.<s>.max_token_id``),
        else read from the token files. The content fingerprint covers the files, not this record, and
        opening the artifact does not recompute it: a path that feeds ids to a model checks the ids it
        reads (``csbp train``'s ``verify_data`` reads the files, ``csbp eval`` the rows it scores)."""
        found = -1
        for split in SPLITS:
            recorded = self.manifest["splits"][split].get("max_token_id")
            value = recorded if isinstance(recorded, int) else max_token_id(self.directory, split)
            found = max(found, int(value))
        return found

    def recorded_supervised_mask_tokens(self) -> int | None:
        """Supervised positions of both splits holding the artifact's mask token, as the manifest
        records them (``splits.<s>.supervised_mask_tokens``, 0 for everything ``csbp data prepare``
        writes now), or None for an artifact prepared before that field."""
        recorded = [self.manifest["splits"][split].get("supervised_mask_tokens") for split in SPLITS]
        if not all(type(value) is int for value in recorded):
            return None
        return sum(recorded)

    def count_supervised(self, token_id: int) -> int:
        """Supervised positions of both splits holding ``token_id``, read from the token files."""
        return sum(count_supervised(self.directory, split, token_id) for split in SPLITS)

    def verify_tokenizer(self) -> None:
        """``ValueError`` unless ``tokenizer.json`` has the manifest's fingerprint and vocabulary size
        (the model's embedding is sized from the manifest: a forged size must not allocate it), and
        the manifest's ``special_ids`` are the ids its ``special_names`` have in it (training takes
        the mask id from there: an edited one would mask a token the data holds)."""
        tokenizer = self.load_tokenizer()
        self.check_tokenizer(tokenizer)
        if tokenizer.vocab_size != self.vocab_size:
            raise ValueError(
                f"{self.directory / MANIFEST_NAME}: tokenizer.vocab_size {self.vocab_size} is not the "
                f"{tokenizer.vocab_size} ids of its {TOKENIZER_FILE} (fix: re-run csbp data prepare)"
            )
        resolved = tokenizer.special_ids()
        for name in sorted(set(resolved) | set(self.special_ids)):
            if self.special_ids.get(name) != resolved.get(name):
                raise ValueError(
                    f"{self.directory / MANIFEST_NAME}: special_ids.{name} is {self.special_ids.get(name)}, but "
                    f"its {TOKENIZER_FILE} gives {tokenizer.special_names.get(name, name)!r} the id "
                    f"{resolved.get(name)} (fix: re-run csbp data prepare)"
                )

    def verify_fingerprint(self) -> None:
        """``ValueError`` unless the array files hash to the manifest's ``content_fingerprint``."""
        actual = content_fingerprint(self.directory)
        if actual != self.fingerprint:
            raise ValueError(
                f"{self.directory / MANIFEST_NAME}: content_fingerprint {self.fingerprint[:12]}... does not match "
                f"the files ({actual[:12]}...): the artifact was modified (fix: re-run csbp data prepare)"
            )

    def require_vocab_size(self, model_vocab_size: int) -> None:
        """``ValueError`` if token ids of this artifact may exceed a model's vocabulary."""
        if self.vocab_size > model_vocab_size:
            raise ValueError(
                f"artifact {self.directory} has vocab_size {self.vocab_size} but the model embeds only "
                f"{model_vocab_size} ids; set model vocab_size >= {self.vocab_size}"
            )


def open_artifact(
    directory: str | Path, *, verify: bool = False, tokenizer: CsbpTokenizer | None = None
) -> Artifact:
    """Open and validate an artifact; memory-maps lazily and read-only.

    Checks the manifest (format and version), that every array file exists with the size the
    manifest implies, and the tokenizer fingerprint when ``tokenizer`` is given. ``verify=True``
    also recomputes the content fingerprint, checks every token id is below ``vocab_size`` and that
    ``tokenizer.json`` has the recorded fingerprint and size. The manifest's counts must be integers
    in range (a forged manifest is refused, never sized into memory).
    """
    directory = Path(directory)
    manifest_path = directory / MANIFEST_NAME
    if not manifest_path.is_file():
        if directory.is_file() and (directory.parent / MANIFEST_NAME).is_file():  # one of its files, not it
            raise ValueError(
                f"{directory} is a file of the data artifact {directory.parent}; pass the artifact directory"
            )
        raise ValueError(
            f"{directory} is not a csbp data artifact (no {MANIFEST_NAME}); run csbp data prepare"
        )
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{manifest_path}: malformed JSON ({exc.msg} at line {exc.lineno})") from None
    except UnicodeDecodeError:
        raise ValueError(f"{manifest_path}: not UTF-8 JSON; re-run csbp data prepare") from None
    if not isinstance(manifest, dict):
        raise ValueError(f"{manifest_path}: expected a JSON object; re-run csbp data prepare")
    if manifest.get("format") != FORMAT_NAME or manifest.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{manifest_path}: format {manifest.get('format')!r} version {manifest.get('format_version')!r} "
            f"is not {FORMAT_NAME!r} version {FORMAT_VERSION}; re-run csbp data prepare"
        )
    _require_manifest_keys(manifest, manifest_path)
    artifact = Artifact(directory, manifest)
    for split in SPLITS:
        expected_items = int(manifest["splits"][split]["rows"]) * artifact.seq_len
        for field, dtype in ARRAY_DTYPES.items():
            path = directory / array_file_name(split, field)
            if not path.is_file():
                raise ValueError(f"artifact {directory} is missing {path.name}; re-run csbp data prepare")
            expected_bytes = expected_items * dtype.itemsize
            size = path.stat().st_size
            if size != expected_bytes:
                damage = "truncated" if size < expected_bytes else "longer than its manifest says (appended to, or another artifact's)"
                raise ValueError(
                    f"{path}: {size} bytes, manifest implies {expected_bytes}; "
                    f"the artifact is {damage}, re-run csbp data prepare"
                )
    if not (directory / TOKENIZER_FILE).is_file():
        raise ValueError(f"artifact {directory} is missing {TOKENIZER_FILE}; re-run csbp data prepare")
    if tokenizer is not None:
        artifact.check_tokenizer(tokenizer)
    if verify:
        _verify_contents(artifact)
    return artifact


_REQUIRED_KEYS = (
    ("seq_len",),
    ("special_ids",),
    ("content_fingerprint",),
    ("tokenizer", "fingerprint"),
    ("tokenizer", "vocab_size"),
    ("tokenizer", "special_names"),
    ("splits", "train", "rows"),
    ("splits", "val", "rows"),
)


_COUNT_RANGES = {  # the integer fields sizes are computed from, and the values they may take
    ("seq_len",): (2, 2**31 - 1),
    ("tokenizer", "vocab_size"): (1, 2**32),  # ids are stored as uint32
    ("splits", "train", "rows"): (0, 2**40),
    ("splits", "val", "rows"): (0, 2**40),
}


def _require_manifest_keys(manifest: dict[str, Any], manifest_path: Path) -> None:
    for key_path in _REQUIRED_KEYS:
        node: Any = manifest
        for key in key_path:
            if not isinstance(node, dict) or key not in node:
                raise ValueError(
                    f"{manifest_path}: missing field {'.'.join(key_path)}; re-run csbp data prepare"
                )
            node = node[key]
        low, high = _COUNT_RANGES.get(key_path, (None, None))
        if low is not None and (type(node) is not int or not low <= node <= high):
            raise ValueError(
                f"{manifest_path}: {'.'.join(key_path)} is {node!r}, not an integer in [{low}, {high}]; "
                "re-run csbp data prepare"
            )
    special_ids = manifest["special_ids"]
    if not isinstance(special_ids, dict) or not all(type(v) is int and v >= 0 for v in special_ids.values()):
        raise ValueError(f"{manifest_path}: special_ids must map names to token ids; re-run csbp data prepare")


def _verify_contents(artifact: Artifact) -> None:
    artifact.verify_fingerprint()
    artifact.verify_tokenizer()
    for split in SPLITS:
        tokens = artifact.split(split).tokens
        if tokens.size and int(tokens.max()) >= artifact.vocab_size:
            raise ValueError(
                f"artifact {artifact.directory} split {split}: token id {int(tokens.max())} is outside the "
                f"vocabulary [0, {artifact.vocab_size}); re-run csbp data prepare"
            )
