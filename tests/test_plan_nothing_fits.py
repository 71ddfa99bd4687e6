"""``csbp plan`` and ``topology: auto`` fail closed when no layout fits in memory: ``csbp plan`` still
prints the table (and writes ``--json``, with ``fits: false``) of what it tried, then one error line
naming the smallest layout, the term that breaks it and fixes the planner checked (exit 2), so that
``csbp plan ... && torchrun ...`` stops; every fix the line names makes the plan succeed."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from csbp.cli.main import USER_ERROR_EXIT_CODE, main
from csbp.plan import hardware as hardware_module
from csbp.recipes import copy_recipe

HF_TARGET = {  # a 64-layer, 5120-wide target: its layer weights alone exceed an H100 (docs/planning.md)
    "hidden_size": 5120, "num_attention_heads": 40, "num_key_value_heads": 8, "num_hidden_layers": 64,
    "intermediate_size": 25600, "vocab_size": 151936, "head_dim": 128,
}


def run(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def fixes(err: str) -> list[list[str]]:
    """The flags of each fix of the error line (``(fix: --a 1 or --b 2)``)."""
    match = re.search(r"\(fix: (.*)\)$", err.strip())
    assert match is not None, err
    return [shlex.split(part.split(",")[0]) for part in match.group(1).split(" or ")]


def with_fix(argv: list[str], fix: list[str]) -> list[str]:
    """``argv`` with the flag of ``fix`` replaced (or added)."""
    flag, out = fix[0], list(argv)
    if flag in out:
        start = out.index(flag) + 1
        end = start
        while end < len(out) and not out[end].startswith("--"):
            end += 1
        del out[start - 1 : end]
    return [*out, *fix]


def test_nothing_fits_prints_the_table_writes_json_and_exits_2(tmp_path: Path, capsys) -> None:
    out_json = tmp_path / "plan.json"
    argv = ["plan", "--model", "nemotron-14b", "--seq-len", "4M", "--gpus", "2", "--gpu", "h100", "--top", "2"]
    code, out, err = run(capsys, [*argv, "--json", str(out_json)])
    assert code == USER_ERROR_EXIT_CODE
    assert "out of memory:" in out and "why: nothing fits" in out and f"wrote {out_json}" in out
    assert len(err.splitlines()) == 1 and err.startswith("csbp: error: no layout fits in memory on 2xH100: ")
    assert "largest term checkpoints" in err and err.strip().endswith("(fix: --gpus 128)")
    payload = json.loads(out_json.read_text())
    assert payload["fits"] is False and payload["feasible"] == [] and payload["infeasible"]
    assert payload["error"] == err.strip().removeprefix("csbp: error: ")
    assert run(capsys, with_fix(argv, ["--gpus", "128"]))[0] == 0


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--checkpointing", "none"], "--checkpointing full"),
        (["--sharding", "ddp"], "--sharding fsdp2"),
    ],
)
def test_every_fix_named_is_checked(extra: list[str], expected: str, capsys) -> None:
    argv = ["plan", "--model", "nemotron-3b", "--seq-len", "1M", "--gpus", "8", "--gpu", "h200", "--top", "1", *extra]
    code, _, err = run(capsys, argv)
    assert code == USER_ERROR_EXIT_CODE and expected in err
    named = fixes(err)
    assert len(named) >= 2 and any(fix[0] == "--seq-len" for fix in named)
    for fix in named:
        assert run(capsys, with_fix(argv, fix))[0] == 0, fix


def test_given_topologies_that_do_not_fit_name_one_that_does(capsys) -> None:
    argv = ["plan", "--model", "nemotron-3b", "--seq-len", "1M", "--gpus", "8", "--gpu", "h200", "--topology", "dp8"]
    code, out, err = run(capsys, argv)
    assert code == USER_ERROR_EXIT_CODE and "out of memory:" in out
    assert "no layout of --topology dp8 fits in memory on 8xH200" in err
    [fix] = fixes(err)
    assert fix[0] == "--topology" and run(capsys, with_fix(argv, fix))[0] == 0


def test_an_online_target_pass_that_does_not_fit_names_offline_features(tmp_path: Path, capsys) -> None:
    (tmp_path / "config.json").write_text(json.dumps(HF_TARGET))
    argv = ["plan", "--model", "dflash2-qwen3.8", "--seq-len", "1M", "--gpus", "8", "--gpu", "h100",
            "--target-pass", "sharded", "--target-config", str(tmp_path)]
    code, _, err = run(capsys, argv)
    assert code == USER_ERROR_EXIT_CODE and "largest term target weights" in err
    assert err.strip().endswith("(fix: --target-pass offline)")
    assert run(capsys, with_fix(argv, ["--target-pass", "offline"]))[0] == 0


def test_a_plan_that_fits_says_so_in_json(tmp_path: Path, capsys) -> None:
    out_json = tmp_path / "plan.json"
    argv = ["plan", "--model", "nemotron-3b", "--seq-len", "64K", "--gpus", "8", "--gpu", "h200", "--json", str(out_json)]
    assert run(capsys, argv)[0] == 0
    payload = json.loads(out_json.read_text())
    assert payload["fits"] is True and payload["error"] is None


def test_topology_auto_that_fits_nothing_names_the_settings_to_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from csbp.plan.auto import resolve_auto_topology

    monkeypatch.setattr(hardware_module, "machine_ram_gib", lambda: 4.0)  # 1 GiB per process of a 4-process node
    path = copy_recipe("demo", tmp_path)
    data = yaml.safe_load(path.read_text())
    data["data"]["seq_len"] = 65536
    data["model"]["vocab_size"] = 512
    data["topology"] = "auto"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError) as info:
        resolve_auto_topology(str(path), [], nproc=4, echo=False)
    message = str(info.value)
    assert message.startswith("topology: auto: no layout fits in memory on 4xCPU") and "\n" not in message
    assert message.endswith(
        "(fix: --set train.micro_batch_size=4 --set train.grad_accum=8 or --nnodes 8 or --set data.seq_len=8192)"
    )  # more nodes bring their own RAM (more processes on this one would share its 4 GiB)
    for fix in (["train.micro_batch_size=4", "train.grad_accum=8"], ["data.seq_len=8192"]):
        assert resolve_auto_topology(str(path), fix, nproc=4, echo=False)
