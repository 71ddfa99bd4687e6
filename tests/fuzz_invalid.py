"""Random invalid run configs for the fuzz sweep: each must be refused with one line naming its field.

:func:`draw_invalid` draws changes that break one rule of a tiny run config, and
:func:`check_fails_closed` asserts the config is refused with one line naming the field, before
anything starts (``csbp train`` and ``csbp config validate`` read configs this way).
"""

from __future__ import annotations

import random
import time
from typing import Any

from test_training_run import apply_dotted

INVALID_KINDS = (
    "bp_not_multiple_of_cp", "seq_not_multiple_of_block", "seq_not_zigzag", "fewer_blocks_than_bp",
    "block_not_below_seq", "single_stream_with_cp", "window_without_windowed_mask",
    "reset_positions_without_documents", "window_not_positive", "unknown_transport", "unknown_schedule",
    "mask_token_outside_vocab", "grad_accum_zero",
)


def _validate_config(changes: dict[str, Any]) -> None:
    """Validate a tiny run config (BD3, ``L = 32``, ``B = 4``, one process) with ``changes`` applied
    (dotted keys; ``None`` removes a key)."""
    from csbp.config.loading import config_from_dict

    data: dict[str, Any] = {
        "run": {"name": "fuzz", "seed": 0},
        "model": {"arch": "qwen3", "hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "num_heads": 4,
                  "num_kv_heads": 2, "head_dim": 8, "vocab_size": 64},
        "data": {"train": "artifacts/fuzz", "seq_len": 32},
        "objective": {"name": "bd3", "block_size": 4, "mask_token_id": 63},
        "optim": {"lr": 1e-3, "warmup_steps": 0},
        "train": {"max_steps": 2, "micro_batch_size": 1},
    }
    apply_dotted(data, changes)
    config_from_dict(data, source="config.yaml")


def _single_stream(rng: random.Random, **changes: Any) -> dict[str, Any]:
    name = rng.choice(["mdlm", "ar"])
    out = {"objective.name": name, "objective.block_size": None, **changes}
    if name == "ar":
        out["objective.loss_weight"] = "unit"
    return out


def draw_invalid(seed: int) -> tuple[str, dict[str, Any], str]:
    """``(kind, changes, field)``: changes to a valid tiny run config that break one rule; the config
    must be refused with one line naming ``field``."""
    rng = random.Random(seed)
    kind = rng.choice(INVALID_KINDS)
    cp, block = rng.choice([2, 3, 4]), rng.choice([2, 3, 4, 5])
    if kind == "bp_not_multiple_of_cp":
        bp = rng.choice([b for b in range(2, 13) if b < cp or b % cp])
        return kind, {"topology.cp": cp, "topology.bp": bp}, "topology"
    if kind == "seq_not_multiple_of_block":
        seq = block * rng.randint(2, 8) + rng.randint(1, block - 1)
        return kind, {"objective.block_size": block, "data.seq_len": seq}, "data.seq_len"
    if kind == "seq_not_zigzag":
        bp = rng.choice([1, cp, 2 * cp])
        seq = block * cp * (2 if bp > 1 else 1) * rng.randint(1, 3) + block
        return kind, {"objective.block_size": block, "data.seq_len": seq, "topology.cp": cp,
                      "topology.bp": bp}, "data.seq_len"
    if kind == "fewer_blocks_than_bp":
        bp = rng.choice([3, 4, 6])
        return kind, {"objective.block_size": block, "data.seq_len": block * rng.randint(2, bp - 1),
                      "topology.bp": bp, "topology.replicate_clean_prefix": True}, "data.seq_len"
    if kind == "block_not_below_seq":
        return kind, {"objective.name": rng.choice(["bd3", "fast_dllm_v2"]),
                      "objective.block_size": rng.choice([32, 64])}, "objective.block_size"
    if kind == "single_stream_with_cp":
        return kind, _single_stream(rng, **{"topology.cp": cp, "data.seq_len": 48}), "topology"
    if kind == "window_without_windowed_mask":
        return kind, _single_stream(rng, **{"topology.window": rng.randint(1, 40)}), "topology.window"
    if kind == "reset_positions_without_documents":
        return kind, {"data.reset_positions": True, "data.document_mask": False}, "data.reset_positions"
    if kind == "window_not_positive":
        return kind, {"topology.window": rng.choice([0, -1, -8])}, "topology.window"
    if kind == "unknown_transport":
        return kind, {"topology.transport": rng.choice(["ring", "halo2", "Collective"])}, "topology.transport"
    if kind == "unknown_schedule":
        return kind, {"topology.schedule": rng.choice(["dualend", "zigzag", "balance"])}, "topology.schedule"
    if kind == "mask_token_outside_vocab":
        return kind, {"objective.mask_token_id": rng.choice([64, 100])}, "objective.mask_token_id"
    return kind, {"train.grad_accum": rng.choice([0, -2])}, "train.grad_accum"


def check_fails_closed(seed: int, *, budget_s: float = 5.0) -> tuple[str, str]:
    """Validate invalid draw ``seed`` and return ``(kind, message)``; raise ``AssertionError`` unless
    the config was refused with one ``ValueError`` line naming its field within ``budget_s`` seconds."""
    kind, changes, field = draw_invalid(seed)
    started = time.perf_counter()
    try:
        _validate_config(changes)
    except ValueError as exc:
        message = str(exc).strip()
    else:
        raise AssertionError(f"invalid draw {seed} ({kind}: {changes}) was accepted")
    took = time.perf_counter() - started
    assert took < budget_s, f"invalid draw {seed} ({kind}) took {took:.1f} s to refuse"
    assert "\n" not in message, f"invalid draw {seed} ({kind}: {changes}): more than one line: {message!r}"
    assert message.startswith(f"config.yaml: {field}"), f"invalid draw {seed} ({kind}): not {field}: {message!r}"
    return kind, message
