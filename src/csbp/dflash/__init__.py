"""DFlash / DFlash2 drafter training: the drafter model, target features, anchor sampling, the
``dflash`` objective, exact CP-only and CSBP layouts, and the public checkpoint format.

Module map:

* ``config``: ``DFlashConfig`` (architecture) and ``DFlashObjectiveConfig`` (loss options).
* ``drafter``: ``DFlashDrafter`` (fc, hidden_norm, layers, norm; target embedding/head by reference).
* ``dflash2``: dynamic block convolution, candidate selector, D-PACE weights, selector warm-up.
* ``features``: online target-feature capture and the offline memory-mapped store.
* ``feature_writer``: ``prepare_features``, the resumable capture of a store.
* ``target_fingerprint``: fingerprints of the target's weights a store is checked against.
* ``anchors``: valid anchors, uniform and locality sampling.
* ``layouts`` / ``attention``: who holds which anchors and context rows; draft attention transports.
* ``exchange``: with packed documents, the context exchange plan (only the rows an anchor may see).
* ``loss`` / ``chunked_kl``: labels, weights, normalisation, chunked CE/KL, metrics.
* ``reference``: the dense single-process oracle used by the tests.
* ``rank_plan`` / ``step``: ``build_dflash_rank_plan`` (what a rank holds, its communicators) and
  ``DFlashStep``, the trainer's entry points.
* ``target_shard`` / ``teacher_rows``: the context-sharded online target pass and the KL teacher
  rows it sends each rank.
* ``verify``: a parallel layout against one process.
* ``speculative`` / ``target_cache`` / ``evaluate``: lossless speculative decoding with the target's
  K/V cache, and the acceptance-length evaluation over prompts.
* ``export``: ``export_dflash`` / ``load_dflash``; ``target_record``: which target an export was
  trained against.
"""

from csbp.dflash.anchors import sample_anchors, segment_starts, valid_anchor_mask, validate_anchor_coverage
from csbp.dflash.config import (
    DFlashConfig,
    DFlashObjectiveConfig,
    default_target_layer_ids,
    validate_drafter_target,
)
from csbp.dflash.drafter import DFlashDrafter, DraftContextCache
from csbp.dflash.export import export_dflash, load_dflash
from csbp.dflash.feature_writer import prepare_features
from csbp.dflash.features import (
    FeatureStore,
    TargetFeatures,
    capture_target_features,
    open_features,
)
from csbp.dflash.layouts import DFlashLayout, dflash_layout
from csbp.dflash.rank_plan import DFlashRankPlan, build_dflash_rank_plan
from csbp.dflash.reference import reference_dflash_loss
from csbp.dflash.step import DFlashBatch, DFlashStep, DFlashStepOutput, sample_batch_anchors

__all__ = [
    "DFlashBatch",
    "DFlashConfig",
    "DFlashDrafter",
    "DFlashLayout",
    "DFlashObjectiveConfig",
    "DFlashRankPlan",
    "DFlashStep",
    "DFlashStepOutput",
    "DraftContextCache",
    "FeatureStore",
    "TargetFeatures",
    "build_dflash_rank_plan",
    "capture_target_features",
    "default_target_layer_ids",
    "dflash_layout",
    "export_dflash",
    "load_dflash",
    "open_features",
    "prepare_features",
    "reference_dflash_loss",
    "sample_anchors",
    "sample_batch_anchors",
    "segment_starts",
    "valid_anchor_mask",
    "validate_anchor_coverage",
    "validate_drafter_target",
]
