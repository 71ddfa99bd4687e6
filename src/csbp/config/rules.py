"""Cross-section rules of a run config, and the error type every config rule raises.

Each rule function takes a :class:`~csbp.config.schema.RunConfig` whose sections are already
valid on their own and returns violations ``(dotted field, message, fix)``; an empty list means
the rule holds. :class:`~csbp.config.schema.RunConfig` raises them together, so the loader can
print one line per problem.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from csbp.config.schema import RunConfig

Violation = tuple[str, str, str]
"""``(field, message, fix)``: a dotted field path, what is wrong, and what to do (may be empty)."""

SINGLE_STREAM_OBJECTIVES = ("mdlm", "ar")
"""Objectives over one stream of rows (no clean copy): no cp/bp ranks, no window."""
SHAPE_FIELDS = ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim")
"""Decoder shape fields of ``model`` (required unless ``init_from``; forbidden for dflash)."""
_DECODER_FIELDS = ("rope_theta", "rms_norm_eps", "qk_norm", "tie_embeddings")
_TARGET_FIELDS = ("init_from", "vocab_size", "rope_scaling")


class ConfigRuleError(ValueError):
    """One or more violated config rules, each ``(field, message, fix)``.

    ``field`` is a dotted path relative to the model that raised (``""`` for the model itself);
    ``fix`` may be empty when the message already says what to do.
    """

    def __init__(self, violations: list[Violation]) -> None:
        self.violations = violations
        super().__init__("; ".join(_format_violation(f, m, x) for f, m, x in violations))


def _format_violation(field: str, message: str, fix: str) -> str:
    prefix = f"{field}: " if field else ""
    return f"{prefix}{message}" + (f" (fix: {fix})" if fix else "")


LAYOUTS_FIX = (
    "accepted layouts: data (cp=bp=1), CP-only (bp=1), BP-only (cp=1, bp>1, replicate_clean_prefix: true), "
    "fused (bp >= cp, bp % cp == 0)"
)


def topology_layout_violation(cp: int, bp: int, replicate_clean_prefix: bool) -> Violation | None:
    """The ``topology`` section's layout problem in the config's own words (YAML keys and values;
    :class:`csbp.topology.Topology` says the same for Python callers), or None when it is valid."""
    if cp > 1 and bp > 1 and (bp < cp or bp % cp):
        suggestion = -(-max(bp, cp) // cp) * cp
        return (
            "bp",
            f"cp: {cp} with bp: {bp} is not a fused CSBP layout: bp must be a multiple of cp (e.g. bp: {suggestion})",
            LAYOUTS_FIX,
        )
    if cp == 1 and bp > 1 and not replicate_clean_prefix:
        return (
            "replicate_clean_prefix",
            f"cp: 1 with bp: {bp} is BP-only, which replicates the clean prefix on every rank",
            "set replicate_clean_prefix: true to opt in, or use cp > 1 (fused CSBP)",
        )
    if replicate_clean_prefix and not (cp == 1 and bp > 1):
        return (
            "replicate_clean_prefix",
            f"true is only for BP-only layouts (cp: 1, bp > 1), got cp: {cp}, bp: {bp}",
            "set replicate_clean_prefix: false",
        )
    return None


def cross_section_violations(cfg: RunConfig) -> list[Violation]:
    """Every violated cross-section rule of ``cfg``."""
    return (
        _model_rules(cfg) + _sequence_rules(cfg) + _objective_layout_rules(cfg) + _training_rules(cfg)
        + _document_rules(cfg) + _optimizer_rules(cfg)
    )


_FLOAT_LIMITS = {"float32": (1.1754943508222875e-38, 3.4028234663852886e38),
                 "float64": (2.2250738585072014e-308, 1.7976931348623157e308)}
"""Smallest normal and largest finite value of the weights' and AdamW state's dtype."""


def _optimizer_rules(cfg: RunConfig) -> list[Violation]:
    """AdamW numbers that cannot be meant: a step size the weights' dtype cannot hold (torch raised in the
    first step: a traceback), a decoupled weight decay that zeroes or flips the weights each step (it diverged
    and the NaN stop blamed the lr), an eps that is 0 or inf in that dtype (0/0 = NaN for a weight that gets
    no gradient, blamed on the lr; no update at all, silently). A large lr that only diverges stays allowed:
    ``train.nan_policy`` is for that."""
    optim = cfg.optim
    dtype = "float64" if cfg.train.precision == "fp64" else "float32"  # bf16 keeps float32 master weights
    tiny, largest = _FLOAT_LIMITS[dtype]
    violations = []
    step = optim.lr / (1.0 - optim.betas[0])  # torch's step size lr / (1 - beta1^t) is largest at t = 1
    if step > largest:
        violations.append(
            ("optim.lr", f"lr={optim.lr:g} makes AdamW's first step size lr / (1 - betas[0]) = {step:.3g}, beyond "
             f"the largest {dtype} ({largest:.3g}): torch cannot apply it to the {dtype} weights",
             f"use an lr below {largest * (1.0 - optim.betas[0]):.3g} (typical: 1e-5 to 1e-2)")
        )
    if optim.lr * optim.weight_decay >= 1.0 and step <= largest:
        violations.append(
            ("optim.weight_decay", f"weight_decay={optim.weight_decay:g} with lr={optim.lr:g}: AdamW's decoupled decay "
             f"multiplies each decayed weight by 1 - lr x weight_decay = {1.0 - optim.lr * optim.weight_decay:.3g} per "
             "step at the peak lr, which zeroes the weights or flips their signs",
             f"use a weight_decay below 1 / lr = {1.0 / optim.lr:.3g} (typical: 0 to 0.1), or an lr below "
             f"1 / weight_decay = {1.0 / optim.weight_decay:.3g}")
        )
    if optim.eps < tiny:
        violations.append(
            ("optim.eps", f"eps={optim.eps:g} is below the smallest normal {dtype} ({tiny:.3g}): a weight that "
             "gets no gradient is updated by 0/0 = NaN", "use eps >= 1e-30 (the default is 1e-8)")
        )
    if optim.eps > largest:
        violations.append(
            ("optim.eps", f"eps={optim.eps:g} is inf in {dtype}: every AdamW update is divided by it, so nothing "
             "trains", "use a small eps (the default is 1e-8)")
        )
    return violations


def _document_rules(cfg: RunConfig) -> list[Violation]:
    """``data.reset_positions`` needs documents to restart at; DFlash contexts are always per document."""
    violations = []
    if cfg.data.reset_positions and not cfg.document_mask:
        violations.append(
            ("data.reset_positions", "restarting positions at documents needs document masking",
             "set data.document_mask: true or data.reset_positions: false")
        )
    if cfg.data.reset_positions and cfg.objective.name == "dflash":
        violations.append(
            ("data.reset_positions", "DFlash positions come from the frozen target", "remove data.reset_positions")
        )
    if cfg.objective.name == "dflash" and cfg.data.document_mask is False:
        violations.append(
            ("data.document_mask", "a DFlash context always stops at the anchor's document start",
             "remove data.document_mask (or set it to true)")
        )
    return violations


def _model_rules(cfg: RunConfig) -> list[Violation]:
    """The decoder's shape is required unless ``init_from``; a dflash run's drafter takes it from the
    target and ``objective.dflash``, so there only ``model.dtype`` may be set."""
    model = cfg.model
    if cfg.objective.name != "dflash":
        if model.init_from is not None:
            return []
        violations = [
            (f"model.{name}", "required when model.init_from is unset", f"set model.{name} or model.init_from")
            for name in SHAPE_FIELDS
            if getattr(model, name) is None
        ]
        normed = model.arch == "qwen3"  # the HF family's fixed layout, which the final export writes
        if model.qk_norm is not None and model.qk_norm != normed:
            violations.append(
                (
                    "model.qk_norm",
                    f"{str(model.qk_norm).lower()} does not fit model.arch: {model.arch}, whose Hugging Face layout "
                    f"has {'' if normed else 'no '}query/key norms (the run's final export writes that layout)",
                    f"set model.qk_norm: {str(normed).lower()}, or remove it (the arch's default)",
                )
            )
        return violations
    shaped = [name for name in (*_TARGET_FIELDS, *SHAPE_FIELDS) if getattr(model, name) is not None]
    if not shaped:  # otherwise these were filled with the arch defaults, not set
        shaped = [name for name in _DECODER_FIELDS if getattr(model, name) is not None]
    violations = []
    if shaped:
        violations.append(
            (
                "model",
                f"{', '.join(shaped)} do not apply to a dflash drafter, which is shaped by "
                "objective.dflash.target and objective.dflash",
                "remove them; for dflash only model.dtype (the exported drafter's dtype) applies"
                + ("; a drafter starts from a drafter directory with objective.dflash.init_from"
                   if "init_from" in shaped else ""),
            )
        )
    if model.arch != "qwen3":
        violations.append(
            ("model.arch", "the DFlash drafter is Qwen3-style whatever the target is", "remove model.arch")
        )
    return violations


def block_covers_sequence(objective: str, block_size: int | None, seq_len: int) -> bool:
    """Whether a block-wise objective's one block would cover the whole row (refused: no clean context
    is left to condition on, so BP has nothing to deal and the objective degenerates to mdlm's).

    Shared by the config rule below and ``csbp verify`` (:func:`csbp.engine.verify.check_case`)."""
    return objective in ("bd3", "fast_dllm_v2", "dflash") and block_size is not None and block_size >= seq_len


def _sequence_rules(cfg: RunConfig) -> list[Violation]:
    """Sequence length versus block size versus the parallel layout."""
    obj, seq_len, topo = cfg.objective, cfg.data.seq_len, cfg.topology
    block = obj.block_size
    if block_covers_sequence(obj.name, block, seq_len):
        return [
            (
                "objective.block_size",
                f"block_size={block} must be below data.seq_len={seq_len} for {obj.name}",
                "use mdlm for one block per sequence, or a smaller block_size",
            )
        ]
    if obj.name in ("bd3", "fast_dllm_v2") and block is not None:
        try:
            topo.to_topology().validate_sequence(seq_len, block)
        except ValueError as exc:
            return [("data.seq_len", str(exc), "")]
        return []
    if topo.cp > 1 and seq_len % (2 * topo.cp):
        unit = 2 * topo.cp
        return [
            (
                "data.seq_len",
                f"seq_len={seq_len} must split into 2*cp={unit} equal zigzag chunks",
                f"use a multiple of {unit}, e.g. {-(-seq_len // unit) * unit}",
            )
        ]
    return []


def _objective_layout_rules(cfg: RunConfig) -> list[Violation]:
    """Which objectives accept which parallel layouts, and objective-versus-model consistency."""
    obj, topo = cfg.objective, cfg.topology
    violations = []
    if obj.name == "mdlm" and obj.block_size != cfg.data.seq_len:
        violations.append(
            (
                "objective.block_size",
                f"mdlm is one block per sequence, got block_size={obj.block_size} != seq_len={cfg.data.seq_len}",
                "remove objective.block_size (or set it to null), or use bd3",
            )
        )
    if obj.name in SINGLE_STREAM_OBJECTIVES and (topo.bp != 1 or topo.cp != 1):
        violations.append(
            (
                "topology",
                f"{obj.name} is a single stream with no clean context to shard or blocks to own, "
                f"got cp={topo.cp}, bp={topo.bp}",
                "set cp: 1 and bp: 1 and scale with dp",
            )
        )
    if topo.window is not None and obj.name in (*SINGLE_STREAM_OBJECTIVES, "dflash"):
        # the engine's single-stream and DFlash paths have no windowed mask: the window would be
        # ignored in training (and, for mdlm, applied by the sampler: a train/sample mismatch)
        fix = ("set objective.dflash.sliding_window for the drafter's sliding layers" if obj.name == "dflash"
               else "remove topology.window, or use bd3/fast_dllm_v2 for a sliding window")
        violations.append(
            ("topology.window", f"window={topo.window} has no effect on {obj.name}, which trains full attention",
             f"{fix}; remove topology.window" if obj.name == "dflash" else fix)
        )
    if obj.name == "dflash" and obj.block_size is not None and obj.block_size < 2:
        violations.append(
            ("objective.block_size", f"block_size={obj.block_size} leaves no slot to draft after the anchor "
             "(the loss is 0 and nothing trains)", "use block_size >= 2 (the DFlash recipes use 4-16)")
        )
    if obj.name == "dflash" and obj.dflash is not None and obj.dflash.max_anchors < topo.bp:
        violations.append(
            (
                "objective.dflash.max_anchors",
                f"max_anchors={obj.dflash.max_anchors} is below bp={topo.bp}: some BP ranks would own no anchor",
                f"set max_anchors >= {topo.bp}",
            )
        )
    vocab = cfg.model.vocab_size
    if obj.mask_token_id is not None and vocab is not None and obj.mask_token_id >= vocab:
        violations.append(
            (
                "objective.mask_token_id",
                f"mask_token_id={obj.mask_token_id} is outside the vocabulary (vocab_size={vocab})",
                "use an id below model.vocab_size",
            )
        )
    return violations


def _training_rules(cfg: RunConfig) -> list[Violation]:
    """Precision, process count, schedule length and sharding."""
    violations = []
    if cfg.train.fsdp and cfg.objective.name == "dflash":
        violations.append(
            (
                "train.fsdp",
                "dflash trains a small drafter that every rank holds whole",
                "set train.fsdp: false",
            )
        )
    if cfg.optim.ema_decay is not None and cfg.objective.name == "dflash":
        violations.append(
            ("optim.ema_decay", "a DFlash drafter is exported and evaluated with its trained weights; the weight "
             "average is for the block-diffusion objectives", "remove optim.ema_decay")
        )
    dflash = cfg.objective.dflash if cfg.objective.name == "dflash" else None
    if dflash is not None and dflash.lk_loss_type == "lambda" and cfg.train.grad_accum > 1:
        # c = kl_scale exp(-kl_decay acceptance) is nonlinear in the acceptance, which is all-reduced over
        # the dp replicas but not over micro-steps: each micro-batch would take its own c
        violations.append(
            (
                "train.grad_accum",
                f"grad_accum={cfg.train.grad_accum} with objective.dflash.lk_loss_type: lambda mixes CE and TV "
                "with one acceptance per micro-batch, so accumulation would change the loss and gradient",
                "set train.grad_accum: 1 and raise train.micro_batch_size or topology.dp for the same global batch",
            )
        )
    if cfg.train.fsdp and cfg.topology.dp < 2:
        # the FSDP2 mesh shards over the dp group only (with local > 1 it replicates over the ranks of a
        # sample): with dp = 1 nothing would be sharded, only wrapped
        violations.append(
            (
                "train.fsdp",
                "FSDP shards over the data-parallel group, which has 1 rank here (topology.dp=1)",
                "set topology.dp >= 2 or train.fsdp: false",
            )
        )
    if (cfg.train.precision == "fp64") != (cfg.model.dtype == "float64"):
        violations.append(
            (
                "train.precision",
                f"precision={cfg.train.precision} does not match model.dtype={cfg.model.dtype}",
                "use precision fp64 exactly with dtype float64",
            )
        )
    nproc, world = cfg.train.nproc, cfg.world_size
    if nproc is not None and world % nproc:
        violations.append(
            (
                "train.nproc",
                f"nproc={nproc} does not divide the world size dp*max(cp, bp)={world}",
                f"remove train.nproc or use a divisor of {world}",
            )
        )
    if cfg.optim.warmup_steps > cfg.train.max_steps:
        violations.append(
            (
                "optim.warmup_steps",
                f"warmup_steps={cfg.optim.warmup_steps} exceeds train.max_steps={cfg.train.max_steps}",
                "lower warmup_steps",
            )
        )
    return violations
