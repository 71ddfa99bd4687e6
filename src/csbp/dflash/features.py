"""Target features for DFlash training: online capture and an offline, memory-mapped store.

**Convention.** ``features[..., i·H:(i+1)·H]`` is the residual-stream output of target layer
``target_layer_ids[i]`` (0-based), i.e. Hugging Face ``hidden_states[id + 1]`` (index 0 of HF's
tuple is the embedding output), *before* the final norm for every layer including the last (HF
applies the final norm to its last entry only; objectives.md §5.1). ``last_hidden`` is the
target's final-normed last hidden state, the input of its LM head (the KL teacher).

The target is causal over each document segment (packed documents never see each other) and uses
the row's absolute positions ``0 … L−1`` (the drafter's context positions).

**Online** (``capture_target_features``): the frozen target runs under ``no_grad`` inside the
training step. ``capture_target_features`` is the replicated pass: the target runs on the full
sequence (single process, ``cp == 1``, and ``objective.target_capture='replicated'``, kept for
comparison). Under CP/CSBP (``cp > 1``) the step uses the context-sharded pass by default
(``csbp.dflash.target_shard.capture_sharded_target_features``): each ring member runs the target on
its own zigzag context rows only and all-gathers the ring's K/V per layer (forward only), so target
compute and activations are ``1/cp`` of the replicated pass; its features carry ``positions`` (the
rank's rows) and equal the replicated rows up to summation order (1e-12 in float64).

**Offline** (``csbp.dflash.feature_writer.prepare_features``, resumable; ``open_features``):
``features.npy`` ``[R, L, K·H]`` (and ``last_hidden.npy`` ``[R, L, H]``) as ``.npy`` files read with
``mmap_mode='r'``, plus ``manifest.json`` recording the target config hash, the fingerprint of the
target's weights (``csbp.dflash.target_fingerprint``), the token hash (tokens and document ids of
the split), layer ids, width and dtype (and, for the record, the target's dtype and the capture's
device type). Loading validates all of them and fails with a one-line ``ValueError`` on any
mismatch. ``bfloat16`` is stored as its raw 16-bit pattern (``uint16``).

Shape legend: ``S`` samples, ``L`` sequence length, ``R`` rows of a split, ``H`` hidden size,
``K`` fused layers.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

from csbp.atomic import Ownership
from csbp.attention.rows import Rows
from csbp.attention.transports.local import LocalAttentionFn
from csbp.dflash.anchors import segment_starts
from csbp.models.attention_fns import CausalAttention
from csbp.models.config import DecoderConfig
from csbp.models.decoder import AttentionFn, Decoder
from csbp.models.rope import RotaryTables

FEATURE_OWNERSHIP = Ownership(
    what="feature store (manifest.json, features.npy, last_hidden.npy)",
    marker="manifest.json",
    names=frozenset({"manifest.json", "features.npy", "last_hidden.npy"}),
)

FEATURES_FORMAT = "csbp-dflash-features"
FEATURES_VERSION = 2
"""2: the manifest records ``target_weights``, ``target_dtype`` and ``device`` (1 had no weights fingerprint)."""
STORE_DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<u2"),
}


@dataclass(frozen=True)
class TargetFeatures:
    """Target features of a batch: ``features [S, L, K·H]``, ``last_hidden [S, L, H]`` or None.

    ``positions``: the sequence positions of the feature rows when they are one rank's shard
    (``features [S, len(positions), K·H]`` and ``last_hidden [S, len(positions), H]``, the sharded
    pass); None: every position ``0 … L−1``.
    """

    features: Tensor
    last_hidden: Tensor | None
    layer_ids: tuple[int, ...]
    positions: Tensor | None = None


def document_causal_attention(doc_ids_L: Tensor | None, seq_len: int) -> AttentionFn:
    """Causal attention inside each document segment (plain causal when there is one segment);
    the row metadata and plan are built on the CPU and moved once to the device of the call."""
    if doc_ids_L is None:
        return CausalAttention()
    starts = segment_starts(doc_ids_L.cpu())
    if bool((starts == 0).all()):
        return CausalAttention()
    segment = torch.cumsum((starts == torch.arange(seq_len)).long(), dim=0) - 1
    zeros = torch.zeros(seq_len, dtype=torch.long)
    rows = Rows(
        torch.arange(seq_len),
        torch.zeros(seq_len, dtype=torch.bool),
        segment,
        zeros,
        zeros,
        torch.ones(seq_len, dtype=torch.bool),
    )
    return LocalAttentionFn(rows, num_noisy=seq_len, causal_in_block=True)


def check_capture_args(target: Decoder, input_ids_SL: Tensor, layer_ids: Sequence[int]) -> tuple[int, ...]:
    """The layer ids as a tuple, after checking them against the target and the ids' shape."""
    layer_ids = tuple(int(i) for i in layer_ids)
    num_layers = target.config.num_layers
    if not layer_ids or any(not 0 <= i < num_layers for i in layer_ids):
        raise ValueError(f"target_layer_ids {list(layer_ids)} must be in [0, {num_layers}) for this target")
    if input_ids_SL.dim() != 2:
        raise ValueError(f"input_ids must be [S, L], got {tuple(input_ids_SL.shape)}")
    return layer_ids


