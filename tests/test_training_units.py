"""Training building blocks: lr schedule, AdamW groups, gradient clipping, checkpoint bookkeeping,
metrics files, the model factory (``init_from``) and objective/launch option checks."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from csbp.config.schema import OptimSection, RunConfig
from csbp.data import open_artifact, train_bpe_tokenizer
from csbp.data.prepare import PrepareConfig, prepare_artifact
from csbp.models.config import DecoderConfig
from csbp.models.decoder import Decoder
from csbp.models.hf_io import export_hf_checkpoint
from csbp.training import launcher as launcher_module
from csbp.training.checkpoint import check_model_shapes, find_latest_checkpoint, prune_checkpoints
from csbp.training.launch_failures import is_collective_failure
from csbp.training.launcher import LaunchOptions, check_process_count
from csbp.training.lr_schedule import build_lr_scheduler, lr_multiplier
from csbp.training.metrics import MetricsWriter, plot_loss_curve, read_metrics, truncate_metrics
from csbp.training.model_factory import build_model, decoder_config_for_run
from csbp.training.optim import build_optimizer, clip_gradients, parameter_groups
from csbp.training.preflight import check_run
from test_training_run import make_artifact, tiny_config


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_artifact(tmp_path_factory.mktemp("data") / "art")


def tiny_decoder(*, tie: bool = False, vocab_size: int = 64) -> Decoder:
    config = DecoderConfig(
        vocab_size=vocab_size,
        hidden_size=16,
        intermediate_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        tie_embeddings=tie,
    )
    return Decoder(config, dtype=torch.float64, seed=3)


# ----------------------------------------------------------------------------- schedule and optimizer


def test_lr_multiplier_warmup_cosine_and_constant() -> None:
    kwargs = {"warmup_steps": 4, "max_steps": 14, "min_lr_ratio": 0.1}
    warm = [lr_multiplier(k, schedule="cosine", **kwargs) for k in range(4)]
    assert warm == [0.25, 0.5, 0.75, 1.0]
    assert lr_multiplier(4, schedule="cosine", **kwargs) == 1.0
    assert lr_multiplier(9, schedule="cosine", **kwargs) == pytest.approx(0.1 + 0.9 * 0.5, abs=1e-12)
    assert lr_multiplier(14, schedule="cosine", **kwargs) == pytest.approx(0.1, abs=1e-12)
    assert lr_multiplier(100, schedule="cosine", **kwargs) == pytest.approx(0.1, abs=1e-12)
    assert lr_multiplier(9, schedule="constant", **kwargs) == 1.0
    cosine = [lr_multiplier(k, schedule="cosine", **kwargs) for k in range(4, 15)]
    assert all(a > b for a, b in zip(cosine, cosine[1:]))


def test_scheduler_drives_the_optimizer_and_round_trips_through_json() -> None:
    model = tiny_decoder()
    optim = OptimSection(lr=1e-2, warmup_steps=2, min_lr_ratio=0.0)
    optimizer = build_optimizer(model, optim)
    scheduler = build_lr_scheduler(optimizer, optim, max_steps=6)
    seen = []
    for _ in range(4):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([5e-3, 1e-2, 1e-2, 1e-2 * 0.5 * (1 + math.cos(math.pi * 0.25))], abs=1e-15)
    state = json.loads(json.dumps(scheduler.state_dict()))
    restored = build_lr_scheduler(build_optimizer(model, optim), optim, max_steps=6)
    restored.load_state_dict(state)
    assert restored.last_epoch == 4 and restored.get_last_lr() == scheduler.get_last_lr()


@pytest.mark.parametrize("tie", [False, True])
def test_weight_decay_skips_norms_biases_and_embeddings(tie: bool) -> None:
    model = tiny_decoder(tie=tie)
    decayed, plain = parameter_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed_names = {names[id(p)] for p in decayed["params"]}
    plain_names = {names[id(p)] for p in plain["params"]}
    assert (decayed["weight_decay"], plain["weight_decay"]) == (0.1, 0.0)
    assert decayed_names.isdisjoint(plain_names) and decayed_names | plain_names == set(names.values())
    assert "embed_tokens.weight" in plain_names and "norm.weight" in plain_names
    assert "layers.0.self_attn.q_norm.weight" in plain_names
    assert (
        "layers.0.mlp.up_proj.weight" in decayed_names and "layers.0.self_attn.o_proj.weight" in decayed_names
    )
    assert ("lm_head.weight" in decayed_names) == (not tie)


def test_clip_gradients_matches_torch_and_reports_the_unclipped_norm() -> None:
    model, reference = tiny_decoder(), tiny_decoder()
    generator = torch.Generator().manual_seed(0)
    for p, q in zip(model.parameters(), reference.parameters()):
        p.grad = torch.randn(p.shape, generator=generator, dtype=p.dtype)
        q.grad = p.grad.clone()
    params = list(model.parameters())
    expected = float(torch.nn.utils.clip_grad_norm_(list(reference.parameters()), max_norm=0.5))
    norm = clip_gradients(params, 0.5)
    assert norm == pytest.approx(expected, rel=1e-12)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=0.0)
    before = [p.grad.clone() for p in params]
    assert clip_gradients(params, None) == pytest.approx(0.5, rel=1e-5)  # measure only
    assert clip_gradients(params, 10.0) == pytest.approx(0.5, rel=1e-5)  # below the limit
    assert all(torch.equal(a, p.grad) for a, p in zip(before, params))
    assert clip_gradients(params, 0.4) == pytest.approx(0.5, rel=1e-5)  # just above the limit: clipped
    assert clip_gradients(params, None) == pytest.approx(0.4, rel=1e-5)


# ----------------------------------------------------------------------------- checkpoints and metrics


def test_latest_pointer_must_name_a_complete_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    root.mkdir()
    assert find_latest_checkpoint(tmp_path) is None
    (root / "latest").write_text("../../etc\n")
    with pytest.raises(ValueError, match="is not a checkpoint name"):
        find_latest_checkpoint(tmp_path)
    (root / "latest").write_text("step_0000005\n")
    with pytest.raises(ValueError, match="missing or incomplete"):
        find_latest_checkpoint(tmp_path)
    (root / "step_0000005").mkdir()
    (root / "step_0000005" / "trainer_state.json").write_text("{}")
    assert find_latest_checkpoint(tmp_path) == root / "step_0000005"


def test_prune_keeps_the_newest_and_the_protected_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for step in (1, 2, 3, 10):
        (tmp_path / f"step_{step:07d}").mkdir()
    (tmp_path / "step_0000011.tmp").mkdir()
    (tmp_path / ".step_0000000.pruning").mkdir()  # a crash's leftover: deleted by the next prune
    deleted: list[str] = []
    rmtree = shutil.rmtree
    monkeypatch.setattr(shutil, "rmtree", lambda path, **kw: deleted.append(Path(path).name) or rmtree(path, **kw))
    prune_checkpoints(tmp_path, keep=2, protect="step_0000001")
    assert sorted(deleted) == [".step_0000000.pruning", ".step_0000002.pruning"]  # renamed first, then deleted
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step_0000001",
        "step_0000003",
        "step_0000010",
        "step_0000011.tmp",
    ]


def test_model_shape_check_names_the_first_difference(tmp_path: Path) -> None:
    current = {"a.weight": [4, 2], "b.weight": [3]}
    check_model_shapes(dict(current), current, tmp_path)
    with pytest.raises(
        ValueError, match=r"parameter 'a\.weight' has shape \[4, 3\] in the checkpoint, \[4, 2\]"
    ):
        check_model_shapes({"a.weight": [4, 3], "b.weight": [3]}, current, tmp_path)
    with pytest.raises(ValueError, match=r"parameter 'b\.weight' is missing from the checkpoint"):
        check_model_shapes({"a.weight": [4, 2]}, current, tmp_path)
    with pytest.raises(ValueError, match=r"the checkpoint has parameter 'c' that this model lacks"):
        check_model_shapes({**current, "c": [1]}, current, tmp_path)


def test_metrics_truncation_and_plot(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "loss": 5.0 - s, **({"val_loss": 4.0} if s == 2 else {})} for s in (1, 2, 3)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "lo')  # torn last line
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]
    truncate_metrics(path, after_step=2)
    assert read_metrics(path) == rows[:2]
    plot = plot_loss_curve(path, tmp_path / "loss.png")
    assert plot.read_bytes()[:4] == b"\x89PNG"


def test_a_new_run_drops_an_earlier_runs_baseline_and_a_resume_keeps_its_own(tmp_path: Path) -> None:
    """The step-0 validation record belongs to one trajectory: a fresh run (start 0) in an earlier run's
    directory must not keep that run's step 0 next to its own; a resume keeps it."""
    writer = MetricsWriter(tmp_path, enabled=True, start_step=0, total_steps=2)
    writer.log_baseline({"step": 0, "val_loss": 9.0, "elapsed_s": 0.1})
    for step in (1, 2):
        writer.log({"step": step, "loss": 1.0, "lr": 1e-3, "tokens_per_s": 10.0})
    writer.close()
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1, 2]
    MetricsWriter(tmp_path, enabled=True, start_step=1, total_steps=2).close()  # --resume from step 1
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1]
    writer = MetricsWriter(tmp_path, enabled=True, start_step=0, total_steps=2)  # a new run
    writer.log_baseline({"step": 0, "val_loss": 8.0, "elapsed_s": 0.1})
    writer.close()
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 0, "val_loss": 8.0, "elapsed_s": 0.1}]


