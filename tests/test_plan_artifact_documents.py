"""``csbp plan --data ARTIFACT`` and ``topology: auto`` with ``data.document_mask``: the planner costs
an artifact's real document rows (host only, tiny hand-written artifacts): counts equal the same
explicit boundaries passed the existing way, the printed/JSON summary, rows built across the
artifact's row boundaries, auto planning with the documents, and the fail-closed cases."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from csbp.attention.counts import halo_rows, rank_pairs
from csbp.attention.documents import Documents
from csbp.cli.main import USER_ERROR_EXIT_CODE, main
from csbp.data.artifact import ARRAY_DTYPES, FORMAT_NAME, FORMAT_VERSION, array_file_name
from csbp.plan import auto
from csbp.plan.artifact_documents import DocumentSample, artifact_documents, default_rows
from csbp.plan.calibration import packaged_calibration
from csbp.plan.documents import document_halo_rows
from csbp.plan.hardware import hardware
from csbp.plan.layout import Layout
from csbp.plan.model import predict, rank_counts
from csbp.plan.workload import preset_workload
from csbp.recipes import load_run_config

SEQ_LEN, BLOCK = 64, 4
# Document lengths of the stream, a long one among short ones (it crosses rows 1 -> 2).
LENGTHS = [5, 9, 3, 40, 7, 90, 2, 11, 30, 4, 20, 35]  # 256 tokens = 4 rows of 64


def write_artifact(directory: Path, lengths: list[int] = LENGTHS, *, seq_len: int = SEQ_LEN, pad: int = 0) -> Path:
    """A minimal artifact whose train split's stream packs documents of ``lengths`` (then ``pad`` pads)."""
    ids = np.concatenate([np.full(n, i, dtype=np.int32) for i, n in enumerate(lengths)] + [np.full(pad, -1, np.int32)])
    assert ids.size % seq_len == 0
    splits = {"train": ids.reshape(-1, seq_len), "val": np.zeros((0, seq_len), np.int32)}
    directory.mkdir(parents=True)
    for split, doc_ids in splits.items():
        for field, dtype in ARRAY_DTYPES.items():
            values = doc_ids if field == "doc_ids" else np.zeros(doc_ids.shape)
            (directory / array_file_name(split, field)).write_bytes(values.astype(dtype).tobytes())
    manifest = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "seq_len": seq_len,
        "special_ids": {"mask": 1, "eos": 2, "pad": 0},
        "content_fingerprint": "0" * 64,
        "tokenizer": {"fingerprint": "0" * 64, "vocab_size": 32, "special_names": {}},
        "splits": {name: {"rows": int(rows.shape[0])} for name, rows in splits.items()},
    }
    (directory / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
    (directory / "tokenizer.json").write_text("{}", encoding="utf-8")
    return directory


def explicit_bounds(lengths: list[int]) -> tuple[np.ndarray, np.ndarray]:
    docs = Documents.from_lengths(lengths)
    return docs.start.numpy(), docs.stop.numpy()


def row_lengths(offset: int, seq_len: int) -> list[int]:
    """The document pieces of stream tokens ``[offset, offset + seq_len)`` of ``LENGTHS``."""
    edges = np.cumsum([0, *LENGTHS])
    lo, hi = offset, offset + seq_len
    return [int(min(b, hi) - max(a, lo)) for a, b in zip(edges[:-1], edges[1:], strict=True) if b > lo and a < hi]


def test_artifact_rows_are_the_stream_windows_and_their_counts_the_explicit_ones(tmp_path: Path) -> None:
    sample = artifact_documents(write_artifact(tmp_path / "art"), SEQ_LEN)
    assert sample.windows == 4 and len(sample.rows) == 4  # every row when fewer than the sample size
    for index, row in enumerate(sample.rows):
        lengths = row_lengths(index * SEQ_LEN, SEQ_LEN)
        bounds = explicit_bounds(lengths)
        for cp, bp in [(2, 1), (1, 4), (2, 4), (4, 4)]:
            counts = rank_counts(SEQ_LEN, BLOCK, cp, bp, "dual_end", 0, row)
            for rank, c in enumerate(counts):
                assert c.pairs == sum(rank_pairs(SEQ_LEN, BLOCK, cp, bp, rank, documents=bounds))
            halo = max(
                halo_rows(SEQ_LEN, BLOCK, cp, bp, r, schedule="dual_end", documents=bounds) for r in range(max(cp, bp))
            )
            assert document_halo_rows(SEQ_LEN, BLOCK, cp, bp, "dual_end", 0, row) == halo
    # the summary counts the pieces the rows' masks see: the 90-token document is cut once
    pieces = [n for i in range(4) for n in row_lengths(i * SEQ_LEN, SEQ_LEN)]
    s = sample.summary()
    assert s["count"] == len(pieces) and s["max"] == max(pieces) and s["mean"] == pytest.approx(np.mean(pieces))
    assert s["p50"] == pytest.approx(np.percentile(pieces, 50)) and s["p90"] == pytest.approx(np.percentile(pieces, 90))


def test_a_longer_plan_concatenates_rows_and_the_sample_is_spread(tmp_path: Path) -> None:
    directory = write_artifact(tmp_path / "art", pad=64)  # a fifth, all-pad row is never planned
    long = artifact_documents(directory, 2 * SEQ_LEN)
    assert long.windows == 3  # windows start at rows 0, 1, 2 and end before the pad
    assert [len(r.starts) for r in long.rows] == [len(row_lengths(i * SEQ_LEN, 2 * SEQ_LEN)) for i in range(3)]
    assert np.diff(np.append(long.rows[1].starts, 128)).max() == 90  # whole again across the row boundary
    two = artifact_documents(directory, SEQ_LEN, rows=2)
    assert [r.starts for r in two.rows] == [
        tuple(np.cumsum([0, *row_lengths(i * SEQ_LEN, SEQ_LEN)])[:-1]) for i in (0, 3)
    ]  # first and last row
    assert [default_rows(n) for n in (64, 1 << 18, 1 << 20, 1 << 23)] == [16, 16, 4, 1]  # within 4M tokens


def test_plan_data_prints_and_records_the_documents_and_averages_the_rows(tmp_path: Path, capsys) -> None:
    directory = write_artifact(tmp_path / "art")
    out_json = tmp_path / "plan.json"
    argv = ["plan", "--model", "nemotron-3b", "--block-size", "4", "--gpus", "8", "--gpu", "h200", "--data", str(directory)]
    assert main([*argv, "--json", str(out_json), "--top", "40"]) == 0
    out = capsys.readouterr().out
    sample = artifact_documents(directory, SEQ_LEN)
    assert f"at L={SEQ_LEN}" in out and sample.describe() in out
    assert "cp-aware" in out or " halo " in out
    record = json.loads(out_json.read_text(encoding="utf-8"))
    assert record["doc_length"] is None and record["documents"] == json.loads(json.dumps(sample.summary()))
    assert any(p["schedule"] == "balanced" for p in record["feasible"])
    # a layout's prediction is the mean of its rows' predictions
    workload, hw, cal = preset_workload("nemotron-3b").with_options(block_size=BLOCK), hardware("h200", gpus=8), packaged_calibration("h200")
    lay = Layout(2, 2, 4)
    rows = [predict(replace(workload, doc_length=r), lay, SEQ_LEN, hw, cal) for r in sample.rows]
    mean = predict(replace(workload, doc_length=sample), lay, SEQ_LEN, hw, cal)
    assert mean.step_s == pytest.approx(np.mean([p.step_s for p in rows]))
    assert mean.mem_bytes == max(p.mem_bytes for p in rows)


def test_plan_data_fails_closed(tmp_path: Path, capsys) -> None:
    directory = write_artifact(tmp_path / "art")
    base = ["plan", "--model", "nemotron-3b", "--gpus", "8", "--gpu", "h200"]
    cases = [
        (["--data", str(directory), "--doc-length", "64"], "--data and --doc-length"),
        (["--data", str(tmp_path / "missing")], "is not a csbp data artifact"),
        (["--seq-len", "64", "--data-rows", "4"], "add --data"),
        (["--data", str(directory), "--seq-len", "1K"], "fewer than the planned"),
        (["--data", str(directory), "--split", "val"], "split val has no rows"),
    ]
    (tmp_path / "nodocs").mkdir()
    for item in directory.iterdir():
        if item.name != "train.doc_ids.bin":
            (tmp_path / "nodocs" / item.name).write_bytes(item.read_bytes())
    cases.append((["--data", str(tmp_path / "nodocs")], "missing train.doc_ids.bin"))
    for extra, message in cases:
        code = main([*base, *extra])
        err = capsys.readouterr().err
        assert code == USER_ERROR_EXIT_CODE and message in err and len(err.strip().splitlines()) == 1, (extra, err)


def _run_config(tmp_path: Path, directory: Path, document_mask: bool, topology: object = "auto") -> Path:
    config = {
        "run": {"name": "auto", "seed": 0},
        "model": {"arch": "qwen3", "hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "num_heads": 4,
                  "num_kv_heads": 2, "head_dim": 8, "vocab_size": 32},
        "data": {"train": str(directory), "seq_len": SEQ_LEN, "document_mask": document_mask},
        "objective": {"name": "bd3", "block_size": BLOCK},
        "optim": {"lr": 1e-3},
        "train": {"max_steps": 1, "micro_batch_size": 1},
        "topology": topology,
    }
    path = tmp_path / f"run-{document_mask}.yaml"
    path.write_text(json.dumps(config), encoding="utf-8")
    return path


def test_topology_auto_plans_with_the_artifact_documents(tmp_path: Path, capsys, monkeypatch) -> None:
    directory = write_artifact(tmp_path / "art")
    seen = []
    real_rank = auto.rank

    def spy(workload, layouts, seq_len, hw, cal, **kwargs):  # noqa: ANN001, ANN003, ANN202
        plan = real_rank(workload, layouts, seq_len, hw, cal, **kwargs)
        seen.append((workload, plan))
        return plan

    monkeypatch.setattr(auto, "rank", spy)
    config = str(_run_config(tmp_path, directory, True))
    resolved = auto.resolve_auto_topology(config, [], nproc=4)
    assert load_run_config(config, resolved).world_size == 4  # the chosen layout validates
    out = capsys.readouterr().out
    (workload, plan), = seen
    sample = artifact_documents(directory, SEQ_LEN)
    assert isinstance(workload.doc_length, DocumentSample) and workload.doc_length == sample
    best = plan.best.layout
    assert f"topology.transport={best.transport}" in resolved and f"topology.schedule={best.schedule}" in resolved
    assert f"topology.cp={best.cp}" in resolved and f"topology.bp={best.bp}" in resolved
    assert any(p.layout.schedule == "balanced" for p in plan.feasible)  # documents widen the search
    assert out.startswith("topology: auto -> ") and f"documents of {sample.describe()}" in out
    seen.clear()
    auto.resolve_auto_topology(str(_run_config(tmp_path, directory, False)), [], nproc=4)
    assert seen[0][0].doc_length is None and "documents of" not in capsys.readouterr().out
    missing = _run_config(tmp_path, tmp_path / "missing", True)
    with pytest.raises(ValueError, match=r"^topology: auto with data.document_mask plans data.train's documents: .*"
                       r"not a csbp data artifact"):
        auto.resolve_auto_topology(str(missing), [], nproc=4)



def test_plan_of_a_document_masked_run_config_plans_its_train_documents(tmp_path: Path, capsys) -> None:
    directory = write_artifact(tmp_path / "art")
    config = str(_run_config(tmp_path, directory, True, topology={}))
    base = ["plan", "--gpus", "4", "--gpu", "h200", "--top", "40"]

    def plan(*extra: str) -> tuple[str, dict]:
        out_json = tmp_path / "plan.json"
        assert main([*base, *extra, "--json", str(out_json)]) == 0
        return capsys.readouterr().out, json.loads(out_json.read_text(encoding="utf-8"))

    out, record = plan("--model", config)
    assert out.splitlines()[0] == (
        f"documents: data.train of {config} (data.document_mask; --doc-length N or --data ARTIFACT overrides)"
    )
    sample = artifact_documents(directory, SEQ_LEN)
    assert sample.describe() in out and record["documents"] == json.loads(json.dumps(sample.summary()))
    # the same plan as naming the artifact (same rows, same code path)
    _, explicit = plan("--model", config, "--data", str(directory))
    assert explicit == record
    out, record = plan("--model", config, "--doc-length", "8")  # an explicit override wins
    assert "documents: data.train" not in out and (record["doc_length"], record["documents"]) == (8, None)
    out, record = plan("--model", config, "--seq-len", "128")  # longer rows join the artifact's rows
    assert record["documents"] == json.loads(json.dumps(artifact_documents(directory, 128).summary()))
    unmasked = str(_run_config(tmp_path, directory, False, topology={}))
    out, record = plan("--model", unmasked)
    assert "documents: data.train" not in out and (record["doc_length"], record["documents"]) == (None, None)
    # --data plans the documents under the mask although that config trains without it: said, not silent
    out, record = plan("--model", unmasked, "--data", str(directory))
    assert f"note: --data plans {directory}'s documents under the document mask, but {unmasked} trains with " \
        "data.document_mask false" in out and "note: --data" not in plan("--model", config, "--data", str(directory))[0]
    missing = str(_run_config(tmp_path, tmp_path / "missing", True, topology={}))
    assert main([*base, "--model", missing]) == USER_ERROR_EXIT_CODE
    out, err = capsys.readouterr()
    assert out == "" and err.strip().splitlines() == [
        f"csbp: error: --model {missing} has data.document_mask, so csbp plan plans data.train's documents: "
        f"{tmp_path / 'missing'} is not a csbp data artifact (no manifest.json); run csbp data prepare "
        "(or pass --doc-length N / --data ARTIFACT)"
    ]


@pytest.mark.parametrize("documents", ["--doc-length", "--data"])
def test_plan_with_documents_imports_no_torch(tmp_path: Path, documents: str) -> None:
    """``csbp plan`` stays torch-free (the CLI registers only ``plan``, the ``--doc-length``
    documents are drawn with NumPy, the artifact is read without the data loader)."""
    source = str(write_artifact(tmp_path / "art")) if documents == "--data" else "64"
    code = (
        "import sys\n"
        "from csbp.cli.main import main\n"
        f"rc = main(['plan', '--model', 'nemotron-3b', '--block-size', '4', '--seq-len', '{SEQ_LEN}', '--gpus', '4',"
        f" '--gpu', 'h100', '{documents}', {source!r}, '--top', '1'])\n"
        "assert rc == 0, rc\n"
        "assert 'torch' not in sys.modules, 'csbp plan imported torch'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr + done.stdout
