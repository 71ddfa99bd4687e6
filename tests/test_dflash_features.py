"""Target features (objectives.md §5.1): the ``hidden_states[i+1]`` convention through
``Decoder.layer_outputs``, the final-normed last hidden state, document-causal capture of packed
rows, and the offline store (round trip, manifest, one-line validation errors, a training step
on stored features equal to the online step)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from csbp.data.artifact import ArtifactSplit
from csbp.dflash.config import DFlashObjectiveConfig
from csbp.dflash.feature_writer import prepare_features
from csbp.dflash.features import capture_target_features, open_features
from csbp.dflash.rank_plan import build_dflash_rank_plan
from csbp.dflash.step import DFlashStep
from csbp.dflash.target_fingerprint import module_fingerprint
from csbp.dflash.verify import TARGET_CONFIG, DFlashVerifyCase, build_models, make_batch
from csbp.engine.context import single_process_context
from csbp.models.attention_fns import CausalAttention
from csbp.models.config import DecoderConfig


def _split(name: str = "train", rows: int = 3, seq_len: int = 16) -> ArtifactSplit:
    batch = make_batch(rows, seq_len)
    return ArtifactSplit(
        name=name,
        seq_len=seq_len,
        tokens=batch.input_ids.numpy().astype(np.uint32),
        loss_mask=batch.loss_mask.numpy().astype(np.uint8),
        doc_ids=batch.doc_ids.numpy().astype(np.int32),
        fingerprint="test",
    )


def test_capture_matches_layer_outputs_and_final_norm() -> None:
    target, _ = build_models(DFlashVerifyCase())
    ids = make_batch(1, 16).input_ids
    captured = capture_target_features(target, ids, (0, 2), with_last_hidden=True)
    positions = torch.arange(16)
    expected = target.layer_outputs(ids, positions, CausalAttention(), (0, 2))
    assert torch.equal(captured.features, expected)
    torch.testing.assert_close(
        captured.last_hidden, target(ids, positions, CausalAttention()), rtol=0, atol=1e-13
    )
    assert captured.features.shape == (1, 16, 64) and captured.layer_ids == (0, 2)
    # objectives.md §5.1/§9 pitfall 8: the last layer's id is its pre-norm residual (HF's last
    # hidden_states entry is post-norm); the KL teacher is that residual after the final norm.
    last_layer = capture_target_features(target, ids, (3,), with_last_hidden=True)
    torch.testing.assert_close(target.norm(last_layer.features), last_layer.last_hidden, rtol=0, atol=1e-13)
    assert float((last_layer.features - last_layer.last_hidden).abs().max()) > 1e-2
    with pytest.raises(ValueError, match="target_layer_ids"):
        capture_target_features(target, ids, (0, 4))


def test_packed_documents_do_not_see_each_other() -> None:
    target, _ = build_models(DFlashVerifyCase())
    batch = make_batch(2, 16)  # sample 1: doc 0 on [0, 6), doc 1 on [6, 12), padding on [12, 16)
    ids, doc = batch.input_ids[1:], batch.doc_ids[1:]
    captured = capture_target_features(target, ids, (1, 3), doc_ids_SL=doc).features
    moved = ids.clone()
    moved[0, :6] = (moved[0, :6] + 7) % 60
    again = capture_target_features(target, moved, (1, 3), doc_ids_SL=doc).features
    torch.testing.assert_close(again[0, 6:12], captured[0, 6:12], rtol=0, atol=0)
    alone = target.layer_outputs(ids[:, 6:12], torch.arange(6, 12), CausalAttention(), (1, 3))
    torch.testing.assert_close(captured[0, 6:12], alone[0], rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_store_round_trip_and_manifest(tmp_path: Path, dtype: str) -> None:
    target, _ = build_models(DFlashVerifyCase())
    split = _split()
    out = prepare_features(
        target,
        split,
        tmp_path / "features",
        layer_ids=(0, 2),
        with_last_hidden=True,
        dtype=dtype,
        rows_per_batch=2,
        target_weights=module_fingerprint(target),
    )
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["layer_ids"] == [0, 2] and manifest["width"] == 64 and manifest["dtype"] == dtype
    store = open_features(
        out,
        target_config=TARGET_CONFIG,
        target_weights=module_fingerprint(target),
        split=split,
        layer_ids=(0, 2),
        need_last_hidden=True,
    )
    rows = store.rows([2, 0], dtype=torch.float64)
    online = capture_target_features(
        target,
        torch.from_numpy(split.tokens[[2, 0]].astype(np.int64)),
        (0, 2),
        doc_ids_SL=torch.from_numpy(split.doc_ids[[2, 0]].astype(np.int64)),
        with_last_hidden=True,
    )
    tolerance = 1e-6 if dtype == "float32" else 2e-2
    torch.testing.assert_close(rows.features, online.features, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(rows.last_hidden, online.last_hidden, rtol=tolerance, atol=tolerance)
    with pytest.raises(ValueError, match="already exists"):
        prepare_features(target, split, out, layer_ids=(0, 2), target_weights="w")


def test_store_validation_errors(tmp_path: Path) -> None:
    target, _ = build_models(DFlashVerifyCase())
    split = _split()
    weights = module_fingerprint(target)
    out = prepare_features(target, split, tmp_path / "f", layer_ids=(0, 2), dtype="float32", target_weights=weights)
    other_target = DecoderConfig(**{**TARGET_CONFIG.__dict__, "rope_theta": 5e5})
    with torch.no_grad():
        target.layers[1].mlp.down_proj.weight[0, 0] += 1e-3  # a fine-tune: same config, other weights
    tuned = module_fingerprint(target)
    shifted = _split()
    shifted.tokens[0, 3] += 1
    checks = [
        ({"target_config": other_target}, "target_config_hash"),
        ({"target_weights": tuned}, f"target_weights='{weights}' but expected '{tuned}': .*other weights"),
        ({"split": shifted}, "token_hash"),
        ({"layer_ids": (0, 1)}, "layer_ids"),
        ({"split": _split(name="val")}, "split"),
        ({"need_last_hidden": True}, "prepare-features --with-last-hidden"),  # the flag a CLI user types
    ]
    for change, match in checks:
        options = {"target_config": TARGET_CONFIG, "target_weights": weights, "split": split, "layer_ids": (0, 2),
                   **change}
        with pytest.raises(ValueError, match=match) as caught:
            open_features(out, **options)
        assert len(str(caught.value).splitlines()) == 1
    with pytest.raises(ValueError, match="manifest.json"):
        open_features(tmp_path, target_config=TARGET_CONFIG, target_weights=weights, split=split, layer_ids=(0, 2))


def test_step_on_stored_features_equals_online(tmp_path: Path) -> None:
    case = DFlashVerifyCase()
    target, drafter = build_models(case, dtype=torch.float32)
    split = _split(rows=2, seq_len=32)
    weights = module_fingerprint(target)
    out = prepare_features(target, split, tmp_path / "f", layer_ids=(0, 2), dtype="float32", target_weights=weights)
    store = open_features(out, target_config=TARGET_CONFIG, target_weights=weights, split=split, layer_ids=(0, 2))
    objective = DFlashObjectiveConfig(max_anchors=6, gamma=7.0)
    step = DFlashStep(drafter, objective, build_dflash_rank_plan(single_process_context(), objective))
    batch = make_batch(2, 32)
    online = step(batch, torch.Generator().manual_seed(0))
    offline = step(batch, torch.Generator().manual_seed(0), features=store.rows([0, 1]))
    assert online.loss_value == offline.loss_value and online.metrics == offline.metrics


def test_capture_reports_its_progress_in_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A capture of a real corpus takes hours: `csbp dflash prepare-features` shows a bar of the rows
    # done (on a terminal); the library call is quiet unless asked.
    import csbp.dflash.feature_writer as features_module

    bars: list[dict] = []

    class Recorder:
        def __init__(self, **kwargs) -> None:
            self.kwargs, self.done = kwargs, 0
            bars.append(self.__dict__)

        def update(self, n: int) -> None:
            self.done += n

        def close(self) -> None:
            self.kwargs["closed"] = True

    monkeypatch.setattr(features_module, "tqdm", Recorder)
    target, _ = build_models(DFlashVerifyCase())
    prepare_features(target, _split(rows=5), tmp_path / "f", layer_ids=(0, 2), rows_per_batch=2, progress=True,
                     target_weights="w")
    prepare_features(target, _split(rows=5), tmp_path / "g", layer_ids=(0, 2), target_weights="w")
    (shown, quiet) = bars
    assert shown["done"] == 5 and shown["kwargs"]["total"] == 5 and shown["kwargs"]["disable"] is None
    assert shown["kwargs"]["closed"] and quiet["kwargs"]["disable"] is True