def test_a_new_run_removes_an_earlier_runs_tensorboard_events_and_a_resume_keeps_them(tmp_path: Path) -> None:
    """TensorBoard's purge_step only hid an earlier run's event files: a fresh run left them on disk."""
    MetricsWriter(tmp_path, enabled=True, start_step=0, total_steps=2).close()
    first = set((tmp_path / "tb").iterdir())
    assert len(first) == 1
    MetricsWriter(tmp_path, enabled=True, start_step=1, total_steps=2).close()  # --resume from step 1
    resumed = set((tmp_path / "tb").iterdir())
    assert first < resumed and len(resumed) == 2
    MetricsWriter(tmp_path, enabled=True, start_step=0, total_steps=2).close()  # a new run
    fresh = set((tmp_path / "tb").iterdir())
    assert len(fresh) == 1 and not fresh & resumed


# ----------------------------------------------------------------------------- model factory, options


def test_init_from_loads_the_checkpoint_and_checks_fields(artifact: Path, tmp_path: Path) -> None:
    vocab = open_artifact(artifact).vocab_size
    source = Decoder(tiny_decoder(vocab_size=vocab).config, dtype=torch.float32, seed=11)
    export_hf_checkpoint(source, source.config, tmp_path / "hf")
    shape_free = {f"model.{k}": None for k in ("hidden_size", "intermediate_size", "num_layers", "num_heads")}
    shape_free.update(
        {"model.num_kv_heads": None, "model.head_dim": None, "model.init_from": str(tmp_path / "hf")}
    )
    cfg = tiny_config(artifact, **shape_free)
    config = decoder_config_for_run(cfg, open_artifact(artifact))
    assert config == source.config
    loaded = build_model(cfg, config, device=torch.device("cpu"))
    for (name, p), q in zip(loaded.named_parameters(), source.parameters()):
        assert torch.equal(p, q), name
    with pytest.raises(ValueError, match="model.hidden_size: the config sets 32 but the checkpoint"):
        decoder_config_for_run(
            tiny_config(artifact, **{**shape_free, "model.hidden_size": 32}), open_artifact(artifact)
        )
    flipped = not source.config.qk_norm  # a bool in YAML words: it read "sets False ... has True"
    with pytest.raises(ValueError, match=f"model.qk_norm: the config sets {str(flipped).lower()} but the checkpoint .* "
                       f"has {str(not flipped).lower()} "):
        decoder_config_for_run(
            tiny_config(artifact, **{**shape_free, "model.qk_norm": flipped}), open_artifact(artifact)
        )


