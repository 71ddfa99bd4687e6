"""The typed run configuration: one frozen pydantic model per YAML section.

A run config has seven sections (``run``, ``model``, ``data``, ``objective``, ``topology``,
``optim``, ``train``). Every model forbids unknown keys and is immutable. Validation is fail
closed: rules that only involve one section live on that section, rules that combine sections
(sequence length versus block size versus topology, objective versus parallel layout, ...) live in
:mod:`csbp.config.rules` and run in :meth:`RunConfig._cross_section_rules`. Rule violations are
raised as :class:`~csbp.config.rules.ConfigRuleError`, which carries ``(field, message, fix)``
triples so :mod:`csbp.config.loading` can print one line per problem.

Fields marked with :func:`path_field` hold filesystem paths; the loader resolves relative values
against the config file's directory.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, field_validator, model_validator

from csbp.config.dflash_section import DFlashSection
from csbp.config.model_section import ModelSection
from csbp.config.rules import (
    ConfigRuleError,
    cross_section_violations,
    topology_layout_violation,
)
from csbp.config.section_base import _Section, path_field
from csbp.objectives.window_resample import UNBOUNDED_LOW, window_count_problem

if TYPE_CHECKING:
    from csbp.topology import Topology

MAX_INT64 = 2**63 - 1
"""The largest int64: an int the masks and positions compute with in torch tensors."""

MAX_SEED = MAX_INT64
"""The largest ``run.seed``: a 99999999999999999999 validated, then failed in ``torch.manual_seed``."""


class RunSection(_Section):
    """Identity of the run: its name, the global seed and where its outputs go."""

    name: str = Field(
        min_length=1,
        max_length=128,
        description="Run name, used for the default run directory (runs/<name>) and in logs: one path "
        "component (no '/' or '\\', not starting with '.').",
    )
    seed: int = Field(  # torch takes seeds below 2^64; the bound leaves room for the seeds derived by adding
        0, ge=0, le=MAX_SEED, description="Global seed of initialisation, data order and corruption."
    )
    run_dir: str | None = path_field(
        None, description="Directory for checkpoints, logs and config.yaml (default: runs/<name>)."
    )

    @field_validator("name")
    @classmethod
    def _one_path_component(cls, name: str) -> str:
        """``runs/<name>`` must stay inside ``runs/``: no separators, no ``..``, nothing hidden."""
        if any(bad in name for bad in ("/", "\\", "\x00")) or name.startswith(".") or name != name.strip():
            raise ValueError(
                f"{name!r} is not a plain directory name: use letters, digits, '-', '_' or '.', without '/' or "
                "'\\', not starting with '.'"
            )
        return name


class DataSection(_Section):
    """Training data: prepared artifacts (``csbp data prepare``) and the sequence length."""

    train: str = path_field(description="Prepared artifact directory (from `csbp data prepare`).")
    val: str | None = path_field(
        None, description="Artifact directory whose val split (or, without one, train split) is evaluated; "
        "unset: data.train's val split."
    )
    seq_len: int = Field(gt=1, description="Tokens per training sequence L.")
    tokenizer: str | None = path_field(
        None, description="tokenizer.json file or directory for decoding; unset: the artifact's tokenizer."
    )
    document_mask: bool | None = Field(
        None,
        description="Packed documents never attend to each other (docs/document-masking.md); unset: the "
        "objective's default, off for bd3 and mdlm, on for fast_dllm_v2, ar and dflash.",
    )
    reset_positions: bool = Field(
        False, description="Restart RoPE positions at every packed document (needs document_mask)."
    )


DOCUMENT_MASK_DEFAULTS: dict[str, tuple[bool, str]] = {
    "bd3": (False, "BD3-LM pretrains on concatenated documents, as its reference setup does"),
    "mdlm": (False, "MDLM pretrains on concatenated documents, as its reference setup does"),
    "fast_dllm_v2": (True, "Fast-dLLM v2 adapts models on packed SFT data, where attending across "
                     "unrelated documents is a known source of instability"),
    "ar": (True, "AR targets of DFlash drafters are served one document at a time"),
    "dflash": (True, "a DFlash context always stops at the anchor's document start"),
}
"""``data.document_mask`` when unset, per objective, with the reason shown by `csbp config validate`."""


ObjectiveName = Literal["bd3", "fast_dllm_v2", "mdlm", "ar", "dflash"]
_BLOCKED_OBJECTIVES = ("bd3", "fast_dllm_v2", "dflash")
MAX_CLIP_CANDIDATES = 1000
MIN_CLIP_WIDTH = 0.01
"""The narrowest noise window ``objective.clip_search_widths`` may search."""
"""Most noise windows ``objective.clip_search_widths`` may search (bd3lms' own grid has 36): each costs
``train.eval_batches`` forwards per validation, and a delta of 1e-300 hung every rank building its windows."""


class ObjectiveSection(_Section):
    """The training objective and its noise, weighting and normalisation (objectives.md)."""

    name: ObjectiveName = Field(description="bd3, fast_dllm_v2, mdlm, ar or dflash.")
    block_size: int | None = Field(
        None, gt=0, description="Diffusion block size B; mdlm: unset or seq_len; ar: unset."
    )
    mask_token_id: int | None = Field(
        None, ge=0, description="Vocabulary id of [MASK]; unset: from the data artifact's manifest."
    )
    t_min: float = Field(1e-3, ge=0.0, le=1.0, description="Lower clip of the noise level t.")
    t_max: float = Field(1.0, ge=0.0, le=1.0, description="Upper clip of the noise level t.")
    noise: Literal["rotated", "stratified"] = Field(
        "rotated", description="Noise levels per (sample, block): rotated lattice or jittered strata in random order."
    )
    loss_weight: Literal["inv_t", "unit"] = Field(
        "inv_t", description="Per-token loss weight 1/t or 1; unset: inv_t for bd3/mdlm, unit otherwise.",
        json_schema_extra={"default_text": "by objective"},  # filled by _fill_loss_weight
    )
    eps: float = Field(1e-3, ge=0.0, lt=1.0, description="Fast-dLLM v2 floor: p = (1 - eps) t + eps.")
    denominator: Literal["supervised_tokens", "all_tokens"] = Field(
        "supervised_tokens", description="Global loss normaliser: supervised tokens or all tokens."
    )
    ce_chunk_rows: int = Field(1024, gt=0, description="Rows per chunk of the LM-head cross-entropy.")
    clip_search_widths: list[float] = Field(
        default_factory=list,
        description="bd3: widths of the noise windows [t_min, t_max] searched at each validation; training moves "
        "to the window of least loss variance (BD3-LM's var_min, csbp.training.clip_search). Empty: no search.",
    )
    clip_search_delta: float = Field(
        0.05, gt=0.0, lt=1.0, description="bd3: step between the lower ends of the searched noise windows."
    )
    resample: bool = Field(
        False, description="bd3: redraw a block whose realised masked fraction falls outside [t_min, t_max] "
        "(bd3lms' training.resample, csbp.objectives.window_resample).",
    )
    dflash: DFlashSection | None = Field(None, description="DFlash settings; required when name is dflash.")

    @model_validator(mode="before")
    @classmethod
    def _fill_loss_weight(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("loss_weight") is None and isinstance(data.get("name"), str):
            return {**data, "loss_weight": "inv_t" if data["name"] in ("bd3", "mdlm") else "unit"}
        return data

    @model_validator(mode="after")
    def _check_objective(self) -> ObjectiveSection:
        violations = []
        if self.t_min >= self.t_max:
            violations.append(
                ("t_min", f"t_min={self.t_min} must be below t_max={self.t_max}", "lower t_min")
            )
        if self.name in ("bd3", "mdlm") and self.loss_weight == "inv_t" and self.t_min <= 0.0:
            violations.append(  # the objective refused it later, after the data was read, naming no field
                ("t_min", f"t_min={self.t_min} with loss_weight: inv_t weights a token masked at t = 0 by 1/0",
                 "raise t_min above 0 (the default is 0.001), or set loss_weight: unit")
            )
        if self.clip_search_widths and self.name != "bd3":
            violations.append(("clip_search_widths", f"searches bd3's noise window; {self.name} has none to search",
                               "remove objective.clip_search_widths"))
        # a width under MIN_CLIP_WIDTH gave no window past the 0.001 floor: the search silently scored the configured one
        bad_widths = [width for width in self.clip_search_widths if not MIN_CLIP_WIDTH <= width <= 1.0]
        if bad_widths:
            violations.append(("clip_search_widths", f"widths {bad_widths} are not in [{MIN_CLIP_WIDTH}, 1]",
                               "give widths of noise windows, e.g. [0.5, 0.6, 0.7, 0.8, 0.9]"))
        # csbp.training.clip_search.clip_candidates' count of lower ends per width (duplicates included)
        windows = sum(int((1.0 - width) / self.clip_search_delta + 1e-9) + 1 for width in self.clip_search_widths
                      if MIN_CLIP_WIDTH <= width <= 1.0)
        if windows > MAX_CLIP_CANDIDATES:
            violations.append(("clip_search_delta", f"{self.clip_search_delta:g} gives more than {MAX_CLIP_CANDIDATES} "
                               f"candidate windows for widths {self.clip_search_widths}, each scored at every "
                               "validation", "a coarser delta, e.g. the default 0.05"))
        if not self.clip_search_widths and self.clip_search_delta != 0.05:
            violations.append(("clip_search_delta", "has no effect without objective.clip_search_widths",
                               "set objective.clip_search_widths, or remove objective.clip_search_delta"))
        violations += self._resample_violations()
        if self.name in ("ar", "dflash") and self.loss_weight == "inv_t":
            violations.append(("loss_weight", f"{self.name} has no noise level to weight by", "use unit"))
        if self.name == "dflash" and self.denominator != "supervised_tokens":
            violations.append(
                ("denominator", "dflash normalises by each sample's supervised slots", "remove it")
            )
        if self.name == "dflash" and self.dflash is None:
            violations.append(
                ("dflash", "required when objective.name is dflash", "add objective.dflash.target")
            )
        if self.name != "dflash" and self.dflash is not None:
            violations.append(
                ("dflash", f"has no effect for objective {self.name}", "remove objective.dflash")
            )
        if self.name in _BLOCKED_OBJECTIVES and self.block_size is None:
            violations.append(
                ("block_size", f"required for objective {self.name}", "set objective.block_size")
            )
        if self.name == "ar" and self.block_size is not None:
            violations.append(("block_size", "ar has no diffusion blocks",
                               "remove objective.block_size, or set it to null (--set objective.block_size=null)"))
        if violations:
            raise ConfigRuleError(violations)
        return self

    def _resample_violations(self) -> list[tuple[str, str, str]]:
        """``resample`` is bd3's, must have a bound to keep, and every window it may train on must admit a
        masked count of a fully supervised block (else bd3lms' redraw loop never ends)."""
        if not self.resample:
            return []
        if self.name != "bd3":
            return [("resample", f"redraws bd3's blocks into its noise window; {self.name} has none",
                     "remove objective.resample")]
        if not self.clip_search_widths and self.t_min <= UNBOUNDED_LOW and self.t_max >= 1.0:
            return [("resample", f"the window [{self.t_min:g}, {self.t_max:g}] bounds no block's masked fraction "
                     f"(a lower end at or below {UNBOUNDED_LOW:g} and an upper end of 1 are not enforced)",
                     "clip the window, e.g. t_min: 0.3 and t_max: 0.8, or remove objective.resample")]
        if self.block_size is None or self.t_min >= self.t_max:
            return []  # the block_size rule, or the t_min < t_max rule, names it
        windows: list[tuple[float, float]] = [(self.t_min, self.t_max)]
        if self.clip_search_widths:
            from csbp.training.clip_search import clip_candidates  # the search's own windows, one definition

            windows = list(clip_candidates(self.clip_search_widths, self.clip_search_delta, windows[0]))
        empty = [window for window in windows if window_count_problem(self.block_size, *window)]
        if not empty:
            return []
        shown = ", ".join(f"[{low:g}, {high:g}]" for low, high in empty[:3]) + (" ..." if len(empty) > 3 else "")
        field = "t_min" if empty[0] == windows[0] else "clip_search_widths"
        return [(field, f"with resample, no count of masked tokens out of a block of {self.block_size} lies in "
                 f"the noise window {shown} (fractions step by 1/{self.block_size}), so no draw is ever kept",
                 "widen the window, or remove objective.resample")]


class TopologySection(_Section):
    """Parallel layout of one run: data-, context- and block-parallel degrees (csbp.md §5-§6)."""

    dp: int = Field(1, ge=1, description="Data-parallel replicas.")
    cp: int = Field(1, ge=1, description="Context-parallel degree: shards of the clean stream per ring.")
    bp: int = Field(1, ge=1, description="Block-parallel degree: ranks owning noisy blocks of one sample.")
    replicate_clean_prefix: bool = Field(
        False, description="Opt-in for BP-only (cp=1, bp>1): each rank recomputes its clean prefix."
    )
    transport: Literal["collective", "streaming", "halo"] = Field(
        "collective",
        description="Clean K/V exchange (cp > 1): all-gather/reduce-scatter, ring P2P, or halo (one "
        "all-to-all of only the clean rows some remote query may see; CSBP uses it with windows and documents).",
    )
    window: int | None = Field(  # 10**30 passed validation, then each rank raised OverflowError in its masks
        None,
        gt=0,
        le=MAX_INT64,
        description="Sliding attention window W in tokens, counting the query itself (a noisy block sees "
        "the W - 1 clean tokens before it; at most 2^63 - 1, torch's int64); bd3 and fast_dllm_v2 only; unset: "
        "full attention.",
    )
    schedule: Literal["dual_end", "contiguous", "balanced"] = Field(
        "dual_end",
        description="Block schedule over BP ranks: dual-end pairs, contiguous (ablation), or balanced (with "
        "data.document_mask: each sample's blocks dealt by their document cost; without documents it is dual_end).",
    )

    @model_validator(mode="before")
    @classmethod
    def _auto_is_resolved_at_launch(cls, data: Any) -> Any:
        """``topology: auto`` is replaced by the planner's layout in ``csbp train`` (csbp.plan.auto)."""
        if data == "auto":
            raise ConfigRuleError(
                [("", "'auto' is chosen by the planner when the run launches",
                  "run `csbp train CONFIG --nproc N` (it plans for N processes; `csbp config validate CONFIG "
                  "--nproc N` shows and checks that plan), or set dp, cp and bp")]
            )
        return data

    @model_validator(mode="after")
    def _check_layout(self) -> TopologySection:
        problem = topology_layout_violation(self.cp, self.bp, self.replicate_clean_prefix)
        if problem is not None:  # said in YAML terms; Topology's own message speaks Python
            raise ConfigRuleError([problem])
        self.to_topology()  # anything else it refuses
        if self.transport != "collective" and self.cp == 1:  # no clean K/V exchange: the option was ignored
            raise ConfigRuleError(
                [("transport", f"{self.transport} needs a CP ring (cp > 1)", "set cp > 1 or transport: collective")]
            )
        return self

    def to_topology(self) -> Topology:
        """The validated :class:`csbp.topology.Topology` of this section."""
        from csbp.topology import Topology  # lazy: keeps config import light

        return Topology(
            dp=self.dp, cp=self.cp, bp=self.bp, replicate_clean_prefix=self.replicate_clean_prefix
        )

    @property
    def world_size(self) -> int:
        """Processes of the whole run, ``dp * max(cp, bp)``."""
        return self.dp * max(self.cp, self.bp)


class AttentionSection(_Section):
    """How attention partials are computed (csbp.attention.backends)."""

    backend: Literal["auto", "tiles", "flex"] = Field(
        "auto",
        description="auto: FlexAttention on CUDA, tiled PyTorch kernels on CPU; tiles; flex (CUDA to train).",
    )
    diagonal: Literal["auto", "matmul", "sdpa", "sdpa_fold", "flex"] = Field(
        "auto",
        description=(
            "Kernel of the noisy block-diagonal partial (csbp.attention.diagonal): auto (tiles: sdpa for "
            "block_size >= 16, matmul below; flex: flex); matmul (batched dense blocks); sdpa (one fused SDPA "
            "call, FlashAttention-2 on CUDA); sdpa_fold (GQA heads folded into the rows); flex (flex backend "
            "only). On flex a non-flex diagonal runs the decomposed form."
        ),
    )
    clean: Literal["generic", "pieces", "pieces-cudnn"] = Field(
        "generic",
        description=(
            "Kernel of the clean-context partials (csbp.attention.flash_pieces): generic (one backend partial); "
            "pieces (their dense and causal pieces as fused flash calls, FlashAttention-2 on CUDA, plus a residual "
            "on the backend; with diagonal flex the noisy blocks run inside that residual's one Flex call); "
            "pieces-cudnn (the same with cuDNN's fused attention on CUDA). Exact either way; on CPU pieces measured "
            "slower than the tiles."
        ),
    )

    flex_backward: Literal["auto", "direct", "recompute"] = Field(
        "auto",
        description=(
            "Backward of a merged FlexAttention partial (csbp.attention.flex_backward): direct (the flex "
            "backward kernel from the merged statistics, no forward; needs a compiler that traces it: torch 2.11, 2.13 and 2.14.1 do); recompute "
            "(the partial's forward again, then the chain rule through the merge); auto: direct where the "
            "installed torch traces it, else recompute. Same gradients either way."
        ),
    )

    @model_validator(mode="after")
    def _check_diagonal(self) -> AttentionSection:
        from csbp.attention.diagonal import check_diagonal_backend  # no torch: keeps config import light

        try:
            check_diagonal_backend(self.diagonal, self.backend, where="diagonal")
        except ValueError as exc:
            raise ConfigRuleError([("diagonal", str(exc), "")]) from exc
        return self


class OptimSection(_Section):
    """AdamW and the learning-rate schedule."""

    lr: float = Field(gt=0.0, description="Peak learning rate.")
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0, description="Final lr as a fraction of lr (cosine, linear, wsd).")
    weight_decay: float = Field(0.01, ge=0.0, description="Decoupled weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW (beta1, beta2).")
    eps: float = Field(1e-8, gt=0.0, description="AdamW epsilon.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up steps.")
    schedule: Literal["cosine", "constant", "linear", "wsd"] = Field(
        "cosine", description="Decay after warm-up: cosine or linear to min_lr_ratio, constant, or wsd "
        "(warm-up-stable-decay: constant, then linear to min_lr_ratio over the last decay_fraction).")
    decay_fraction: float = Field(0.2, gt=0.0, le=1.0, description="wsd: the share of the steps after warm-up "
                                  "that decays (the rest hold the peak lr).")
    grad_clip: float | None = Field(1.0, gt=0.0, description="Global gradient-norm clip; null disables.")
    ema_decay: float | None = Field(
        None, gt=0.0, lt=1.0, description="Exponential moving average of the weights (bd3lms: 0.9999), used by "
        "validation, the final export and csbp export (csbp.training.weight_average); null: none.",
    )

    @model_validator(mode="after")
    def _check_betas(self) -> OptimSection:
        if not all(0.0 <= beta < 1.0 for beta in self.betas):
            raise ConfigRuleError(
                [("betas", f"betas={list(self.betas)} must lie in [0, 1)", "e.g. [0.9, 0.95]")]
            )
        return self

    @model_validator(mode="after")
    def _check_inert(self) -> OptimSection:
        # a setting the schedule never reads is refused, as objective.clip_search_delta without widths is:
        # a decay_fraction with cosine (or a floor with constant) silently trained on another schedule
        violations, fields = [], type(self).model_fields
        if self.schedule != "wsd" and self.decay_fraction != fields["decay_fraction"].default:
            violations.append(("decay_fraction", f"has no effect with schedule {self.schedule} (wsd reads it)",
                               "set optim.schedule: wsd, or remove optim.decay_fraction"))
        if self.schedule == "constant" and self.min_lr_ratio != fields["min_lr_ratio"].default:
            violations.append(("min_lr_ratio", "has no effect with schedule constant (the lr never decays)",
                               "set optim.schedule: cosine, linear or wsd, or remove optim.min_lr_ratio"))
        if violations:
            raise ConfigRuleError(violations)
        return self


class TrainSection(_Section):
    """Training loop: steps, batch, precision, logging, evaluation and checkpoints."""

    max_steps: int = Field(gt=0, description="Optimizer steps.")
    micro_batch_size: int = Field(1, gt=0, description="Sequences per data-parallel replica per micro-step.")
    grad_accum: int = Field(1, gt=0, description="Micro-steps accumulated per optimizer step.")
    precision: Literal["fp32", "bf16", "fp64"] = Field("fp32", description="Compute precision: fp32; bf16 "
                                                       "(autocast over float32 weights); fp64 (float64 weights).")
    log_every: int = Field(10, gt=0, description="Steps between console lines (metrics.jsonl and TensorBoard get every step).")
    eval_every: int = Field(0, ge=0, description="Steps between validation passes (also before a new run's first step and after the last); 0 disables.")
    eval_batches: int = Field(8, gt=0, description="Micro-batches per dp replica per validation pass: the "
                              "first eval_batches x micro_batch_size x dp val rows, at most the val split's.")
    save_every: int = Field(0, ge=0, description="Steps between checkpoints; 0: only at the end.")
    keep_checkpoints: int = Field(2, gt=0, description="Most recent checkpoints kept on disk.")
    fsdp: bool = Field(False, description="Shard parameters and optimizer state (FSDP2).")
    activation_checkpointing: Literal["none", "full", "selective"] = Field(
        "none",
        description="full: keep only each decoder (or drafter) layer's input and recompute the layer "
        "in backward (exact; the recompute repeats the layer's attention collectives). selective: also keep "
        "each layer's attention output, log-sum-exp and gathered K/V, and recompute only the norms, "
        "projections and MLP (no attention or collectives run twice; more memory than full).",
    )
    compile: Literal["none", "layers"] = Field(
        "none",
        description="layers: torch.compile each decoder (or drafter and frozen target) layer's norms, q/k/v "
        "projections with RoPE, and MLP (the attention kernels and collectives stay as they are); compiled once for all "
        "layers. Needs Triton on CUDA, a C++ compiler on the CPU; equal to round-off.",
    )
    collective_timeout_s: float = Field(
        300.0,
        ge=0.001,  # torch counts whole milliseconds: 1e-300 was a 0 ms limit that failed the first wait
        le=604800.0,
        description="torch.distributed timeout in seconds, for every process group: a stalled or dead rank "
        "ends the run after about this long (at least 1 ms, torch's unit; at most a week).",
    )
    nproc: int | None = Field(
        None, gt=0, description="Local processes `csbp train` launches; unset: the topology's world size."
    )
    generate_after: bool = Field(False, description="Print a sample generation when training ends.")
    nan_policy: Literal["stop", "skip"] = Field(
        "stop",
        description="A step whose loss or gradient norm is not finite: stop the run (keeping the last good "
        "checkpoint) or skip the update (at most 10 skips in a row, then stop).",
    )


class RunConfig(_Section):
    """A complete, validated run: what `csbp train` consumes and writes to ``<run_dir>/config.yaml``."""

    run: RunSection = Field(description="Run identity.")
    model: ModelSection = Field(description="The decoder.")
    data: DataSection = Field(description="Training data.")
    objective: ObjectiveSection = Field(description="Training objective.")
    topology: TopologySection = Field(default_factory=TopologySection, description="Parallel layout.")
    attention: AttentionSection = Field(default_factory=AttentionSection, description="Attention kernels.")
    optim: OptimSection = Field(description="Optimizer.")
    train: TrainSection = Field(description="Training loop.")

    @model_validator(mode="before")
    @classmethod
    def _mdlm_block_is_sequence(cls, data: Any) -> Any:
        """MDLM is the ``B = L`` case of BD3: an unset block size becomes ``data.seq_len``."""
        if not isinstance(data, dict):
            return data
        objective, section = data.get("objective"), data.get("data")
        if (
            isinstance(objective, dict)
            and isinstance(section, dict)
            and objective.get("name") == "mdlm"
            and objective.get("block_size") is None
            and type(section.get("seq_len")) is int  # not a bool: `seq_len: true` is seq_len's error only
        ):
            return {**data, "objective": {**objective, "block_size": section["seq_len"]}}
        return data

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    @property
    def document_mask(self) -> bool:
        """``data.document_mask``, or the objective's default when unset."""
        if self.data.document_mask is not None:
            return self.data.document_mask
        return DOCUMENT_MASK_DEFAULTS[self.objective.name][0]

    @property
    def num_local_processes(self) -> int:
        """Processes `csbp train` starts on this machine."""
        return self.train.nproc if self.train.nproc is not None else self.world_size

    @model_validator(mode="after")
    def _cross_section_rules(self) -> RunConfig:
        violations = cross_section_violations(self)
        if violations:
            raise ConfigRuleError(violations)
        return self
