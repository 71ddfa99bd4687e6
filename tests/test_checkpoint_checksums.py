"""Checkpoint checksums: bytes damaged in place (same size) are found before a checkpoint is used.

A checkpoint records the CRC32 of every file DCP wrote (``trainer_state.json`` ``checksums``). A
flipped byte in a ``.distcp`` or in ``.metadata`` makes :func:`checkpoint_problem` name the file;
``csbp train --resume`` then continues exactly as from the newest intact checkpoint, ``csbp export``
and the dflash loader refuse the damaged one with one line. A checkpoint of an older csbp (no
record) is accepted as before. Each file is read once per command (pre-flight, selection and load
share the read; the launcher hands it to its workers), and on 2 gloo ranks each rank checksums the
files it wrote.
"""

from __future__ import annotations

import json
import shutil
import zlib
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from csbp.cli.main import main
from csbp.parallel.launch import run_local
from csbp.training import launch_training, train
from csbp.training.checkpoint_integrity import checkpoint_problem
from test_training_run import config_dict, make_artifact, tiny_config, trajectory

STEP2, STEP4 = "step_0000002", "step_0000004"


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_artifact(tmp_path_factory.mktemp("data") / "art")


@pytest.fixture(scope="module")
def full_run(artifact: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 uninterrupted steps, checkpoints at steps 2 and 4."""
    run_dir = tmp_path_factory.mktemp("full") / "run"
    train(tiny_config(artifact), run_dir=run_dir)
    return run_dir


def copy_of(run_dir: Path, tmp_path: Path) -> Path:
    target = tmp_path / "run"
    shutil.copytree(run_dir, target)
    return target


def flip_middle(path: Path, count: int = 8) -> None:
    """Invert ``count`` bytes in the middle of ``path`` in place (its size stays the same)."""
    size = path.stat().st_size
    with open(path, "r+b") as handle:
        handle.seek(size // 2)
        original = handle.read(count)
        handle.seek(size // 2)
        handle.write(bytes(b ^ 0xFF for b in original))
    assert path.stat().st_size == size


def retarget_metadata(checkpoint: Path) -> None:
    """Change one character of the checkpoint id ``.metadata`` records: the same size, and it still
    unpickles to valid metadata, so only a checksum can tell."""
    path = checkpoint / ".metadata"
    data = path.read_bytes()
    assert data.count(b".tmp") == 1
    path.write_bytes(data.replace(b".tmp", b".tmq"))


def state_of(checkpoint: Path) -> dict[str, Any]:
    return json.loads((checkpoint / "trainer_state.json").read_text())


# ----------------------------------------------------------------------------- detection


def test_a_saved_checkpoint_records_the_crc_of_every_dcp_file(full_run: Path) -> None:
    checkpoint = full_run / "checkpoints" / STEP4
    record = state_of(checkpoint)["checksums"]
    names = sorted(p.name for p in checkpoint.iterdir() if p.name != "trainer_state.json")
    assert record["algorithm"] == "crc32" and sorted(record["files"]) == names == [".metadata", "__0_0.distcp"]
    for name, entry in record["files"].items():
        data = (checkpoint / name).read_bytes()
        assert entry == {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}
    assert checkpoint_problem(checkpoint) is None


def test_same_size_damage_to_a_distcp_is_named(full_run: Path, tmp_path: Path) -> None:
    checkpoint = copy_of(full_run, tmp_path) / "checkpoints" / STEP4
    flip_middle(checkpoint / "__0_0.distcp")
    problem = checkpoint_problem(checkpoint)
    assert problem is not None and problem.startswith(f"{checkpoint / '__0_0.distcp'} does not match the checksum")
    assert "\n" not in problem


def test_same_size_damage_to_the_metadata_is_named_before_it_is_unpickled(
    full_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import csbp.training.checkpoint_integrity as integrity

    checkpoint = copy_of(full_run, tmp_path) / "checkpoints" / STEP4
    retarget_metadata(checkpoint)
    monkeypatch.setattr(integrity, "read_metadata", lambda path: pytest.fail("damaged .metadata was unpickled"))
    problem = checkpoint_problem(checkpoint)
    assert problem is not None and problem.startswith(f"{checkpoint / '.metadata'} does not match the checksum")


def test_a_malformed_or_incomplete_record_is_damage(full_run: Path, tmp_path: Path) -> None:
    checkpoint = copy_of(full_run, tmp_path) / "checkpoints" / STEP4
    state = state_of(checkpoint)
    state_file = checkpoint / "trainer_state.json"
    state_file.write_text(json.dumps({**state, "checksums": {"algorithm": "crc32", "files": []}}))
    assert "'checksums' record is malformed" in (checkpoint_problem(checkpoint) or "")
    files = dict(state["checksums"]["files"])
    del files["__0_0.distcp"]
    state_file.write_text(json.dumps({**state, "checksums": {"algorithm": "crc32", "files": files}}))
    assert f"{checkpoint / '__0_0.distcp'} has no checksum" in (checkpoint_problem(checkpoint) or "")


def test_a_checkpoint_without_checksums_is_accepted_as_before(full_run: Path, tmp_path: Path) -> None:
    """Checkpoints of older csbp versions have no record: structural checks only (so in-place damage
    goes unseen there, as it did)."""
    checkpoint = copy_of(full_run, tmp_path) / "checkpoints" / STEP4
    state = state_of(checkpoint)
    state.pop("checksums", None)
    (checkpoint / "trainer_state.json").write_text(json.dumps(state))
    assert checkpoint_problem(checkpoint) is None
    flip_middle(checkpoint / "__0_0.distcp")
    assert checkpoint_problem(checkpoint) is None
    (checkpoint / "__0_0.distcp").write_bytes(b"\0" * 10)
    assert "is truncated" in (checkpoint_problem(checkpoint) or "")


# ----------------------------------------------------------------------------- what commands do with it


def test_resume_falls_back_past_a_damaged_checkpoint_and_continues_exactly(
    full_run: Path, artifact: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The audit's repro: ``csbp train --resume`` after a same-size flip in step 4's ``.distcp``
    resumed from the damaged weights. Now it continues from step 2, step for step as the uninterrupted
    run, and reads each checkpoint file once (pre-flight, selection and load share the read)."""
    import csbp.training.checkpoint_checksums as checksums

    run_dir = copy_of(full_run, tmp_path)
    damaged = run_dir / "checkpoints" / STEP4 / "__0_0.distcp"
    flip_middle(damaged)
    config = tmp_path / "tiny.yaml"
    config.write_text(json.dumps(config_dict(artifact)))
    reads: Counter[str] = Counter()
    real = checksums.file_crc32
    monkeypatch.setattr(checksums, "file_crc32", lambda path: reads.update([str(path)]) or real(path))
    capsys.readouterr()
    assert main(["train", str(config), "--run-dir", str(run_dir), "--resume"]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "damaged" in line]
    assert len(warnings) == 1, warnings
    assert f"{damaged} does not match the checksum" in warnings[0] and f"resuming from {STEP2}" in warnings[0]
    assert trajectory(run_dir) == trajectory(full_run)  # float32 CPU: exact equality
    old = {path: count for path, count in reads.items() if f"{STEP4}.tmp" not in path}
    step2, step4 = run_dir / "checkpoints" / STEP2, damaged.parent
    read_once = [step4 / ".metadata", damaged, step2 / ".metadata", step2 / "__0_0.distcp"]
    assert old == {str(path): 1 for path in read_once}
    assert checkpoint_problem(run_dir / "checkpoints" / STEP4) is None  # written again by the resumed run


def test_export_and_the_dflash_loader_refuse_a_damaged_checkpoint(
    full_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from csbp.cli.dflash_checkpoint import drafter_from_checkpoint

    run_dir = copy_of(full_run, tmp_path)
    checkpoint = run_dir / "checkpoints" / STEP4
    flip_middle(checkpoint / "__0_0.distcp")
    capsys.readouterr()
    assert main(["export", str(checkpoint), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "__0_0.distcp does not match the checksum" in err[0] and "(fix: " in err[0], err
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match=r"^--checkpoint .*__0_0\.distcp does not match the checksum"):
        drafter_from_checkpoint(checkpoint, None, None)  # type: ignore[arg-type]
    # a run directory: its newest intact checkpoint, the damaged one reported
    assert main(["export", str(run_dir), "--out", str(tmp_path / "out2")]) == 0
    captured = capsys.readouterr()
    assert f"export uses {STEP2}" in captured.err and "step 2" in captured.out


def test_the_launcher_hands_what_it_verified_to_its_workers(
    full_run: Path, artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 2-process launch checks the checkpoint in the launching process; the workers get its CRCs
    and read no checkpoint file again (simulated here: the launch itself is replaced)."""
    import torch.distributed.launcher.api as launcher_api

    import csbp.training.checkpoint_checksums as checksums

    run_dir = copy_of(full_run, tmp_path)
    shutil.rmtree(run_dir / "checkpoints" / STEP4)
    (run_dir / "checkpoints" / "latest").write_text(STEP2 + "\n")
    launched: list[tuple[Any, ...]] = []

    def fake_launch(config: Any, entry: Any) -> Any:
        return lambda *args: launched.append(args) or {0: None}

    monkeypatch.setattr(launcher_api, "elastic_launch", fake_launch)
    cfg = tiny_config(artifact, **{"topology.dp": 2, "train.micro_batch_size": 1})
    assert launch_training(cfg, run_dir=run_dir, resume=True) is None
    verified = launched[0][5]  # elastic_worker(cfg, run_dir, resume, max_steps, lock, verified, launcher_pid)
    checkpoint = run_dir / "checkpoints" / STEP2
    assert {str((checkpoint / name).resolve()) for name in (".metadata", "__0_0.distcp")} <= {key[0] for key, _ in verified}
    # a worker: a fresh process that adopts them reads nothing
    monkeypatch.setattr(checksums, "_crc_cache", {})
    monkeypatch.setattr(checksums, "file_crc32", lambda path: pytest.fail(f"{path} read again"))
    checksums.remember_verified(verified)
    assert checkpoint_problem(checkpoint) is None


# ----------------------------------------------------------------------------- two ranks


def _save_on_two_ranks(rank: int, world: int, root: Path) -> list[str]:
    """Save a small replicated model's checkpoint from 2 gloo ranks; return the files this rank read."""
    import csbp.training.checkpoint_checksums as checksums
    from csbp.training.checkpoint import TrainingState, save_checkpoint

    read: list[str] = []
    real = checksums.file_crc32
    checksums.file_crc32 = lambda path: read.append(Path(path).name) or real(path)  # type: ignore[assignment]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 16)).sum().backward()
    optimizer.step()
    state = TrainingState(
        step=1, scheduler={}, loader={}, rng={}, data_fingerprint="", param_shapes={}, topology={}, config_yaml=""
    )
    save_checkpoint(root, model=model, optimizer=optimizer, state=state, keep=1)
    dist.barrier()
    return read


def test_two_ranks_each_checksum_their_own_files(tmp_path: Path) -> None:
    read = run_local(_save_on_two_ranks, 2, (tmp_path,), timeout_s=120)
    checkpoint = tmp_path / "checkpoints" / "step_0000001"
    files = state_of(checkpoint)["checksums"]["files"]
    data_files = sorted(p.name for p in checkpoint.glob("*.distcp"))
    assert sorted(files) == [".metadata", *data_files]
    assert any(name.startswith("__0_") for name in data_files) and any(name.startswith("__1_") for name in data_files)
    assert sorted(read[0]) == [".metadata", *(n for n in data_files if n.startswith("__0_"))]
    assert sorted(read[1]) == [n for n in data_files if n.startswith("__1_")]
    for name, entry in files.items():
        assert entry["crc32"] == f"{zlib.crc32((checkpoint / name).read_bytes()):08x}", name
    assert checkpoint_problem(checkpoint) is None
    flip_middle(checkpoint / data_files[-1])
    assert f"{data_files[-1]} does not match the checksum" in (checkpoint_problem(checkpoint) or "")


# ----------------------------------------------------------------------------- the record's rules, unit by unit


def test_a_file_longer_than_one_chunk_has_its_whole_crc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CRC is chained over the 16 MiB chunks; checkpoints in the tests are far smaller, so a CRC of the
    last chunk alone survived the mutation audit (record and check agreed, both wrong)."""
    from csbp.training import checkpoint_checksums

    monkeypatch.setattr(checkpoint_checksums, "CHUNK_BYTES", 7)
    path = tmp_path / "__0_0.distcp"
    path.write_bytes(bytes(range(256)) * 3)
    assert checkpoint_checksums.file_crc32(path) == zlib.crc32(path.read_bytes())


def test_rank_files_claims_only_that_ranks_files() -> None:
    """Rank 1 must not claim rank 10's ``__10_0.distcp`` (a prefix ``__1`` without its ``_`` did)."""
    from csbp.training.checkpoint_checksums import rank_files

    names = ["__0_0.distcp", "__1_0.distcp", "__1_1.distcp", "__10_0.distcp", "__11_0.distcp", ".metadata"]
    assert rank_files(names, 1) == ["__1_0.distcp", "__1_1.distcp"]
    assert rank_files(names, 0) == [".metadata", "__0_0.distcp"]


def test_rank_0_records_the_dcp_files_no_rank_claimed(tmp_path: Path) -> None:
    """The safety net should DCP's naming change: a ``.distcp`` in the directory that no rank wrote as its
    own is checksummed by rank 0 too, so it is verified on resume (dropping it survived the audit)."""
    from csbp.training.checkpoint_checksums import record_checksums

    for name, data in {".metadata": b"m", "__0_0.distcp": b"a", "__7_0.distcp": b"bb", "notes.txt": b"x"}.items():
        (tmp_path / name).write_bytes(data)
    record = record_checksums(tmp_path, ["__0_0.distcp"])
    assert record["algorithm"] == "crc32"
    assert record["files"] == {
        name: {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}
        for name, data in {".metadata": b"m", "__0_0.distcp": b"a", "__7_0.distcp": b"bb"}.items()
    }


GOOD_ENTRY = {"size": 1, "crc32": "0000abcd"}


@pytest.mark.parametrize(
    "record",
    [
        {"algorithm": "md5", "files": {".metadata": GOOD_ENTRY}},
        {"files": {".metadata": GOOD_ENTRY}},
        {"algorithm": "crc32", "files": {"__0_0.distcp": GOOD_ENTRY}},  # no .metadata
        {"algorithm": "crc32", "files": {".metadata": GOOD_ENTRY, "../__0_0.distcp": GOOD_ENTRY}},
        {"algorithm": "crc32", "files": {".metadata": GOOD_ENTRY, "sub/__0_0.distcp": GOOD_ENTRY}},
        {"algorithm": "crc32", "files": {".metadata": GOOD_ENTRY, "trainer_state.json": GOOD_ENTRY}},
        {"algorithm": "crc32", "files": {".metadata": {"size": -1, "crc32": "0000abcd"}}},
        {"algorithm": "crc32", "files": {".metadata": {"size": 1, "crc32": "xyz"}}},
        {"algorithm": "crc32", "files": {".metadata": {"size": 1, "crc32": "0000ABCD"}}},
        {"algorithm": "crc32", "files": {".metadata": {"size": 1, "crc32": "abcd"}}},
    ],
)
def test_each_malformed_record_is_named_as_damage(record: dict[str, Any], tmp_path: Path) -> None:
    """Every rule of ``parse_record`` on its own (mutation audit: dropping the algorithm check, the
    required ``.metadata``, the plain-name and DCP-name rules, the size sign or the 8-hex-digit CRC
    form each survived, since the one malformed-record test broke only the ``files`` mapping)."""
    from csbp.training.checkpoint_checksums import checksum_problem, parse_record

    source = tmp_path / "trainer_state.json"
    assert parse_record({"algorithm": "crc32", "files": {".metadata": GOOD_ENTRY}}, source) == {".metadata": (1, 0xABCD)}
    expected = f"{source}: its 'checksums' record is malformed; the checkpoint is damaged"
    assert parse_record(record, source) == expected
    assert checksum_problem(tmp_path, record, source) == expected


def test_a_grown_file_is_named_as_grown_before_any_read(tmp_path: Path) -> None:
    """Sizes are compared first, both ways (mutation audit: comparing only for a shorter file, or calling
    every size change truncation, survived: the CRC then caught a grown file with another reason)."""
    from csbp.training.checkpoint_checksums import checksum_entries, checksum_problem

    (tmp_path / ".metadata").write_bytes(b"meta")
    record = {"algorithm": "crc32", "files": checksum_entries(tmp_path, [".metadata"])}
    source = tmp_path / "trainer_state.json"
    assert checksum_problem(tmp_path, record, source) is None
    (tmp_path / ".metadata").write_bytes(b"metadata")
    assert checksum_problem(tmp_path, record, source) == f"{tmp_path / '.metadata'} has grown (8 bytes, 4 when it was saved)"
    (tmp_path / ".metadata").write_bytes(b"me")
    assert checksum_problem(tmp_path, record, source) == f"{tmp_path / '.metadata'} is truncated (2 bytes, 4 when it was saved)"