def test_small_model_vocabulary_is_rejected(artifact: Path, tmp_path: Path) -> None:
    small = Decoder(tiny_decoder(vocab_size=64).config, dtype=torch.float32, seed=0)
    export_hf_checkpoint(small, small.config, tmp_path / "hf")
    cfg = tiny_config(
        artifact,
        **{f"model.{k}": None for k in ("hidden_size", "intermediate_size", "num_layers", "num_heads")},
        **{"model.num_kv_heads": None, "model.head_dim": None, "model.init_from": str(tmp_path / "hf")},
    )
    with pytest.raises(ValueError, match="embeds only 64 ids"):
        check_run(cfg)


def test_objective_options_map_onto_the_objectives(artifact: Path) -> None:
    bd3 = check_run(tiny_config(artifact, **{"objective.noise": "stratified", "objective.t_min": 0.05}))
    assert bd3.objective_options["noise_scheme"] == "stratified" and bd3.objective_options["t_min"] == 0.05
    assert bd3.mask_token_id == open_artifact(artifact).mask_token_id
    mdlm = check_run(tiny_config(artifact, **{"objective.name": "mdlm", "objective.block_size": None}))
    assert mdlm.objective_options["eps"] == 1e-3 and mdlm.build_objective().name == "mdlm"
    with pytest.raises(ValueError, match="objective.t_max: not supported here"):
        check_run(
            tiny_config(
                artifact, **{"objective.name": "mdlm", "objective.block_size": None, "objective.t_max": 0.9}
            )
        )


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"objective.name": "fast_dllm_v2", "objective.noise": "stratified"}, "noise"),
        ({"objective.name": "fast_dllm_v2", "objective.t_min": 0.3}, "t_min"),
        ({"objective.name": "fast_dllm_v2", "objective.t_max": 0.8}, "t_max"),
        ({"objective.eps": 0.2}, "eps"),  # bd3
        ({"objective.name": "mdlm", "objective.block_size": None, "objective.eps": 0.2}, "eps"),
        ({"objective.name": "ar", "objective.block_size": None, "objective.t_min": 0.3}, "t_min"),
    ],
)
def test_noise_options_an_objective_never_reads_are_refused(artifact: Path, changes: dict, field: str) -> None:
    """They used to be accepted and ignored (fast_dllm_v2 draws p = (1 - eps) t + eps, t ~ U(0, 1),
    whatever noise/t_min/t_max say; bd3 and mdlm never read eps)."""
    with pytest.raises(ValueError, match=rf"^objective\.{field}: not supported here, .* never reads it"):
        check_run(tiny_config(artifact, **changes))
    defaults = {key: value for key, value in changes.items() if not key.endswith(field)}
    check_run(tiny_config(artifact, **defaults))  # the same objective with the option left at its default


