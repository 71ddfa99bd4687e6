"""Run-config rules no other test pinned, found by a mutation audit of csbp.config (rules.py, schema.py,
the model, dflash and rope sections, loading.py) and csbp.topology: each test here fails on one mutant
that every other config test let through (a dropped clause, a bound off by one, a flipped comparison,
a message naming the wrong fix), and passes on the real rule."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from csbp.config import config_from_dict, load_config
from test_config import dflash_changes, error_lines, with_changes
from test_config_errors import error_lines as error_lines_of_file
from test_config_errors import tiny

# ----------------------------------------------------------------------------- topology layout


def test_a_fused_layout_refusal_suggests_the_next_multiple_of_cp() -> None:
    # the suggestion rounds bp up to a multiple of cp (flooring it offered bp: 3 for cp: 3, bp: 4, itself refused)
    for (cp, bp), suggested in (((3, 4), 6), ((4, 2), 4), ((2, 5), 6)):
        (line,) = error_lines(with_changes({"topology.cp": cp, "topology.bp": bp}))
        assert line.startswith(
            f"config.yaml: topology.bp: cp: {cp} with bp: {bp} is not a fused CSBP layout: bp must be a multiple of "
            f"cp (e.g. bp: {suggested}) (fix: accepted layouts:"
        ), line


# ----------------------------------------------------------------------------- documents and sequence


def test_reset_positions_follows_the_objectives_document_mask_default() -> None:
    # fast_dllm_v2 masks documents by default: reset_positions needs no explicit data.document_mask
    # (reading the unset field, not the objective's default, refused it)
    changes: dict[str, Any] = {"objective.name": "fast_dllm_v2", "objective.loss_weight": ..., "data.reset_positions": True}
    cfg = config_from_dict(with_changes(changes))
    assert (cfg.document_mask, cfg.data.reset_positions) == (True, True)
    (line,) = error_lines(with_changes(changes | {"data.document_mask": False}))
    assert line.startswith("config.yaml: data.reset_positions: restarting positions at documents needs document masking")


def test_a_dflash_block_covering_the_whole_row_is_refused() -> None:
    # an anchor block as long as the row leaves no context to draft from; the rule covered bd3 and fast_dllm_v2 only
    for block in (16, 32):
        (line,) = error_lines(with_changes(dflash_changes() | {"data.seq_len": 16, "objective.block_size": block}))
        assert line == (
            f"config.yaml: objective.block_size: block_size={block} must be below data.seq_len=16 for dflash "
            "(fix: use mdlm for one block per sequence, or a smaller block_size)"
        )
    assert config_from_dict(with_changes(dflash_changes() | {"data.seq_len": 16, "objective.block_size": 8}))


def test_reset_positions_on_dflash_is_refused() -> None:
    # the drafter takes its positions from the frozen target: restarting them at documents was silently accepted
    # without this rule (dflash masks documents by default, so the document_mask rule let it through)
    assert error_lines(with_changes(dflash_changes() | {"data.reset_positions": True})) == [
        "config.yaml: data.reset_positions: DFlash positions come from the frozen target (fix: remove data.reset_positions)"
    ]

def test_a_dflash_block_of_one_names_the_smallest_block_that_drafts() -> None:
    (line,) = error_lines(with_changes(dflash_changes() | {"objective.block_size": 1}))
    assert line == (
        "config.yaml: objective.block_size: block_size=1 leaves no slot to draft after the anchor (the loss is 0 and "
        "nothing trains) (fix: use block_size >= 2 (the DFlash recipes use 4-16))"
    )


# ----------------------------------------------------------------------------- run and optim bounds


def test_warmup_may_last_the_whole_run() -> None:
    # the rule is warmup_steps > max_steps: a warm-up ending at the last step is a valid schedule
    cfg = config_from_dict(with_changes({"optim.warmup_steps": 600, "train.max_steps": 600}))
    assert (cfg.optim.warmup_steps, cfg.train.max_steps) == (600, 600)
    (line,) = error_lines(with_changes({"optim.warmup_steps": 601, "train.max_steps": 600}))
    assert line.startswith("config.yaml: optim.warmup_steps: warmup_steps=601 exceeds train.max_steps=600")


@pytest.mark.parametrize("name", ["a\\b", "a\x00b", " demo", "demo ", ".demo", "a/b"])
def test_a_run_name_that_is_not_one_plain_path_component_is_refused(name: str) -> None:
    # runs/<name> must stay one directory inside runs/: a Windows separator, a NUL, padding or a hidden name too
    (line,) = error_lines(with_changes({"run.name": name}))
    assert line.startswith(f"config.yaml: run.name: {name!r} is not a plain directory name"), line


def test_a_run_name_is_at_most_128_characters() -> None:
    assert config_from_dict(with_changes({"run.name": "r" * 128})).run.name == "r" * 128
    (line,) = error_lines(with_changes({"run.name": "r" * 129}))
    assert line.startswith("config.yaml: run.name: ") and "128" in line, line


@pytest.mark.parametrize("objective", ["ar", "mdlm"])
def test_a_row_of_one_token_is_refused_by_its_own_bound(objective: str) -> None:
    # one token has no next token (ar) and no other position to condition on (mdlm): seq_len > 1
    changes = {"objective.name": objective, "objective.block_size": ..., "objective.loss_weight": ..., "topology.cp": 1,
               "topology.bp": 1, "data.seq_len": 1}
    (line,) = error_lines(with_changes(changes))
    assert line.startswith("config.yaml: data.seq_len: must be > 1, got 1"), line
    assert config_from_dict(with_changes(changes | {"data.seq_len": 2})).data.seq_len == 2


def test_the_fast_dllm_v2_eps_floor_stays_below_1() -> None:
    # p = (1 - eps) t + eps: eps 1 masks every token at every t, leaving no clean token to learn from
    changes: dict[str, Any] = {"objective.name": "fast_dllm_v2", "objective.loss_weight": ...}
    (line,) = error_lines(with_changes(changes | {"objective.eps": 1.0}))
    assert line.startswith("config.yaml: objective.eps: must be < 1.0, got 1.0"), line
    assert config_from_dict(with_changes(changes | {"objective.eps": 0.999})).objective.eps == 0.999


# ----------------------------------------------------------------------------- objective defaults and requirements


@pytest.mark.parametrize(
    ("objective", "weight"), [("bd3", "inv_t"), ("mdlm", "inv_t"), ("fast_dllm_v2", "unit"), ("ar", "unit"), ("dflash", "unit")]
)
def test_an_unset_loss_weight_is_the_objectives_own(objective: str, weight: str) -> None:
    # MDLM's NELBO weights by 1/t like BD3's (unit for mdlm survived every other test)
    changes: dict[str, Any] = {"objective.name": objective, "objective.loss_weight": ...}
    if objective in ("mdlm", "ar"):
        changes |= {"objective.block_size": ..., "topology.cp": 1, "topology.bp": 1}
    if objective == "dflash":
        changes = dflash_changes()
    assert config_from_dict(with_changes(changes)).objective.loss_weight == weight


def test_a_dflash_run_needs_a_block_size() -> None:
    (line,) = error_lines(with_changes(dflash_changes() | {"objective.block_size": ...}))
    assert line == ("config.yaml: objective.block_size: required for objective dflash "
                    "(fix: set objective.block_size)")


@pytest.mark.parametrize("betas", [[-0.1, 0.95], [0.9, -0.5]])
def test_a_negative_adamw_beta_is_refused(betas: list[float]) -> None:
    (line,) = error_lines(with_changes({"optim.betas": betas}))
    assert line == f"config.yaml: optim.betas: betas={betas} must lie in [0, 1) (fix: e.g. [0.9, 0.95])"
    assert config_from_dict(with_changes({"optim.betas": [0.0, 0.0]})).optim.betas == (0.0, 0.0)


# ----------------------------------------------------------------------------- processes


def test_train_nproc_0_is_refused_by_its_bound_not_a_division_by_zero() -> None:
    (line,) = error_lines(with_changes({"train.nproc": 0}))
    assert line.startswith("config.yaml: train.nproc: must be > 0, got 0"), line


def test_a_cp_only_runs_world_is_dp_times_cp() -> None:
    # dp * max(cp, bp): a CP-only run (bp 1) still launches cp processes per replica
    cp_only = {"topology.cp": 4, "topology.bp": 1, "topology.dp": 2, "data.seq_len": 512}
    cfg = config_from_dict(with_changes(cp_only | {"train.nproc": 4}))
    assert (cfg.world_size, cfg.topology.world_size, cfg.num_local_processes) == (8, 8, 4)
    assert config_from_dict(with_changes(cp_only)).num_local_processes == 8
    (line,) = error_lines(with_changes(cp_only | {"train.nproc": 3}))
    assert line == ("config.yaml: train.nproc: nproc=3 does not divide the world size dp*max(cp, bp)=8 "
                    "(fix: remove train.nproc or use a divisor of 8)")


def test_a_boolean_seq_len_on_mdlm_is_one_line_naming_seq_len() -> None:
    # the mdlm block is filled from an int seq_len only: `true` became block_size true too, a second line
    lines = error_lines(with_changes({"objective.name": "mdlm", "objective.block_size": ..., "topology.cp": 1,
                                      "topology.bp": 1, "data.seq_len": True}))
    assert len(lines) == 1 and lines[0].startswith("config.yaml: data.seq_len: expected int, got the boolean true"), lines


# ----------------------------------------------------------------------------- model defaults


@pytest.mark.parametrize(
    ("arch", "defaults"),
    [(None, (1e6, 1e-6, True, False)), ("qwen3", (1e6, 1e-6, True, False)), ("qwen2", (1e6, 1e-6, False, False)),
     ("llama", (5e5, 1e-5, False, False)), ("mistral", (1e6, 1e-5, False, False))],
)
def test_a_from_scratch_model_takes_its_archs_defaults(arch: str | None, defaults: tuple[Any, ...]) -> None:
    # no arch key is qwen3, whose defaults are filled (llama's would then contradict qwen3's query/key norms);
    # every family's HF layout has untied embeddings
    model = config_from_dict(with_changes({"model.arch": ... if arch is None else arch})).model
    assert (model.rope_theta, model.rms_norm_eps, model.qk_norm, model.tie_embeddings) == defaults
    assert model.arch == (arch or "qwen3")


def test_init_from_keeps_the_checkpoints_rope_and_norms_when_a_shape_field_is_given() -> None:
    # with init_from, unset fields are read from the checkpoint; a shape field given to be checked against it must
    # not fill the arch defaults, which would replace the checkpoint's rope_theta (set: replaces it)
    shapes = ("hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim")
    model = config_from_dict(
        with_changes({f"model.{name}": ... for name in shapes} | {"model.init_from": "/ckpt", "model.num_layers": 4})
    ).model
    assert model.num_layers == 4
    assert (model.rope_theta, model.rms_norm_eps, model.qk_norm, model.tie_embeddings) == (None, None, None, None)


def test_a_negative_target_layer_id_is_refused() -> None:
    # -1 would index the last layer Python-style; the ids are 0-based layer indices
    (line,) = error_lines(with_changes(dflash_changes() | {"objective.dflash.target_layer_ids": [-1, 2]}))
    assert line == ("config.yaml: objective.dflash.target_layer_ids: ids are 0-based layer indices "
                    "(fix: use ids >= 0)")


# ----------------------------------------------------------------------------- dflash options without their switch


@pytest.mark.parametrize(
    ("changes", "line"),
    [
        ({"selector_stop_gradient": True},
         "selector_stop_gradient: has no effect: the DFlash2 selector is off (selector_rank: 0) "
         "(fix: set selector_rank > 0, or remove selector_stop_gradient)"),
        ({"sliding_window_causal": False},
         "sliding_window_causal: has no effect: no draft layer is sliding_attention "
         "(fix: list sliding_attention in layer_types, or remove sliding_window_causal)"),
        ({"kl_decay": 2.0},
         "kl_decay: has no effect: lk_loss_type: ce is not the mix (fix: set lk_loss_type: lambda, or remove kl_decay)"),
        ({"selector_top_k": 8, "selector_ramp_ratio": 0.1, "selector_stop_gradient": True},
         "selector_top_k: has no effect (nor selector_ramp_ratio, selector_stop_gradient): the DFlash2 selector is off "
         "(selector_rank: 0) (fix: set selector_rank > 0, or remove selector_top_k, selector_ramp_ratio, "
         "selector_stop_gradient)"),
    ],
)
def test_each_dflash_option_without_its_switch_is_named(changes: dict[str, Any], line: str) -> None:
    dotted = {f"objective.dflash.{key}": value for key, value in changes.items()}
    assert error_lines(with_changes(dflash_changes() | dotted)) == [f"config.yaml: objective.dflash.{line}"]


@pytest.mark.parametrize("weighting", ["dpace", "dpace-cumulative-confidence-only", "dpace-continuation-value-only"])
def test_every_dpace_weighting_uses_dpace_alpha(weighting: str) -> None:
    dotted = {"objective.dflash.weighting": weighting, "objective.dflash.dpace_alpha": 0.3}
    dflash = config_from_dict(with_changes(dflash_changes() | dotted)).objective.dflash
    assert dflash is not None and (dflash.weighting, dflash.dpace_alpha) == (weighting, 0.3)


def test_an_empty_target_layer_list_is_refused() -> None:
    # unset is the DFlash default; an empty list fuses no target layer at all
    (line,) = error_lines(with_changes(dflash_changes() | {"objective.dflash.target_layer_ids": []}))
    assert line.startswith("config.yaml: objective.dflash.target_layer_ids: "), line
    assert "at least 1" in line, line


def test_document_masking_defaults_per_objective() -> None:
    # fast_dllm_v2, ar and dflash mask documents when data.document_mask is unset; bd3 and mdlm do not
    runs: dict[str, dict[str, Any]] = {
        "bd3": {},
        "mdlm": {"objective.name": "mdlm", "objective.block_size": ..., "topology.cp": 1, "topology.bp": 1},
        "fast_dllm_v2": {"objective.name": "fast_dllm_v2", "objective.loss_weight": ...},
        "ar": {"objective.name": "ar", "objective.block_size": ..., "objective.loss_weight": ..., "topology.cp": 1,
               "topology.bp": 1},
        "dflash": dflash_changes(),
    }
    masked = {name: config_from_dict(with_changes(changes)).document_mask for name, changes in runs.items()}
    assert masked == {"bd3": False, "mdlm": False, "fast_dllm_v2": True, "ar": True, "dflash": True}


# ----------------------------------------------------------------------------- loading


def test_an_empty_path_in_the_file_is_refused_not_read_as_its_directory(tmp_path: Path) -> None:
    # "" resolved against the config's directory became that directory, and passed the non-empty bound
    lines = error_lines_of_file(tiny(tmp_path, "train: art", 'train: ""'), 'data.tokenizer=""')
    assert [line.split(": ", 2)[1] for line in lines] == ["data.train", "data.tokenizer"]
    assert all("at least 1 character, got ''" in line for line in lines), lines


def test_a_dotted_key_inside_a_mapping_override_is_refused_as_a_mapping_key(tmp_path: Path) -> None:
    assert error_lines_of_file(tiny(tmp_path), "topology={cp.x: 2}") == [
        "--set topology: key 'cp.x' of the mapping is not a field name (fix: e.g. --set optim.lr=3e-4)"
    ]


def test_two_misspellings_of_one_missing_section_rename_only_one() -> None:
    # renaming both would write the section twice: the second is an unknown key
    data = with_changes({})
    data["Model"] = data["modle"] = data.pop("model")
    assert error_lines(data) == [
        "config.yaml: Model: unknown section; did you mean model? (fix: rename Model to model)",
        "config.yaml: modle: unknown key (fix: remove it; did you mean model?)",
    ]


def test_equal_noise_clips_are_refused() -> None:
    # t_min must be strictly below t_max (equal ones survived a '>' mutant)
    (line,) = error_lines(with_changes({"objective.t_min": 0.5, "objective.t_max": 0.5}))
    assert line == "config.yaml: objective.t_min: t_min=0.5 must be below t_max=0.5 (fix: lower t_min)"


def test_the_final_lr_is_at_most_the_peak() -> None:
    # min_lr_ratio above 1 made the cosine 'decay' grow the lr past its peak
    (line,) = error_lines(with_changes({"optim.min_lr_ratio": 1.5}))
    assert line.startswith("config.yaml: optim.min_lr_ratio: must be <= 1.0, got 1.5"), line
    assert config_from_dict(with_changes({"optim.min_lr_ratio": 1.0})).optim.min_lr_ratio == 1.0


def test_a_mapping_value_is_deep_merged_into_its_section(tmp_path: Path) -> None:
    # apply_overrides merges a mapping into an existing section; replacing it dropped the section's other keys
    from csbp.config.loading import apply_overrides

    data = {"topology": {"dp": 2, "cp": 2, "window": 8}, "run": {"name": "r"}}
    merged = apply_overrides(data, [(("topology",), {"cp": 4, "bp": 4})])
    assert merged == {"topology": {"dp": 2, "cp": 4, "window": 8, "bp": 4}, "run": {"name": "r"}}
    assert data["topology"] == {"dp": 2, "cp": 2, "window": 8}  # a copy: the input is left as it was
    cfg = load_config(tiny(tmp_path, "dp: 1, cp: 1", "dp: 2, cp: 1"), ["topology={}"])  # merges nothing
    assert cfg.topology.dp == 2


# ----------------------------------------------------------------------------- field bounds


_YARN = {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64}


@pytest.mark.parametrize(
    ("changes", "field", "bound"),
    [
        ({"objective.mask_token_id": -1}, "objective.mask_token_id", ">= 0"),  # a negative id indexed from the end
        ({"objective.t_max": 1.5}, "objective.t_max", "<= 1.0"),  # a masking probability above 1
        ({"optim.grad_clip": 0.0}, "optim.grad_clip", "> 0.0"),  # null disables clipping; 0 zeroed every update
        ({"optim.weight_decay": -0.01}, "optim.weight_decay", ">= 0.0"),  # a decay that grows the weights
        ({"optim.warmup_steps": -1}, "optim.warmup_steps", ">= 0"),
        ({"train.keep_checkpoints": 0}, "train.keep_checkpoints", "> 0"),  # keeping none deleted every save
        ({"train.eval_batches": 0}, "train.eval_batches", "> 0"),  # eval_every 0 turns validation off
        ({"train.collective_timeout_s": 604800.5}, "train.collective_timeout_s", "<= 604800.0"),
        ({"model.vocab_size": 0}, "model.vocab_size", "> 0"),
        ({"model.rope_scaling": _YARN | {"original_max_position_embeddings": 0}},
         "model.rope_scaling.original_max_position_embeddings", "> 0"),
    ],
)
def test_each_bound_is_refused_one_step_past_it(changes: dict[str, Any], field: str, bound: str) -> None:
    (line,) = error_lines(with_changes(changes))
    assert line.startswith(f"config.yaml: {field}: must be {bound}, got "), line


@pytest.mark.parametrize(
    ("changes", "field", "bound"),
    [  # each with its switch on, so only the bound can refuse it (off, the inert-option rule would)
        ({"weighting": "dpace", "dpace_alpha": 1.5}, "dpace_alpha", "<= 1.0"),
        ({"lk_loss_type": "lambda", "kl_scale": 1.5}, "kl_scale", "<= 1.0"),
        ({"selector_rank": 4, "selector_warmup_ratio": 1.5}, "selector_warmup_ratio", "<= 1.0"),
        ({"eval_new_tokens": 0}, "eval_new_tokens", "> 0"),  # eval_prompts 0 turns it off
    ],
)
def test_each_dflash_bound_is_refused_one_step_past_it(changes: dict[str, Any], field: str, bound: str) -> None:
    dotted = {f"objective.dflash.{key}": value for key, value in changes.items()}
    (line,) = error_lines(with_changes(dflash_changes() | dotted))
    assert line.startswith(f"config.yaml: objective.dflash.{field}: must be {bound}, got "), line


@pytest.mark.parametrize(("cp", "bp", "replicate"), [(1, 1, False), (1, 4, True)])
def test_a_ring_transport_without_a_ring_is_refused(cp: int, bp: int, replicate: bool) -> None:
    # no layout with cp 1 exchanges clean K/V: transport: halo trained as collective with the option ignored
    # (streaming was refused already); the planner writes collective there
    layout = {"topology.cp": cp, "topology.bp": bp, "topology.replicate_clean_prefix": replicate}
    for transport in ("streaming", "halo"):
        (line,) = error_lines(with_changes(layout | {"topology.transport": transport}))
        assert line == (f"config.yaml: topology.transport: {transport} needs a CP ring (cp > 1) "
                        "(fix: set cp > 1 or transport: collective)")
    assert config_from_dict(with_changes(layout | {"topology.transport": "collective"})).topology.cp == 1
    assert config_from_dict(with_changes({"topology.transport": "halo"})).topology.transport == "halo"  # cp 2
