"""What is trained: the model's shape and the objective, from a preset or a Hugging Face
``config.json`` (a csbp run config is read in ``csbp.plan.run_config_workload``).

Presets are the workload keys of the published CSBP runs (``nemotron-3b``, ``nemotron-8b``,
``nemotron-14b``, ``dflash2-qwen3.8``, ``dflash2-muse``), packaged in
``csbp/plan/data/published-csbp-runs.json``. Every reader fails closed with one line naming the
file and the missing field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from functools import cache
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from csbp.plan.artifact_documents import DocumentSample
    from csbp.plan.documents import RowDocuments
    from csbp.plan.target_pass import TargetPass

OBJECTIVES = ("bd3", "fast_dllm_v2", "mdlm", "dflash")
UNWINDOWED_OBJECTIVES = ("mdlm",)
"""Planned objectives that train full attention only, as `csbp train` refuses topology.window for them
(single-stream; ``ar`` is not planned)."""


@dataclass(frozen=True)
class LayerGroup:
    """``count`` consecutive decoder layers of one attention kind (``window`` 0: full attention)."""

    count: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    window: int = 0


@dataclass(frozen=True)
class ModelShape:
    """Decoder shape. ``extra_params*`` count parameters outside attention/MLP/embeddings (drafter
    fusion, selector, ...)."""

    name: str
    d_model: int
    vocab: int
    ffn: int
    groups: tuple[LayerGroup, ...]
    tied_embeddings: bool = False
    extra_params_per_layer: float = 0.0
    extra_params: float = 0.0

    @property
    def num_layers(self) -> int:
        return sum(g.count for g in self.groups)

    def layer_params(self, group: LayerGroup) -> float:
        """Parameters of one layer: q/k/v/o projections, SwiGLU MLP, two norms, extras."""
        attn = self.d_model * (group.n_heads + 2 * group.n_kv_heads) * group.head_dim
        attn += group.n_heads * group.head_dim * self.d_model
        return attn + 3 * self.d_model * self.ffn + 2 * self.d_model + self.extra_params_per_layer

    @property
    def body_params(self) -> float:
        """Parameters of all layers (what runs once per row)."""
        return sum(g.count * self.layer_params(g) for g in self.groups)

    @property
    def embedding_params(self) -> float:
        return self.vocab * self.d_model * (1 if self.tied_embeddings else 2)

    @property
    def total_params(self) -> float:
        return self.body_params + self.embedding_params + self.extra_params

    @property
    def max_layer_params(self) -> float:
        return max(self.layer_params(g) for g in self.groups)


@dataclass(frozen=True)
class Objective:
    """The training objective's shape.

    Attributes:
        name: ``bd3``, ``fast_dllm_v2``, ``mdlm`` or ``dflash``.
        block: block size ``B``.
        views: corrupted views per sample (Fast-dLLM v2 trains two complementary views).
        kv_grad_bytes: bytes per element of the dK/dV reduce-scatter.
        anchors / feature_width / window / selector_rank: DFlash drafter terms (anchors per
            sample, width of the target features, sliding window, selector rank).
        context_rows: which target-feature rows a drafter rank projects: ``"all"`` it holds (what
            csbp's ``DFlashStep`` does) or only the ``"windows"`` its anchors see (the reference
            implementation of the published runs, whose throughput does not grow with ``L``).
    """

    name: str
    block: int
    views: int = 1
    kv_grad_bytes: int = 2
    anchors: int = 0
    feature_width: int = 0
    window: int = 0
    selector_rank: int = 0
    context_rows: str = "all"

    @property
    def is_drafter(self) -> bool:
        return self.name == "dflash"

    @property
    def single_stream(self) -> bool:
        """MDLM (and AR) run one stream of ``L`` rows: csbp trains them data-parallel only."""
        return self.name in ("mdlm", "ar")


@dataclass(frozen=True)
class Workload:
    """Model, objective and element sizes of one training run: ``dtype_bytes`` of the computed
    activations and K/V (2: bf16, 4: fp32), ``state_bytes`` of the trained parameters, their
    gradients and AdamW moments under FSDP2/DDP (csbp keeps float32 master weights, float64 under
    ``train.precision: fp64``: bf16 autocasts the compute only; ZeRO-2 is the published recipe's
    bf16 weights and 16 B/param sharded states, not this). ``doc_length``:
    rows pack documents of that mean length under the document mask (``csbp.plan.documents``;
    None: one document per row), or real rows: one (``RowDocuments``) or an artifact's sample
    (``DocumentSample``, ``csbp plan --data``; ``predict`` averages over its rows). ``target_pass``:
    a drafter's online target pass (``csbp.plan.target_pass``; None: offline features). ``averaged``: a
    weight average (``optim.ema_decay``) is held, one more ``state_bytes`` per parameter."""

    model: ModelShape
    objective: Objective
    dtype_bytes: int = 2
    notes: tuple[str, ...] = field(default_factory=tuple)
    state_bytes: int = 4
    doc_length: int | RowDocuments | DocumentSample | None = None
    target_pass: TargetPass | None = None
    averaged: bool = False

    def with_target_pass(self, mode: str | None, target_config: Path | None = None) -> Workload:
        """A copy with ``csbp plan --target-pass MODE [--target-config PATH]``: ``offline`` drops the
        pass; ``sharded``/``replicated`` price it with the target of ``target_config`` (a HF
        ``config.json``, every layer run) or the run config's own target."""
        from csbp.plan.target_pass import TARGET_PASSES, TargetPass

        if mode is None and target_config is None:
            return self
        if not self.objective.is_drafter:
            raise ValueError("--target-pass and --target-config need a DFlash drafter workload")
        if mode is not None and mode not in TARGET_PASSES:
            raise ValueError(f"--target-pass {mode!r} must be one of {', '.join(TARGET_PASSES)}")
        current = self.target_pass
        if target_config is not None:
            target = hf_workload(target_config, source="--target-config").model
            current = TargetPass(current.mode if current else "offline", target, target.num_layers)
        mode = mode or (current.mode if current else "offline")
        if mode == "offline":
            return replace(self, target_pass=None if current is None else replace(current, mode=mode))
        if current is None:
            raise ValueError(
                f"--target-pass {mode} needs the target's shape: add --target-config PATH (its HF config.json), "
                "or plan a run config, whose objective.dflash.target names it"
            )
        return replace(self, target_pass=replace(current, mode=mode))

    def with_options(
        self,
        *,
        objective: str | None = None,
        block_size: int | None = None,
        window: int | None = None,
        anchors: int | None = None,
        drafter_context: str | None = None,
        doc_length: int | None = None,
    ) -> Workload:
        """A copy with the CLI's ``--objective/--block-size/--window/--anchors/--drafter-context/
        --doc-length``."""
        obj, model, docs = self.objective, self.model, self.doc_length
        if drafter_context is not None:
            if not obj.is_drafter or drafter_context not in ("all", "windows"):
                raise ValueError("--drafter-context all|windows needs a DFlash drafter workload")
            obj = replace(obj, context_rows=drafter_context)
        if objective is not None:
            if objective not in OBJECTIVES:
                raise ValueError(f"--objective {objective!r} is not one of {', '.join(OBJECTIVES)}")
            if (objective == "dflash") != obj.is_drafter:
                raise ValueError(
                    f"--objective {objective} does not fit the model {model.name} "
                    f"({'a DFlash drafter' if obj.is_drafter else 'a decoder'}): drop --objective"
                )
            obj = replace(obj, name=objective, views=2 if objective == "fast_dllm_v2" else 1)
        if block_size is not None:
            if block_size < 1:
                raise ValueError(f"--block-size must be >= 1, got {block_size}")
            obj = replace(obj, block=block_size)
        if anchors is not None:
            if not obj.is_drafter or anchors < 1:
                raise ValueError("--anchors needs a DFlash drafter workload and a value >= 1")
            obj = replace(obj, anchors=anchors)
        if window is not None:
            if window < 1:
                raise ValueError(f"--window must be >= 1, got {window}")
            if obj.name in UNWINDOWED_OBJECTIVES:  # as csbp train refuses topology.window for them
                raise ValueError(
                    f"--window {window}: {obj.name} trains full attention (csbp train refuses topology.window "
                    "for it) (fix: drop --window, or plan --objective bd3 or fast_dllm_v2)"
                )
            model = replace(model, groups=tuple(replace(g, window=window) for g in model.groups))
            if obj.is_drafter:
                obj = replace(obj, window=window)
        if doc_length is not None:
            least = 2 if obj.is_drafter else 1  # a drafter's anchor and its next token share a document
            if doc_length < least:
                raise ValueError(
                    f"--doc-length must be >= {least} (mean tokens per packed document"
                    + ("; a DFlash anchor and its next token share a document" if least == 2 else "")
                    + f"), got {doc_length}"
                )
            docs = doc_length
        return replace(self, model=model, objective=obj, doc_length=docs)