def run_target_layers(
    target: Decoder,
    h_1RD: Tensor,
    rotary: RotaryTables,
    attention: AttentionFn,
    layer_ids: tuple[int, ...],
    stop: int,
) -> tuple[Tensor, Tensor]:
    """Run ``target.layers[:stop]`` on ``h_1RD``: ``(fused features [1, R, K·H], last hidden state)``."""
    captured: dict[int, Tensor] = {}
    for layer in target.layers[:stop]:
        h_1RD = layer(h_1RD, rotary, attention)
        captured[layer.layer_index] = h_1RD
    return torch.cat([captured[i] for i in layer_ids], dim=-1), h_1RD


@torch.no_grad()
def capture_target_features(
    target: Decoder,
    input_ids_SL: Tensor,
    layer_ids: Sequence[int],
    *,
    doc_ids_SL: Tensor | None = None,
    with_last_hidden: bool = False,
) -> TargetFeatures:
    """Run the frozen target (no grad) and return its fused features (module docstring)."""
    layer_ids = check_capture_args(target, input_ids_SL, layer_ids)
    num_layers = target.config.num_layers
    seq_len = input_ids_SL.shape[1]
    device = target.embed_tokens.weight.device
    input_ids_SL = input_ids_SL.to(device)
    doc_ids_SL = None if doc_ids_SL is None else doc_ids_SL.to(device)
    positions = torch.arange(seq_len, device=device)
    rotary = target.rotary(positions)
    stop = num_layers if with_last_hidden else max(layer_ids) + 1
    features, last = [], []
    for sample in range(input_ids_SL.shape[0]):
        attention = document_causal_attention(None if doc_ids_SL is None else doc_ids_SL[sample], seq_len)
        h_1LD = target.embed(input_ids_SL[sample : sample + 1])
        fused_1LF, h_1LD = run_target_layers(target, h_1LD, rotary, attention, layer_ids, stop)
        features.append(fused_1LF)
        if with_last_hidden:
            last.append(target.norm(h_1LD))
    return TargetFeatures(torch.cat(features), torch.cat(last) if with_last_hidden else None, layer_ids)


# ----------------------------------------------------------------------------- offline store


class TokenSplit(Protocol):
    """What ``prepare_features`` reads from a data split (``csbp.data.artifact.ArtifactSplit``)."""

    name: str
    tokens: np.ndarray
    doc_ids: np.ndarray


def target_config_hash(config: DecoderConfig) -> str:
    """sha256 of the target's ``DecoderConfig`` fields (sorted JSON)."""
    return hashlib.sha256(json.dumps(asdict(config), sort_keys=True).encode()).hexdigest()


def token_hash(tokens_RL: np.ndarray, doc_ids_RL: np.ndarray, *, rows_per_chunk: int = 1024) -> str:
    """sha256 over the little-endian tokens (uint32) and document ids (int32) of a split, row-major."""
    digest = hashlib.sha256()
    for array, dtype in ((tokens_RL, "<u4"), (doc_ids_RL, "<i4")):
        digest.update(str(tuple(array.shape)).encode())
        for start in range(0, array.shape[0], rows_per_chunk):
            digest.update(np.ascontiguousarray(array[start : start + rows_per_chunk], dtype=dtype).tobytes())
    return digest.hexdigest()


def _from_store(x: np.ndarray, dtype: str) -> Tensor:
    array = np.ascontiguousarray(x)
    if dtype == "bfloat16":
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def _map_array(path: Path) -> np.ndarray:
    """A read-only memory map of the ``.npy`` file ``path`` (never unpickled: an object array is an error)."""
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except ValueError as exc:
        raise ValueError(f"{path}: not a feature array csbp reads ({exc}); re-run prepare_features") from None


@dataclass(frozen=True)
class FeatureStore:
    """An opened feature directory: read-only memmaps and the validated manifest."""

    directory: Path
    manifest: dict[str, Any]
    features: np.ndarray
    last_hidden: np.ndarray | None

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return tuple(self.manifest["layer_ids"])

    def rows(self, indices: Sequence[int], *, dtype: torch.dtype = torch.float32) -> TargetFeatures:
        """The features of split rows ``indices`` as a ``TargetFeatures`` batch in ``dtype``."""
        store_dtype = self.manifest["dtype"]
        index = np.asarray(list(indices), dtype=np.int64)
        features = _from_store(self.features[index], store_dtype).to(dtype)
        last = None
        if self.last_hidden is not None:
            last = _from_store(self.last_hidden[index], store_dtype).to(dtype)
        return TargetFeatures(features, last, self.layer_ids)


