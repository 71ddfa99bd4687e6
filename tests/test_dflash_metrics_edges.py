"""DFlash pieces whose formulas the loss/decoding oracles leave unconstrained, each checked
against hand-computed values or a brute-force loop (objectives.md §5.3, §6, §7):

* locality anchors with a candidate count that shares a factor with ``B`` stay distinct;
* D-PACE weights at ``α != 0.5`` (at 0.5, ``α`` and ``1 − α`` coincide);
* the selector warm-up with no warm-up and no ramp is on from the first step;
* the selector's greedy walk conditions each slot on the token chosen at the slot before;
* the acceptance length skips prompts without a verify round; JSONL prompts keep their last
  tokens; training validation uses the prompt length of ``csbp dflash eval``;
* the ``lambda`` loss's acceptance sums are the label probabilities of the supervised slots.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from csbp.dflash.anchors import sample_anchors
from csbp.dflash.config import DFlashObjectiveConfig
from csbp.dflash.dflash2 import CandidateSelector, selector_loss_scale
from csbp.dflash.evaluate import (
    DEFAULT_PROMPT_LEN,
    EvalPrompt,
    EvalSummary,
    PromptEval,
    jsonl_prompts,
    split_acceptance,
)
from csbp.dflash.layouts import AnchorPacket
from csbp.dflash.loss import block_targets, rank_dflash_loss, supervised_slot_counts
from csbp.dflash.verify import DFlashVerifyCase, build_models


@pytest.mark.parametrize("max_anchors", [5, 8, 100])
def test_locality_anchors_are_distinct_when_the_count_shares_a_factor_with_the_block(max_anchors: int) -> None:
    # 9 supervised tokens of one document: anchors 0 … 7 are valid (8 candidates, B = 4 divides 8).
    loss_mask, doc_ids = torch.ones(9, dtype=torch.bool), torch.zeros(9, dtype=torch.long)
    for seed in range(6):
        anchors = sample_anchors(
            loss_mask, doc_ids, max_anchors=max_anchors, method="locality", block_size=4,
            generator=torch.Generator().manual_seed(seed),
        )
        assert len(set(anchors.tolist())) == min(max_anchors, 8)
        if max_anchors >= 8:
            assert anchors.tolist() == list(range(8))  # every valid anchor, each once


def test_selector_without_warmup_or_ramp_is_on_from_the_first_step() -> None:
    assert selector_loss_scale(0.0, alpha=0.7, warmup_ratio=0.0, ramp_ratio=0.0) == 0.7
    assert selector_loss_scale(0.3, alpha=0.7, warmup_ratio=0.3, ramp_ratio=0.0) == 0.7
    assert selector_loss_scale(0.29, alpha=0.7, warmup_ratio=0.3, ramp_ratio=0.0) == 0.0


def test_selector_greedy_walk_equals_a_brute_force_walk() -> None:
    # S_p(a, b) = U_p(b) + Σ_r A[a, r]·(W_h h_p)_r·Bk[b, r]; slot j's predecessor a is the token the
    # walk chose at slot j − 1 (the anchor for slot 1); candidates are the top-K of U_p.
    vocab, hidden_size, rank, top_k, block = 12, 6, 3, 4, 5
    generator = torch.Generator().manual_seed(0)
    selector = CandidateSelector(vocab, hidden_size, rank=rank, top_k=top_k, dtype=torch.float64)
    with torch.no_grad():
        for param in selector.parameters():
            param.copy_(3.0 * torch.randn(param.shape, generator=generator, dtype=torch.float64))
    hidden = torch.randn(block, hidden_size, generator=generator, dtype=torch.float64)
    head = torch.randn(vocab, hidden_size, generator=generator, dtype=torch.float64)
    anchor = 7
    expected, previous = [], anchor
    w_h, a_codes, b_codes = (t.detach() for t in (selector.hidden_proj.weight, selector.pred_embed, selector.cand_embed))
    for j in range(1, block):
        unary = [float(head[v] @ hidden[j]) for v in range(vocab)]
        candidates = sorted(range(vocab), key=lambda v: -unary[v])[:top_k]
        projected = [float(w_h[r] @ hidden[j]) for r in range(rank)]
        scores = {
            c: unary[c]
            + sum(float(a_codes[previous, r]) * projected[r] * float(b_codes[c, r]) for r in range(rank))
            for c in candidates
        }
        previous = max(candidates, key=lambda c: scores[c])
        expected.append(previous)
    got = selector.greedy_decode(hidden, head, anchor).tolist()
    assert got == expected
    unary_only = [int((head @ hidden[j]).argmax()) for j in range(1, block)]
    assert got != unary_only  # the codebooks matter here, so the walk's conditioning is tested


def _prompt_eval(taus: list[int]) -> PromptEval:
    return PromptEval(EvalPrompt("p", "g", (1, 2)), [3] * (1 + sum(taus)), taus, 1 + len(taus), 0.0, None, None)


def test_acceptance_length_is_the_mean_of_prompt_means_over_prompts_with_a_round() -> None:
    # prompt means 2.5 and 4; the prompt that stopped at the prefill (no round) is left out
    summary = EvalSummary(4, [_prompt_eval([3, 2]), _prompt_eval([]), _prompt_eval([4])])
    assert summary.acceptance_length == 3.25
    assert summary.histogram == [0, 1, 1, 1]


def test_jsonl_prompts_keep_the_last_tokens_of_a_long_prompt(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "abcdef"}) + "\n" + json.dumps({"prompt": "xy", "group": "short"}) + "\n")
    prompts = jsonl_prompts(path, lambda text: [ord(c) for c in text], prompt_len=3)
    assert [p.token_ids for p in prompts] == [tuple(map(ord, "def")), tuple(map(ord, "xy"))]
    assert [p.group for p in prompts] == ["prompts", "short"]
    # the reader csbp generate --prompts shares: a byte-order mark is dropped, a bad line is named
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"prompt": "ab"}).encode() + b'\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}:2: not UTF-8 text .* \(fix: save the file as UTF-8\)$"):
        jsonl_prompts(path, lambda text: [ord(c) for c in text])
    path.write_text(json.dumps({"prompt": "ab"}) + "\n" + json.dumps({"prompt": ""}) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}:2: the prompt encodes to no tokens$"):
        jsonl_prompts(path, lambda text: [ord(c) for c in text])
    path.write_text(json.dumps({"prompt": "ab"}), encoding="utf-8-sig")
    assert [p.token_ids for p in jsonl_prompts(path, lambda text: [ord(c) for c in text])] == [(97, 98)]


def test_validation_prompts_have_the_length_dflash_eval_uses() -> None:
    # csbp dflash eval --data defaults to min(DEFAULT_PROMPT_LEN, seq_len − 1) prompt tokens; a run's
    # validation must score the same prompts, so short rows give prompts one token shorter than a row.
    target, drafter = build_models(DFlashVerifyCase())
    seq_len = 12
    assert seq_len - 1 < DEFAULT_PROMPT_LEN
    tokens = np.arange(2 * seq_len).reshape(2, seq_len) % 50
    split = SimpleNamespace(tokens=tokens, doc_ids=np.zeros_like(tokens), name="val")
    summary = split_acceptance(target, drafter, split, eos_id=None, num_prompts=2, max_new_tokens=2)
    assert [p.prompt.token_ids for p in summary.prompts] == [tuple(int(t) for t in row[: seq_len - 1]) for row in tokens]


def test_lambda_acceptance_sums_are_the_label_probabilities_of_the_supervised_slots() -> None:
    # validation recomputes the lambda mix from prob_sum / prob_count: the mean draft probability of
    # the label over supervised slots, here summed directly from dense softmax rows
    tokens = torch.arange(20, 30)
    packet = AnchorPacket(torch.arange(3), torch.tensor([0, 5, 8]), torch.zeros(3, dtype=torch.long), torch.ones(3, dtype=torch.bool))
    targets = block_targets(tokens, torch.ones(10, dtype=torch.bool), torch.zeros(10, dtype=torch.long), packet, 4, sample=0)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(12, 6, generator=generator, dtype=torch.float64)
    head = torch.randn(40, 6, generator=generator, dtype=torch.float64)
    out = rank_dflash_loss(
        hidden, head, targets, DFlashObjectiveConfig(max_anchors=3, gamma=7.0), block_size=4,
        sample_counts=supervised_slot_counts([targets], 1), reduce=lambda values: values,
    )
    rows = [r for r in range(12) if bool(targets.valid[r])]
    assert len(rows) == 3 + 3 + 1  # a = 8: only slot 1 lies inside the row
    expected = sum(float(torch.softmax(head @ hidden[r], dim=0)[int(targets.labels[r])]) for r in rows)
    assert float(out.metrics["prob_count"]) == len(rows) == float(out.metrics["supervised"])
    assert float(out.metrics["prob_sum"]) == pytest.approx(expected, rel=1e-12)
