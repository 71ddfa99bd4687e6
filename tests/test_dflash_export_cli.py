"""``csbp dflash export``'s argument checks on the workspace of ``test_dflash_cli``: flags that only
apply to a training checkpoint are refused for a drafter directory, before any weight is loaded."""

from __future__ import annotations

from pathlib import Path

import pytest

from test_dflash_cli import build_workspace, run_cli


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_workspace(tmp_path_factory.mktemp("dflash_export_cli"))


@pytest.mark.parametrize(
    ("extra", "flags"),
    [(["--block-size", "8"], "--block-size overrides"),
     (["--mask-token-id", "3", "--layer-ids", "0", "1"], "--mask-token-id and --layer-ids override")],
)
def test_checkpoint_overrides_are_refused_for_a_drafter_directory(
    workspace: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    extra: list[str], flags: str,
) -> None:
    # `--drafter DIR --block-size 8` exported DIR's own block size without a word: the flag was ignored
    import csbp.models.hf_io as hf_io

    def no_loading(*args: object, **kwargs: object) -> None:
        raise AssertionError("the target's weights were loaded")

    monkeypatch.setattr(hf_io, "load_hf_checkpoint", no_loading)
    argv = ["dflash", "export", "--drafter", str(workspace["drafter"]), "--target", str(workspace["target"]),
            "--out", str(tmp_path / "out"), *extra]
    assert run_cli(argv) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"csbp: error: {flags} a checkpoint's run settings, but {workspace['drafter']} ")
    assert line.endswith(f"(fix: drop {flags.rsplit(' ', 1)[0]}, or export a --checkpoint)")
    assert not (tmp_path / "out").exists()