# ----------------------------------------------------------------------------- readers


@cache
def published_runs() -> dict[str, Any]:
    """The packaged published-runs file (workloads, hardware and points)."""
    text = resources.files("csbp.plan").joinpath("data/published-csbp-runs.json").read_text()
    return json.loads(text)


def preset_names() -> tuple[str, ...]:
    return tuple(published_runs()["workloads"])


def preset_workload(name: str) -> Workload:
    """The published workload ``name`` (bf16)."""
    workloads = published_runs()["workloads"]
    if name not in workloads:
        raise ValueError(f"unknown model preset {name!r}: choose from {', '.join(workloads)}")
    spec = workloads[name]
    m, o = spec["model"], spec["objective"]
    groups = tuple(
        LayerGroup(g["count"], g["n_heads"], g["n_kv_heads"], g["head_dim"], g.get("window", 0) or 0)
        for g in m["groups"]
    )
    model = ModelShape(
        name=m["name"],
        d_model=m["d_model"],
        vocab=m["vocab"],
        ffn=m["ffn"],
        groups=groups,
        tied_embeddings=bool(m["tied_embeddings"]),
        extra_params_per_layer=float(m.get("extra_params_per_layer", 0.0)),
        extra_params=float(m.get("extra_params", 0.0)),
    )
    if spec["family"] == "drafter":
        objective = Objective(
            "dflash",
            block=o["block"],
            anchors=o["anchors"],
            feature_width=o["feature_width"],
            window=o["window"],
            selector_rank=o.get("selector_rank", 0),
            context_rows="windows",
        )
    else:
        objective = Objective(
            "bd3" if o["name"] == "bd3" else o["name"],
            block=o["block"],
            views=o.get("views", 1),
            kv_grad_bytes=o.get("kv_grad_bytes", 2),
        )
    return Workload(model, objective, 2)


