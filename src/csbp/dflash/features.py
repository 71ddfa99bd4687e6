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

**Offline** (``prepare_features`` / ``open_features``): ``features.npy`` ``[R, L, K·H]`` (and
``last_hidden.npy`` ``[R, L, H]``) as ``.npy`` files read with ``mmap_mode='r'``, plus
``manifest.json`` recording the target config hash, the token hash (tokens and document ids of the
split), layer ids, width and dtype. Loading validates all of them and fails with a one-line
``ValueError`` on any mismatch. ``bfloat16`` is stored as its raw 16-bit pattern (``uint16``).

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
from tqdm.auto import tqdm

from csbp.atomic import Ownership, write_directory_atomically
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
FEATURES_VERSION = 1
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


def _to_store(x: Tensor, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return x.to(torch.bfloat16).cpu().view(torch.int16).numpy().view(np.uint16)
    return x.to(torch.float32 if dtype == "float32" else torch.float16).cpu().numpy()


def _from_store(x: np.ndarray, dtype: str) -> Tensor:
    array = np.ascontiguousarray(x)
    if dtype == "bfloat16":
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def prepare_features(
    target: Decoder,
    split: TokenSplit,
    out_dir: str | os.PathLike[str],
    *,
    layer_ids: Sequence[int],
    with_last_hidden: bool = False,
    dtype: str = "bfloat16",
    rows_per_batch: int = 1,
    overwrite: bool = False,
    progress: bool = False,
) -> Path:
    """Capture the features of every row of ``split`` into ``out_dir`` (atomic directory write);
    ``progress`` shows a bar of the rows captured (on a terminal only: tqdm's ``disable=None``)."""
    if dtype not in STORE_DTYPES:
        raise ValueError(f"feature dtype {dtype!r} must be one of {tuple(STORE_DTYPES)}")
    if rows_per_batch < 1:
        raise ValueError(f"rows_per_batch must be >= 1, got {rows_per_batch}")
    layer_ids = tuple(int(i) for i in layer_ids)
    num_rows, seq_len = (int(n) for n in split.tokens.shape)
    hidden = target.config.hidden_size
    device = target.embed_tokens.weight.device
    manifest: dict[str, Any] = {
        "format": FEATURES_FORMAT,
        "format_version": FEATURES_VERSION,
        "split": split.name,
        "rows": num_rows,
        "seq_len": seq_len,
        "layer_ids": list(layer_ids),
        "hidden_size": hidden,
        "width": len(layer_ids) * hidden,
        "dtype": dtype,
        "with_last_hidden": with_last_hidden,
        "target_config_hash": target_config_hash(target.config),
        "token_hash": token_hash(split.tokens, split.doc_ids),
        "convention": "layer i = HF hidden_states[i+1], pre-final-norm; last_hidden final-normed",
    }

    def fill(staging: Path) -> None:
        open_mm = np.lib.format.open_memmap
        features = open_mm(
            staging / "features.npy",
            mode="w+",
            dtype=STORE_DTYPES[dtype],
            shape=(num_rows, seq_len, len(layer_ids) * hidden),
        )
        last = None
        if with_last_hidden:
            last = open_mm(
                staging / "last_hidden.npy",
                mode="w+",
                dtype=STORE_DTYPES[dtype],
                shape=(num_rows, seq_len, hidden),
            )
        bar = tqdm(total=num_rows, desc="features", unit="row", dynamic_ncols=True, disable=None if progress else True)
        for start in range(0, num_rows, rows_per_batch):
            stop = min(start + rows_per_batch, num_rows)
            ids = torch.from_numpy(np.asarray(split.tokens[start:stop], dtype=np.int64)).to(device)
            docs = torch.from_numpy(np.asarray(split.doc_ids[start:stop], dtype=np.int64)).to(device)
            captured = capture_target_features(
                target, ids, layer_ids, doc_ids_SL=docs, with_last_hidden=with_last_hidden
            )
            features[start:stop] = _to_store(captured.features, dtype)
            if last is not None and captured.last_hidden is not None:
                last[start:stop] = _to_store(captured.last_hidden, dtype)
            bar.update(stop - start)
        bar.close()
        features.flush()
        if last is not None:
            last.flush()
        (staging / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")

    return write_directory_atomically(out_dir, fill, overwrite=overwrite, owned=FEATURE_OWNERSHIP)


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


def open_features(
    directory: str | os.PathLike[str],
    *,
    target_config: DecoderConfig,
    split: TokenSplit,
    layer_ids: Sequence[int],
    need_last_hidden: bool = False,
) -> FeatureStore:
    """Open and validate a feature directory against the target, the token split and the layers."""
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
        raise ValueError(
            f"{path}: not a {FEATURES_FORMAT} v{FEATURES_VERSION} manifest; re-run prepare_features"
        )
    checks = (
        (
            "target_config_hash",
            target_config_hash(target_config),
            "the features were captured from another target",
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