def test_launch_option_checks() -> None:
    with pytest.raises(ValueError, match="--rdzv-endpoint: required"):
        check_process_count(_world2(), 1, LaunchOptions(nnodes=2))
    # the library's launch names the fix too, as the CLI's check before the config does (one function)
    with pytest.raises(ValueError, match=r"--node-rank 2: must lie in \[0, --nnodes 2\) \(fix: number the nodes 0..1"):
        check_process_count(_world2(), 1, LaunchOptions(nnodes=2, node_rank=2, rdzv_endpoint="h:1"))
    with pytest.raises(ValueError, match=r"--nproc 1 x --nnodes 1 = 1 process,"):
        check_process_count(_world2(), 1, LaunchOptions())
    check_process_count(_world2(), 1, LaunchOptions(nnodes=2, node_rank=1, rdzv_endpoint="h:1"))


@pytest.mark.parametrize(
    ("endpoint", "said"),
    [
        ("host:99999", "host:99999: port '99999' is not a number in 1..65535 (fix: HOST:PORT of the first node"),
        ("host:0", "port '0' is not a number in 1..65535"),
        ("host:abc", "port 'abc' is not a number in 1..65535"),
        (":29500", "':29500' is not HOST:PORT (fix:"),
        ("node0", "'node0' is not HOST:PORT (fix:"),
        ("a b:1", "'a b' is not a host name or IP address"),
    ],
)
def test_a_malformed_rendezvous_endpoint_is_one_line_before_any_work(
    capsys: pytest.CaptureFixture[str], endpoint: str, said: str
) -> None:
    """``--rdzv-endpoint host:99999`` was torch's raw "must be an integer between 0 and 65536"."""
    from csbp.cli.main import main

    assert main(["train", "no-such-config.yaml", "--nnodes", "2", "--rdzv-endpoint", endpoint]) == 2
    (line,) = capsys.readouterr().err.splitlines()  # the config is not read: the flag is refused first
    assert line.startswith("csbp train: error: argument --rdzv-endpoint: ") and said in line, line


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--nproc", "0"], "csbp train: error: argument --nproc: 0 must be >= 1"),
        (["--nnodes", "-2"], "csbp train: error: argument --nnodes: -2 must be >= 1"),
        (["--node-rank", "-1"], "csbp train: error: argument --node-rank: -1 must be >= 0"),
        (["--max-steps", "0"], "csbp train: error: argument --max-steps: 0 must be >= 1"),
        (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "127.0.0.1:29500"],
         "csbp: error: --node-rank 2: must lie in [0, --nnodes 2) (fix: number the nodes 0..1"),
        (["--nnodes", "2"], "csbp: error: --rdzv-endpoint: required with --nnodes > 1 (fix:"),
    ],
)
def test_process_count_flags_are_refused_before_the_config_is_read(
    capsys: pytest.CaptureFixture[str], flags: list[str], said: str
) -> None:
    """They were refused after the config and its data were read and checked ("both must be >= 1")."""
    from csbp.cli.main import main

    assert main(["train", "no-such-config.yaml", *flags]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(said), line


def test_a_rendezvous_host_that_does_not_resolve_is_refused_in_bounded_time(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An unresolvable host hung the launch: torch's rendezvous retried the name without end."""
    import socket
    import threading

    from csbp.cli import options
    from csbp.cli.main import main

    def unknown(*args: object, **kwargs: object) -> None:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", unknown)
    assert options.rendezvous_endpoint("nowhere:29500") == "nowhere:29500"  # parsing looks nothing up
    assert main(["train", "no-such-config.yaml", "--nnodes", "2", "--rdzv-endpoint", "nowhere:29500"]) == 2
    (line,) = capsys.readouterr().err.splitlines()  # before the config is read
    assert line == ("csbp: error: --rdzv-endpoint nowhere:29500: host 'nowhere' does not resolve (Name or service not "
                    "known) (fix: check the name, or pass the first node's IP address)")
    answered = threading.Event()
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: answered.wait(30))  # a DNS server that never answers
    monkeypatch.setattr(options, "RESOLVE_TIMEOUT_S", 0.2)
    with pytest.raises(ValueError, match=r"^--rdzv-endpoint \[::1\]:29500: host '::1' did not resolve within 0.2 s"):
        options.check_endpoint_resolves("[::1]:29500")
    answered.set()


@pytest.mark.parametrize("rank", ["0", "1"])  # rank 0 takes the run directory's lock first
def test_a_torchrun_launch_of_another_world_size_is_refused_before_the_data_and_the_process_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rank: str
) -> None:
    """`torchrun --nproc-per-node 2 -m csbp train` of a 1-process topology used to meet in a process
    group first, then fail inside training with exit code 1 and another wording than `--nproc`'s."""
    for name, value in (("RANK", rank), ("LOCAL_RANK", rank), ("WORLD_SIZE", "2")):
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(launcher_module, "check_run", lambda *a, **k: pytest.fail("read the data first"))
    monkeypatch.setattr(launcher_module, "train_in_process_group", lambda *a, **k: pytest.fail("trained"))
    cfg = tiny_config(tmp_path / "no-artifact-here")  # world size 1
    with pytest.raises(ValueError) as info:
        launcher_module.launch_training(cfg, run_dir=tmp_path / "run")
    assert str(info.value) == (
        "torchrun's WORLD_SIZE = 2 processes, but the topology dp=1 cp=1 bp=1 needs dp*max(cp, bp) = 1 "
        "(fix: launch 1 process in all, or change the topology)"
    )
    assert not (tmp_path / "run").exists()