def hf_workload(
    path: Path, *, objective: str | None = None, block_size: int | None = None, source: str = "--model"
) -> Workload:
    """A decoder from a Hugging Face ``config.json`` (or a folder holding one), bf16. ``source``
    names where the path came from (a flag or a config field) in the error when it holds none. The
    objective, block size and attention window default to those a csbp export records (``csbp_training``;
    a Fast-dLLM v2 release: ``fast_dllm_v2`` at its ``bd_size``), else bd3, 32 and the config's own."""
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        fix = "train the target first, or point it at a folder holding one" if source == "objective.dflash.target" else (
            "a config.json or a folder holding one"
        )
        raise FileNotFoundError(f"{source} {path}: no Hugging Face config.json here (fix: {fix})")
    cfg = _json_object(file)
    if cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts"):
        raise ValueError(f"{file}: mixture-of-experts models are not in the cost model (dense decoders only)")

    def size(key: str, default: int | None = None) -> int:
        """``cfg[key]``, a positive JSON integer (``default`` when absent or null)."""
        value = cfg.get(key)
        if value is None and default is not None:
            return default
        if value is None:
            raise ValueError(f"{file}: missing field {key!r} (a decoder config.json has it)")
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{file}: {key} must be a positive integer, got {value!r} (fix: the model's {key})")
        return value

    d, heads = size("hidden_size"), size("num_attention_heads")
    # the importer's family rule: architectures names it, and a model_type must agree (or be absent)
    model_type = cfg.get("model_type")
    mistral = model_type == "mistral" or (model_type is None and cfg.get("architectures") == ["MistralForCausalLM"])
    kv_heads = size("num_key_value_heads", MISTRAL_DEFAULT_KV_HEADS if mistral else heads)
    if heads % kv_heads:
        raise ValueError(
            f"{file}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads} (fix: a "
            "num_key_value_heads that divides it: each K/V head serves a whole group of query heads)"
        )
    layers, head_dim = size("num_hidden_layers"), size("head_dim", max(d // heads, 1))
    if mistral:  # every layer slides (absent: MistralConfig's 4096), none with sliding_window: null
        null = "sliding_window" in cfg and cfg["sliding_window"] is None
        window = 0 if null else size("sliding_window", MISTRAL_DEFAULT_SLIDING_WINDOW)
        sliding_layers = layers if window else 0
    else:
        sliding_layers = _sliding_layer_count(cfg, layers, file)
        window = size("sliding_window", 4096) if sliding_layers else 0  # transformers' Qwen default when absent
    groups = tuple(
        LayerGroup(count, heads, kv_heads, head_dim, layer_window)
        for count, layer_window in ((layers - sliding_layers, 0), (sliding_layers, window))
        if count
    )
    model = ModelShape(
        name=str(cfg.get("_name_or_path") or cfg.get("model_type") or file.parent.name),
        d_model=d,
        vocab=size("vocab_size"),
        ffn=size("intermediate_size"),
        groups=groups,
        tied_embeddings=_flag(cfg, "tie_word_embeddings", file),
    )
    trained = cfg.get("csbp_training")
    if trained is None and cfg.get("model_type") == "Fast_dLLM_Qwen":  # a Fast-dLLM v2 release (models.hf_release)
        bd_size = cfg.get("bd_size")
        if type(bd_size) is not int or bd_size < 1:  # refused as generate and eval refuse it (hf_release is not
            raise ValueError(  # imported: csbp.models imports torch, which the planner does not need)
                f"{file} bd_size is {bd_size!r}: a Fast-dLLM v2 release's bd_size is the block size it was trained "
                "with, a positive integer (fix: set bd_size to that block size, 32 for NVlabs' releases)"
            )
        trained = {"objective": {"name": "fast_dllm_v2", "block_size": bd_size}}
    recorded = trained.get("objective") if isinstance(trained, dict) else None
    recorded = recorded if isinstance(recorded, dict) else {}
    if objective is None:
        objective = recorded.get("name") if recorded.get("name") in ("bd3", "mdlm", "fast_dllm_v2") else "bd3"
    if block_size is None:
        trained_block = recorded.get("block_size") if recorded.get("name") == objective else None
        block_size = trained_block if type(trained_block) is int and trained_block > 0 else 32
    topology = trained.get("topology") if isinstance(trained, dict) else None
    trained_window = topology.get("window") if isinstance(topology, dict) else None
    if type(trained_window) is int and trained_window > 0 and not window:  # csbp's windowed training
        model = replace(model, groups=tuple(replace(g, window=trained_window) for g in model.groups))
    views = 2 if objective == "fast_dllm_v2" else 1
    # bf16 compute; csbp reduces dK/dV in the float32 accumulation dtype (attention.merge)
    return Workload(model, Objective(objective, block=block_size, views=views, kv_grad_bytes=4))


QWEN_DEFAULT_MAX_WINDOW_LAYERS = 28
"""transformers' Qwen2/Qwen3 default: the first 28 layers attend fully (``csbp.models.hf_families`` keeps the
same; not imported here, the planner needs no torch)."""
MISTRAL_DEFAULT_KV_HEADS, MISTRAL_DEFAULT_SLIDING_WINDOW = 8, 4096
"""transformers' ``MistralConfig`` values of an absent ``num_key_value_heads`` and ``sliding_window`` (the
importer's ``csbp.models.hf_families`` has the same; repeated here, as the planner needs no torch)."""


def _sliding_layer_count(cfg: dict[str, Any], layers: int, file: Path) -> int:
    """How many of ``layers`` slide, as transformers' Qwen2/Qwen3 configs say (and csbp's importer reads
    them, ``csbp.models.hf_families.qwen_layer_types``): ``layer_types`` when given; else, under
    ``use_sliding_window``, layers ``i >= max_window_layers`` (absent: 28): not every layer."""
    given = cfg.get("layer_types")
    if given is not None:
        kinds = ("full_attention", "sliding_attention")
        if not isinstance(given, list) or len(given) != layers or any(kind not in kinds for kind in given):
            raise ValueError(f"{file}: layer_types must list num_hidden_layers={layers} entries of {list(kinds)}")
        return given.count("sliding_attention")
    if not _flag(cfg, "use_sliding_window", file):
        return 0
    first = cfg.get("max_window_layers", QWEN_DEFAULT_MAX_WINDOW_LAYERS)
    if isinstance(first, bool) or not isinstance(first, int) or first < 0:
        raise ValueError(f"{file}: max_window_layers must be an integer >= 0, got {first!r}")
    return max(0, layers - first)


def _json_object(file: Path) -> dict[str, Any]:
    """``file`` parsed as a JSON object, else one line naming it."""
    try:
        payload = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{file}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(payload, dict):
        raise ValueError(f"{file}: a Hugging Face config.json is a JSON object, got {type(payload).__name__}")
    return payload


def _flag(cfg: dict[str, Any], key: str, file: Path) -> bool:
    """``cfg[key]``, true or false (absent or null: false); ``"false"`` is refused, never read as true."""
    value = cfg.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ValueError(f"{file}: {key} must be true or false, got {value!r}")
    return value
