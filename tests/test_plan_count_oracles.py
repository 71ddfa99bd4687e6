"""The cost model's traffic and memory terms against independent references: the runtime's own
exchange plans (``layouts.halo_exchange_plan``: the rows each ring member actually receives) and the
hand-computed identities of cost-model.md (the published 14B traffic, one more K/V pass for the
streaming ring's backward, the streaming overlap bounded by the ring's attention time)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from csbp.attention.documents import Documents
from csbp.attention.layouts import halo_exchange_plan
from csbp.plan.calibration import packaged_calibration
from csbp.plan.documents import RowDocuments
from csbp.plan.hardware import hardware
from csbp.plan.layout import Layout
from csbp.plan.model import GIB, halo_used, predict
from csbp.plan.planner_memory import check_planner_memory
from csbp.plan.workload import preset_workload

CAL = packaged_calibration("h200")
LENGTHS = [300, 700, 1100, 96, 900, 1000]  # one 4096-token row


def test_cp_aware_without_checkpointing_keeps_every_layers_halo_for_its_backward() -> None:
    """``cp-aware`` (CP-only's halo all-to-all) saves each layer's received K/V rows for that layer's
    backward, as the all-gather does: without checkpointing all 26 layers hold them at once. The rows
    are the member's own ``2L/cp`` plus what the runtime's halo plan sends it (the busiest member)."""
    seq_len, cp = 4096, 4
    starts = [sum(LENGTHS[:i]) for i in range(len(LENGTHS))]
    workload = preset_workload("nemotron-3b").with_options()
    workload = replace(workload, doc_length=RowDocuments(seq_len, tuple(starts)))
    group, layers = workload.model.groups[0], workload.model.num_layers
    layout = Layout(2, cp, transport="halo", checkpointing="none")
    assert halo_used(workload, layout, seq_len, group)
    plan = halo_exchange_plan(seq_len, workload.objective.block, cp, 1, 0, documents=Documents.from_lengths(LENGTHS))
    held = 2 * seq_len // cp + max(sum(plan.recv_counts(member)) for member in range(cp))
    row = 2 * group.n_kv_heads * group.head_dim * 2  # K and V, bf16
    got = predict(workload, layout, seq_len, hardware("h200", gpus=8), CAL).mem_terms["gathered K/V"]
    assert got == pytest.approx(held * row * (layers + 4 / 2))  # every layer's K/V, one layer's fp32 dK/dV


def test_the_streaming_ring_moves_one_more_kv_pass_than_the_published_collective() -> None:
    """The published 14B traffic identities (cost-model.md: 210.0 GiB CP-only, 105.0 GiB CSBP per GPU:
    forward all-gather, recompute all-gather and dK/dV reduce-scatter, a third each) plus the streaming
    backward's K/V re-circulation around the ring: one more third."""
    workload, hw = preset_workload("nemotron-14b"), hardware("h200", gpus=16)
    for (dp, cp, bp), gib in (((2, 8, 1), 210.0), ((2, 8, 8), 105.0)):
        for transport, passes in (("collective", 3), ("streaming", 4)):
            layout = Layout(dp, cp, bp, transport=transport, placement="striped", sharding="zero2")
            assert predict(workload, layout, 262144, hw, CAL).kv_bytes / GIB == pytest.approx(gib * passes / 3)


def test_a_streaming_ring_holds_three_shards_of_one_layer() -> None:
    """Without checkpointing a streaming CSBP member holds three clean K/V shards of ``L/cp`` rows (its
    own, the one it passes on, the one arriving) of one layer at a time, plus their fp32 dK/dV; the
    collective all-gather holds all ``cp`` shards of every layer."""
    workload, hw, seq_len, cp = preset_workload("nemotron-3b"), hardware("h200", gpus=8), 65536, 4
    group, layers = workload.model.groups[0], workload.model.num_layers
    row = 2 * group.n_kv_heads * group.head_dim * 2
    for transport, expected in (("streaming", 3 * (seq_len // cp) * row * (1 + 2)),
                                ("collective", seq_len * row * (layers + 2))):
        layout = Layout(2, cp, cp, transport=transport, checkpointing="none")
        assert predict(workload, layout, seq_len, hw, CAL).mem_terms["gathered K/V"] == expected


def test_streaming_hides_at_most_its_share_of_the_ring_attention_time() -> None:
    """``exposed = max(0, t_kv - overlap_stream x attention time)``: raising ``overlap_stream`` by 0.1
    hides 0.1 of the slowest rank's ring attention time, whatever the K/V time (halving the network's
    efficiency doubles ``t_kv``, not the time hidden)."""
    workload, hw, seq_len = preset_workload("nemotron-14b"), hardware("h200", gpus=16), 32768  # K/V-bound
    layout = Layout(2, 8, 8, transport="streaming", placement="striped", sharding="zero2")
    hidden = []
    for net_eff in (CAL.net_eff, CAL.net_eff / 2):
        exposed = [predict(workload, layout, seq_len, hw, replace(CAL, net_eff=net_eff, overlap_stream=share)).exposed_kv_s
                   for share in (0.0, 0.1)]
        assert exposed[1] > 0
        hidden.append(exposed[0] - exposed[1])
    assert hidden[0] == pytest.approx(hidden[1])
    assert predict(workload, layout, seq_len, hw, replace(CAL, overlap_stream=0.0)).exposed_kv_s == pytest.approx(
        predict(workload, replace(layout, transport="collective"), seq_len, hw,
                replace(CAL, overlap_csbp=0.0)).exposed_kv_s * 4 / 3)  # nothing hidden: all four passes exposed


def test_gradient_sync_bytes_per_sharding() -> None:
    """Per parameter and step (cost-model.md, docs/planning.md): DDP all-reduces float32 gradients (2 x 4 B),
    FSDP2 reduce-scatters them and all-gathers the float32 weights in the forward and the backward
    (3 x 4 B), ZeRO-2 moves bf16 gradients and weights (4 B): exposed sync times 2 : 3 : 1 on a data layout."""
    workload, hw = preset_workload("nemotron-3b"), hardware("h200", gpus=8)
    exposed = {
        sharding: predict(workload, Layout(8, sharding=sharding), 8192, hw, CAL).exposed_comm_s
        for sharding in ("ddp", "fsdp2", "zero2")
    }
    assert exposed["ddp"] > 0
    assert exposed["fsdp2"] / exposed["ddp"] == pytest.approx(1.5)
    assert exposed["zero2"] / exposed["ddp"] == pytest.approx(0.5)


def test_planning_memory_limit_is_the_documented_bytes_per_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """1 GiB of RAM: a BD3 row of block 32 takes 48 + 576/32 = 66 bytes per token, a drafter's 16: the
    longest plannable rows are 2^30 // 66 and 2^30 // 16 tokens."""
    import csbp.plan.hardware as hardware_module

    monkeypatch.setattr(hardware_module, "machine_ram_gib", lambda: 1.0)
    for workload, per_token in ((preset_workload("nemotron-3b"), 66), (preset_workload("dflash2-qwen3.8"), 16)):
        longest = 2**30 // per_token
        check_planner_memory(longest, workload)
        with pytest.raises(ValueError, match=f"fix: --seq-len {longest} or less"):
            check_planner_memory(longest + 1, workload)


def test_memory_terms_by_hand() -> None:
    """docs/planning.md's memory terms on nemotron-3b: FSDP2 holds its weight shard plus two whole layers
    (the one computing and the one prefetched); checkpoints are one ``d``-wide row per layer and row in the
    compute dtype (fp32 here: 4 B); with checkpointing the gathered clean K/V of a CSBP member (all ``L``
    rows) come with fp32 dK/dV."""
    base = preset_workload("nemotron-3b")
    hw, seq_len = hardware("h200", gpus=8), 8192
    model, group = base.model, base.model.groups[0]
    fp32 = replace(base, dtype_bytes=4)
    terms = predict(fp32, Layout(8), seq_len, hw, CAL).mem_terms  # data layout: 2L rows, fsdp2, full checkpointing
    assert terms["weights"] == pytest.approx(4 * model.total_params / 8 + 2 * 4 * model.max_layer_params)
    assert terms["checkpoints"] == model.num_layers * 2 * seq_len * model.d_model * 4
    terms = predict(base, Layout(2, 4, 4), seq_len, hw, replace(CAL, ws_factor=0.0)).mem_terms
    row = 2 * group.n_kv_heads * group.head_dim * 2
    assert terms["gathered K/V"] == seq_len * row * (1 + 4 / 2)


def test_drafter_context_and_attention_terms_by_hand() -> None:
    """The published drafter recipe (``context_rows: windows``) projects only its anchors' window rows,
    which sit in one zigzag chunk: at most ``L/(2·cp)`` rows (8192 of 32K over cp 2; the anchors' span is
    2048·8 + 2048). A full-attention draft layer's rows see on average ``L/2`` context keys, 4·hd·H FLOPs
    per pair x 3.5 (forward and backward): doubling ``L`` past the span adds only that to the step."""
    workload = preset_workload("dflash2-qwen3.8")
    model, obj = workload.model, workload.objective
    hw = hardware("h100", gpus=8)
    kv_width = sum(g.count * 2 * g.n_kv_heads * g.head_dim for g in model.groups)
    terms = predict(workload, Layout(4, 2, 2), 32768, hw, CAL).mem_terms
    assert terms["context activations"] == 8192 * (2 * model.d_model + kv_width) * 2
    full = replace(workload, model=replace(model, groups=tuple(replace(g, window=0) for g in model.groups)))
    steps = [predict(full, Layout(8), seq_len, hw, CAL).step_s for seq_len in (1 << 18, 1 << 19)]
    g = model.groups[0]
    draft_rows = obj.anchors * obj.block
    added = draft_rows * g.count * (1 << 18) / 2 * 4 * g.head_dim * g.n_heads * 3.5 / (hw.peak_tflops * 1e12 * CAL.drafter_eff)
    assert steps[1] - steps[0] == pytest.approx(added)


def test_a_sample_of_rows_is_the_mean_step_and_the_largest_memory() -> None:
    """``csbp plan --data``: a step over the sampled rows takes their mean step (throughput is the
    tokens of a step over it, not the mean of the rows' rates) and needs the memory of its hungriest row."""
    from csbp.plan.artifact_documents import DocumentSample

    seq_len, hw = 4096, hardware("h200", gpus=8)
    rows = (RowDocuments(seq_len, (0,)), RowDocuments(seq_len, tuple(range(0, seq_len, 64))))
    base = preset_workload("nemotron-3b")
    layout = Layout(2, 4, 4, checkpointing="none")
    each = [predict(replace(base, doc_length=row), layout, seq_len, hw, CAL) for row in rows]
    both = predict(replace(base, doc_length=DocumentSample("test", seq_len, rows, 2)), layout, seq_len, hw, CAL)
    mean_step = (each[0].step_s + each[1].step_s) / 2
    assert each[0].step_s != pytest.approx(each[1].step_s)
    assert both.tokens_per_s == pytest.approx(2 * seq_len / mean_step)  # dp2: two samples a step
    assert both.mem_bytes == max(p.mem_bytes for p in each) and each[0].mem_bytes != each[1].mem_bytes


def test_gradient_accumulation_exposes_each_micro_steps_kv_and_one_sync() -> None:
    """Two micro-steps per optimizer step: twice the exposed K/V time, one gradient synchronisation."""
    workload, hw = preset_workload("nemotron-3b"), hardware("h200", gpus=16)
    layout = Layout(2, 8, 8, placement="striped")
    one, two = (predict(workload, layout, 65536, hw, CAL, global_batch=batch) for batch in (2, 4))
    assert two.exposed_kv_s == pytest.approx(2 * one.exposed_kv_s) and one.exposed_kv_s > 0
    assert two.exposed_comm_s - two.exposed_kv_s == pytest.approx(one.exposed_comm_s - one.exposed_kv_s)


def test_a_drafters_micro_batch_multiplies_its_draft_rows_over_documents() -> None:
    """With packed documents a micro-batch of 2 samples holds twice one sample's draft activations."""
    workload = preset_workload("dflash2-qwen3.8").with_options(doc_length=4096)
    hw = hardware("h100", gpus=8)
    acts = [predict(workload, Layout(4, 2, 2, micro_batch=mb), 65536, hw, CAL).mem_terms["draft activations"]
            for mb in (1, 2)]
    assert acts[1] == pytest.approx(2 * acts[0]) and acts[0] > 0


def test_fast_dllm_v2s_two_views_double_a_samples_rows_and_traffic() -> None:
    """Fast-dLLM v2 trains two complementary views of each sample: the published 14B CSBP traffic
    (105.0 GiB per GPU for one view) and the checkpointed rows both double."""
    hw, layout = hardware("h200", gpus=16), Layout(2, 8, 8, placement="striped", sharding="zero2")
    bd3 = preset_workload("nemotron-14b")
    one, two = (predict(w, layout, 262144, hw, CAL) for w in (bd3, bd3.with_options(objective="fast_dllm_v2")))
    assert one.kv_bytes / GIB == pytest.approx(105.0) and two.kv_bytes / GIB == pytest.approx(210.0)
    assert two.mem_terms["checkpoints"] == 2 * one.mem_terms["checkpoints"]


def test_target_pass_terms_by_hand() -> None:
    """The online target pass (target_pass.py's docstring): the first ``layers`` layers across the target's
    groups; one layer's working set is the rank's rows' hidden, q/k/v and SwiGLU widths plus the K/V of
    all ``L`` rows; a micro-batch of 2 sends twice the sharded all-gather bytes; only what that working set
    exceeds of the draft step's activations adds to the peak."""
    from csbp.plan.target_pass import TargetPass, target_pass_cost, target_pass_memory, target_pass_times
    from csbp.plan.workload import LayerGroup, ModelShape

    target = ModelShape("t", 64, 100, 96, (LayerGroup(3, 4, 2, 16), LayerGroup(2, 8, 4, 16, window=32)))
    seq_len, cp = 256, 4
    cost = target_pass_cost(TargetPass("sharded", target, 4), seq_len, cp, 2)
    layer = [target.layer_params(g) for g in target.groups]
    assert cost.weight_bytes == 2 * (3 * layer[0] + layer[1])  # 3 full layers and the first windowed one
    rows, widest = seq_len // cp, []
    for g in target.groups:
        kv_row = 2 * g.n_kv_heads * g.head_dim * 2
        widest.append(rows * (2 * 64 + (g.n_heads + 2 * g.n_kv_heads) * g.head_dim + 3 * 96) * 2 + seq_len * kv_row)
    assert cost.working_set_bytes == max(widest)
    assert cost.kv_bytes == (cp - 1) * rows * (3 * 2 * 2 * 16 * 2 + 2 * 4 * 16 * 2)
    drafter = preset_workload("dflash2-qwen3.8")
    workload = replace(drafter, target_pass=TargetPass("sharded", target, 4))
    hw = hardware("h100", gpus=8)
    one, two = (target_pass_times(workload, Layout(4, cp, cp, micro_batch=mb), seq_len, hw, CAL) for mb in (1, 2))
    assert one is not None and two is not None and two.kv_bytes == 2 * one.kv_bytes == 2 * cost.kv_bytes
    layout = Layout(2, cp, cp)
    below = target_pass_memory(workload, layout, seq_len, step_activations=cost.working_set_bytes - 10,
                               features=0.0, step_only=False)
    above = target_pass_memory(workload, layout, seq_len, step_activations=cost.working_set_bytes,
                               features=0.0, step_only=False)
    assert below["target pass working set"] == 10 and "target pass working set" not in above


def test_a_hugging_face_configs_shape_by_hand(tmp_path) -> None:
    """A config.json without ``head_dim`` has ``hidden_size / num_attention_heads`` (not per K/V head);
    csbp reduces dK/dV in float32 (4 B per element); the total counts the untied head and embedding."""
    import json

    from csbp.plan.workload import hf_workload

    config = {"hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 2, "num_hidden_layers": 2,
              "vocab_size": 1000, "intermediate_size": 1024}
    (tmp_path / "config.json").write_text(json.dumps(config))
    workload = hf_workload(tmp_path)
    group = workload.model.groups[0]
    assert (group.n_heads, group.n_kv_heads, group.head_dim) == (8, 2, 64)
    assert workload.objective.kv_grad_bytes == 4
    per_layer = 512 * (8 + 2 * 2) * 64 + 8 * 64 * 512 + 3 * 512 * 1024 + 2 * 512  # q/k/v, o, SwiGLU, 2 norms
    assert workload.model.total_params == 2 * per_layer + 2 * 1000 * 512
    assert preset_workload("dflash2-qwen3.8").model.total_params == pytest.approx(
        preset_workload("dflash2-qwen3.8").model.body_params + 2 * 248320 * 5120 + 259522560)  # + the fusion fc


def test_the_search_offers_every_fused_ring_and_no_transport_a_windowed_csbp_ignores() -> None:
    """8 devices: every ``cp | bp`` CSBP layout (cp 2, 4 and 8 with bp 8), and for a model whose every layer
    is windowed only the collective transport of CSBP (its halo all-to-all ignores the transport)."""
    from csbp.plan.search import candidate_layouts, transports_for

    workload = preset_workload("nemotron-3b")
    fused = {(lay.cp, lay.bp) for lay in candidate_layouts(workload, 8, 8192) if lay.kind == "csbp" and lay.dp == 1}
    assert fused == {(2, 8), (4, 8), (8, 8)}
    assert transports_for(workload.with_options(window=512), Layout(1, 4, 8)) == ("collective",)
    assert transports_for(workload, Layout(1, 4, 8)) == ("collective", "streaming")


def test_selective_checkpointing_recomputes_the_dense_part_only_and_keeps_the_attention() -> None:
    """``selective`` (``train.activation_checkpointing``): its backward adds the forward's dense FLOPs
    (``full`` adds the attention's too); the ring moves no recompute pass of K/V (``none``'s bytes); it
    holds ``full``'s checkpoints plus, per layer, the attention output (compute dtype) and its fp32
    log-sum-exp for every row, and ``none``'s gathered K/V of every layer."""
    workload, hw, seq_len = preset_workload("nemotron-3b"), hardware("h200", gpus=8), 32768
    model, p = workload.model, workload.dtype_bytes
    one = {mode: predict(workload, Layout(1, checkpointing=mode), seq_len, hardware("h200", gpus=1), CAL)
           for mode in ("none", "full", "selective")}
    rows = 2 * seq_len  # a data layout holds both streams of its sample
    dense = 2 * model.body_params * rows + 2 * model.vocab * model.d_model * seq_len
    gemm = hw.peak_tflops * 1e12 * CAL.gemm_eff
    assert one["selective"].bwd_s - one["none"].bwd_s == pytest.approx(dense / gemm)
    assert one["full"].bwd_s - one["selective"].bwd_s == pytest.approx(one["full"].fwd_s - dense / gemm)
    ring = {mode: predict(workload, Layout(2, 4, 4, checkpointing=mode), seq_len, hw, CAL)
            for mode in ("none", "full", "selective")}
    assert ring["selective"].kv_bytes == ring["none"].kv_bytes < ring["full"].kv_bytes
    terms = ring["selective"].mem_terms
    assert terms["checkpoints"] == ring["full"].mem_terms["checkpoints"]
    assert terms["gathered K/V"] == ring["none"].mem_terms["gathered K/V"]
    held_rows = ring["full"].mem_terms["checkpoints"] / (model.num_layers * model.d_model * p)
    per_row = sum(g.count * g.n_heads * (g.head_dim * p + 4) for g in model.groups)
    assert terms["kept attention"] == pytest.approx(held_rows * per_row)
    assert ring["full"].mem_bytes < ring["selective"].mem_bytes < ring["none"].mem_bytes