def _world2() -> RunConfig:
    """A config needing 2 processes (the process-count check reads no data)."""
    return tiny_config(Path("/nonexistent"), **{"topology.dp": 2})


def test_a_different_tokenizer_is_rejected(artifact: Path, tmp_path: Path) -> None:
    other = train_bpe_tokenizer(["completely different words", "for another tokenizer"] * 20, vocab_size=270)
    other.save(tmp_path)
    with pytest.raises(ValueError, match="data.tokenizer: .* is not the tokenizer"):
        check_run(tiny_config(artifact, **{"data.tokenizer": str(tmp_path / "tokenizer.json")}))
    same = check_run(tiny_config(artifact, **{"data.tokenizer": str(artifact / "tokenizer.json")}))
    assert same.tokenizer.source == artifact
    assert same.tokenizer.files["tokenizer.json"] == (artifact / "tokenizer.json").read_bytes()


def test_collective_failures_are_told_apart_from_other_errors() -> None:
    gloo = RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:9381")
    assert is_collective_failure(gloo)
    assert is_collective_failure(RuntimeError("Timed out waiting 300000ms for recv operation to complete"))
    assert is_collective_failure(torch.distributed.DistBackendError("NCCL communicator was aborted"))
    assert not is_collective_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_collective_failure(ValueError("gloo"))