def recorded_layer_ids(directory: str | os.PathLike[str]) -> list[int] | None:
    """The ``layer_ids`` a store's manifest records, for naming them in a fix; None when it records no
    list of integers or is unreadable (``open_features`` then says what is wrong)."""
    try:
        manifest = json.loads((Path(directory) / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    ids = manifest.get("layer_ids") if isinstance(manifest, dict) else None
    return ids if isinstance(ids, list) and ids and all(type(i) is int for i in ids) else None


def recorded_target(directory: str | os.PathLike[str]) -> tuple[str, Any] | None:
    """The weights fingerprint and weight-file list a store's manifest records, for
    ``checkpoint_fingerprint(..., known=...)``; None when it records none or is unreadable
    (``open_features`` then says what is wrong)."""
    try:
        manifest = json.loads((Path(directory) / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or "target_files" not in manifest:
        return None
    return manifest.get("target_weights"), manifest["target_files"]


def open_features(
    directory: str | os.PathLike[str],
    *,
    target_config: DecoderConfig,
    target_weights: str,
    split: TokenSplit,
    layer_ids: Sequence[int],
    need_last_hidden: bool = False,
) -> FeatureStore:
    """Open and validate a feature directory against the target (its config and the fingerprint of its
    weights, ``csbp.dflash.target_fingerprint``), the token split and the layers."""
    directory = Path(directory)
    path = directory / "manifest.json"
    if not path.is_file():
        raise ValueError(
            f"{directory} is not a DFlash feature store (no manifest.json); run prepare_features"
        )
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not a JSON manifest ({exc}); re-run prepare_features") from None
    if not isinstance(manifest, dict) or manifest.get("dtype") not in STORE_DTYPES:
        raise ValueError(f"{path}: not a {FEATURES_FORMAT} manifest (no known dtype); re-run prepare_features")
    if manifest.get("format") != FEATURES_FORMAT or manifest.get("format_version") != FEATURES_VERSION:
        older = manifest.get("format") == FEATURES_FORMAT and manifest.get("format_version") == 1
        why = " (written by an older csbp, without a fingerprint of the target's weights)" if older else ""
        raise ValueError(
            f"{path}: not a {FEATURES_FORMAT} v{FEATURES_VERSION} manifest{why}; re-run prepare_features"
        )
    checks = (
        (
            "target_config_hash",
            target_config_hash(target_config),
            "the features were captured from another target",
        ),
        (
            "target_weights",
            target_weights,
            "the features were captured from other weights (another checkpoint or fine-tune of this target)",
        ),
        ("token_hash", token_hash(split.tokens, split.doc_ids), "the token file does not match (alignment)"),
        ("layer_ids", [int(i) for i in layer_ids], "the drafter fuses other target layers"),
        ("width", len(tuple(layer_ids)) * target_config.hidden_size, "the feature width differs"),
        ("split", split.name, "the features belong to another split"),
    )
    for key, expected, reason in checks:
        if manifest.get(key) != expected:
            raise ValueError(
                f"{path}: {key}={manifest.get(key)!r} but expected {expected!r}: {reason}; "
                "re-run prepare_features"
            )
    if need_last_hidden and not manifest.get("with_last_hidden"):
        raise ValueError(
            f"{path}: no last_hidden stored but loss='kl' needs it; capture it too "
            "(csbp dflash prepare-features --with-last-hidden; prepare_features(..., with_last_hidden=True))"
        )
    features = _map_array(directory / "features.npy")
    expected_shape = (manifest["rows"], manifest["seq_len"], manifest["width"])
    if tuple(features.shape) != expected_shape or features.dtype != STORE_DTYPES[manifest["dtype"]]:
        raise ValueError(
            f"{directory / 'features.npy'}: shape {features.shape} dtype {features.dtype} does not match the "
            f"manifest {expected_shape} {manifest['dtype']}; re-run prepare_features"
        )
    last = None
    if manifest.get("with_last_hidden"):
        last = _map_array(directory / "last_hidden.npy")
        expected_shape = (manifest["rows"], manifest["seq_len"], target_config.hidden_size)
        if tuple(last.shape) != expected_shape or last.dtype != features.dtype:
            raise ValueError(
                f"{directory / 'last_hidden.npy'}: shape {last.shape} dtype {last.dtype} does not match the "
                f"manifest {expected_shape} {manifest['dtype']}; re-run prepare_features"
            )
    return FeatureStore(directory, manifest, features, last)