def test_validation_rows_come_from_data_val_when_set(artifact: Path, tmp_path: Path) -> None:
    default = check_run(tiny_config(artifact))
    assert (
        default.val_split is not None
        and default.val_split.num_rows == open_artifact(artifact).split("val").num_rows
    )
    other = make_artifact(tmp_path / "other", seed=5, num_docs=20)
    with pytest.raises(ValueError, match="data.val: .* another tokenizer"):
        check_run(tiny_config(artifact, **{"data.val": str(other)}))
    with pytest.raises(ValueError, match="train.eval_every: 2 but there are no validation rows"):
        no_val = make_artifact(tmp_path / "no_val", num_docs=1, seq_len=16)  # one document: no val split
        check_run(tiny_config(no_val, **{"train.micro_batch_size": 1, "data.seq_len": 16}))
    # data.val naming data.train's own artifact (or a copy) without a val split: validation would score the
    # training rows, which it did in silence
    source = tmp_path / "all_train.jsonl"
    source.write_text((tmp_path / "other.jsonl").read_text(encoding="utf-8"), encoding="utf-8")
    all_train = tmp_path / "all_train"
    prepare_artifact(PrepareConfig(inputs=(source,), out_dir=all_train, seq_len=32, train_tokenizer=True,
                                   vocab_size=300, val_fraction=0.0))
    shutil.copytree(all_train, tmp_path / "copy")
    for val in (all_train, tmp_path / "copy"):
        notes: list[str] = []
        inputs = check_run(tiny_config(all_train, **{"data.val": str(val)}), warn=notes.append)
        assert inputs.val_split is not None and inputs.val_split.num_rows == open_artifact(all_train).split("train").num_rows
        assert [n for n in notes if "data.val" in n] == [
            f"note: data.val {val} has no val split, so validation scores its train split, which is data.train's: "
            "the validation loss is measured on the rows it trains on (fix: prepare the data with --val-fraction "
            "above 0 and drop data.val, or name held-out data)"
        ]
    notes = []
    check_run(tiny_config(artifact, **{"data.val": str(artifact)}), warn=notes.append)  # its val split: nothing said
    assert not [n for n in notes if "data.val" in n]


def test_no_progress_bar_redraws_when_stderr_is_not_a_terminal(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A batch job's log gets the step lines, not one carriage-return redraw of the bar per step."""
    writer = MetricsWriter(tmp_path, enabled=True, start_step=0, total_steps=3)
    for step in (1, 2, 3):
        writer.log({"step": step, "loss": 1.0, "lr": 1e-3, "tokens_per_s": 10.0})
    writer.message("step 3: loss 1.0000")
    writer.close()
    out, err = capsys.readouterr()
    assert "\r" not in err and "train" not in err
    assert "step 3: loss 1.0000" in out and len(read_metrics(tmp_path / "metrics.jsonl")) == 3


def test_init_from_refuses_data_tokenized_with_another_tokenizer(artifact: Path, tmp_path: Path) -> None:
    """The checkpoint's ``tokenizer.json`` must give every token the id the data's tokenizer gives it
    (the data's may add tokens after them): a pretrained model's embeddings mean its own ids."""
    from tokenizers import Tokenizer

    vocab = open_artifact(artifact).vocab_size
    source = Decoder(tiny_decoder(vocab_size=vocab).config, dtype=torch.float32, seed=11)
    export_hf_checkpoint(source, source.config, tmp_path / "hf", tokenizer_dir=artifact)
    cfg = tiny_config(
        artifact,
        **{f"model.{k}": None for k in ("hidden_size", "intermediate_size", "num_layers", "num_heads")},
        **{"model.num_kv_heads": None, "model.head_dim": None, "model.init_from": str(tmp_path / "hf")},
    )
    check_run(cfg)  # the same tokenizer
    tokenizer = Tokenizer.from_file(str(artifact / "tokenizer.json"))
    data = json.loads(tokenizer.to_str())
    vocab_map = data["model"]["vocab"]
    first, second = sorted(vocab_map, key=vocab_map.get)[-2:]
    vocab_map[first], vocab_map[second] = vocab_map[second], vocab_map[first]  # two ids swapped
    (tmp_path / "hf" / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(ValueError, match=r"model\.init_from: .*tokenizer\.json has token .* as id \d+ but the "
                       r"tokenizer of the data .* has it as id \d+ \(2 of \d+ tokens differ\) \(fix: prepare the data"):
        check_run(cfg)


def test_the_optimizer_is_fused_on_cuda_as_the_gpu_table_times_it() -> None:
    optim = OptimSection(lr=1e-2, warmup_steps=2)
    models = [tiny_decoder(), tiny_decoder()]
    default, fused = build_optimizer(models[0], optim), build_optimizer(models[1], optim, torch.device("cuda", 0))
    assert default.defaults["fused"] is None and fused.defaults["fused"] is True
    for model, optimizer in zip(models, (default, fused)):  # the fused kernel runs on the CPU too
        for param in model.parameters():
            param.grad = torch.ones_like(param)
        optimizer.step()
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)  # the same update to round-off
