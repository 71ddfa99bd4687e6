"""Security guarantees that need more than a one-line CLI case (those are in
``test_reliability_inputs.py``): stores listening on loopback only, no tokenizer code from a model
directory, atomic single-file writes, bounded YAML and feature-store manifests."""

from __future__ import annotations

import builtins
import json
import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import yaml

from csbp.atomic import write_text_atomic
from csbp.config.loading import MAX_YAML_VALUES, ConfigError, read_yaml_file, write_config
from csbp.data.tokenizer import load_tokenizer
from csbp.parallel.loopback import loopback_store
from csbp.training.run_dir_checks import foreign_run_entry
from test_training_run import make_artifact, tiny_config

# ----------------------------------------------------------------------------- listening sockets


def _listening_inodes() -> dict[int, str]:
    """inode -> ``address:port`` of every listening TCP socket of the machine (IPv4 and IPv6)."""
    found: dict[int, str] = {}
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        if not Path(table).exists():
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], int(fields[9])
            if state != "0A":  # TCP_LISTEN
                continue
            address, port = local.split(":")
            found[inode] = f"{_address(address, width)}:{int(port, 16)}"
    return found


def _address(hex_address: str, width: int) -> str:
    if width == 8:
        return socket.inet_ntop(socket.AF_INET, int(hex_address, 16).to_bytes(4, "little"))
    words = bytes.fromhex(hex_address)
    raw = b"".join(words[i : i + 4][::-1] for i in range(0, 16, 4))
    return socket.inet_ntop(socket.AF_INET6, raw)


def listening_addresses(pids: list[int]) -> list[str]:
    """``address:port`` of every TCP socket the processes ``pids`` listen on."""
    listening = _listening_inodes()
    found = []
    for pid in pids:
        fd_dir = Path(f"/proc/{pid}/fd")
        try:
            names = os.listdir(fd_dir)
        except OSError:
            continue
        for name in names:
            try:
                link = os.readlink(fd_dir / name)
            except OSError:  # closed meanwhile (the listing's own descriptor, for one)
                continue
            if link.startswith("socket:["):
                inode = int(link[len("socket:[") : -1])
                if inode in listening:
                    found.append(listening[inode])
    return sorted(found)


def not_loopback(addresses: list[str]) -> list[str]:
    return [a for a in addresses if not a.startswith("127.")]


def test_the_probe_sees_a_wildcard_listener() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as wildcard:
        wildcard.bind(("0.0.0.0", 0))
        wildcard.listen()
        port = wildcard.getsockname()[1]
        assert f"0.0.0.0:{port}" in not_loopback(listening_addresses([os.getpid()]))


def test_a_loopback_store_listens_on_127_0_0_1_only_and_serves_clients() -> None:
    server = loopback_store(0, is_master=True, timeout=timedelta(seconds=10))
    mine = [a for a in listening_addresses([os.getpid()]) if a.endswith(f":{server.port}")]
    assert mine == [f"127.0.0.1:{server.port}"]
    client = loopback_store(server.port, is_master=False, timeout=timedelta(seconds=10))
    client.set("key", "value")
    assert server.get("key") == b"value"
    del client, server
    deadline = time.monotonic() + 5
    while [a for a in listening_addresses([os.getpid()]) if a == mine[0]] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert mine[0] not in listening_addresses([os.getpid()]), "the store kept its socket open"


# ----------------------------------------------------------------------------- tokenizer code


def test_a_tokenizer_directory_s_python_code_never_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers asks "run the custom code? [y/N]" when trust_remote_code is left unset; csbp
    sets it to False, so even a user answering yes runs nothing."""
    pytest.importorskip("transformers")
    sentinel = tmp_path / "PWNED"
    directory = tmp_path / "tok"
    directory.mkdir()
    (directory / "tokenization_evil.py").write_text(
        f"import pathlib\npathlib.Path({str(sentinel)!r}).write_text('ran')\n"
        "from transformers import PreTrainedTokenizerFast\n"
        "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n"
    )
    auto_map = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", "tokenization_evil.EvilTokenizer"]}
    (directory / "tokenizer_config.json").write_text(json.dumps({"auto_map": auto_map, "tokenizer_class": "EvilTokenizer"}))
    monkeypatch.setattr(builtins, "input", lambda prompt="": "y")
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    with pytest.raises(ValueError, match="custom code"):
        load_tokenizer(directory)
    assert not sentinel.exists(), "the tokenizer directory's Python code ran"


# ----------------------------------------------------------------------------- YAML


def alias_bomb(levels: int) -> str:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


def test_a_yaml_alias_bomb_is_refused_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text(alias_bomb(12))  # 10^13 values once expanded
    with pytest.raises(ConfigError, match=f"more than {MAX_YAML_VALUES} values") as caught:
        read_yaml_file(path)
    assert len(str(caught.value).splitlines()) == 1
    cyclic = tmp_path / "cyclic.yaml"
    cyclic.write_text("a: &a [1, *a]\n")
    with pytest.raises(ConfigError, match="anchors/aliases"):
        read_yaml_file(cyclic)
    small = tmp_path / "anchors.yaml"
    small.write_text("lr: &lr 0.1\noptim: {lr: *lr}\n")  # ordinary anchors still work
    assert read_yaml_file(small) == {"lr": 0.1, "optim": {"lr": 0.1}}


# ----------------------------------------------------------------------------- atomic files


def test_write_text_atomic_keeps_the_old_file_when_the_write_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "config.yaml"
    write_text_atomic(target, "old\n")

    def crash(*args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        write_text_atomic(target, "new\n")
    assert target.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]  # no temporary file left


def test_the_run_config_is_written_atomically_and_reads_back(tmp_path: Path) -> None:
    artifact = make_artifact(tmp_path / "art")
    cfg = tiny_config(artifact)
    path = write_config(cfg, tmp_path / "run")
    assert yaml.safe_load(path.read_text())["run"]["name"] == cfg.run.name
    assert sorted(p.name for p in path.parent.iterdir()) == ["config.yaml"]
    assert foreign_run_entry(path.parent) is None
    assert foreign_run_entry(artifact) == "manifest.json"  # a data directory is never a run directory


# ----------------------------------------------------------------------------- feature stores


class Planted:
    """Unpickling this calls ``os.system``."""

    def __init__(self, sentinel: Path) -> None:
        self.sentinel = sentinel

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.sentinel}",))


def test_forged_feature_stores_are_one_line_and_never_unpickled(tmp_path: Path) -> None:
    from csbp.data.artifact import open_artifact
    from csbp.dflash.features import open_features, target_config_hash, token_hash
    from csbp.models.config import DecoderConfig

    split = open_artifact(make_artifact(tmp_path / "art")).split("train")
    config = DecoderConfig(
        vocab_size=300, hidden_size=8, intermediate_size=16, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4
    )
    store = tmp_path / "features"
    store.mkdir()

    def refused(manifest: str, match: str) -> None:
        (store / "manifest.json").write_text(manifest)
        with pytest.raises(ValueError, match=match) as caught:
            open_features(store, target_config=config, target_weights="w", split=split, layer_ids=[0],
                          need_last_hidden=True)
        assert len(str(caught.value).splitlines()) == 1

    for manifest in ("[1, 2]", json.dumps({"format": "csbp-dflash-features", "dtype": "object"}), "{oops"):
        refused(manifest, "manifest")
    valid = {
        "format": "csbp-dflash-features", "format_version": 2, "dtype": "float32", "split": "train",
        "target_weights": "w",
        "target_config_hash": target_config_hash(config), "token_hash": token_hash(split.tokens, split.doc_ids),
        "layer_ids": [0], "width": 8, "rows": split.num_rows, "seq_len": split.seq_len, "with_last_hidden": True,
    }
    sentinel = tmp_path / "PWNED"
    np.save(store / "features.npy", np.array([Planted(sentinel)], dtype=object), allow_pickle=True)
    refused(json.dumps(valid), "features.npy: not a feature array")  # numpy never maps (or unpickles) an object array
    assert not sentinel.exists(), "a pickled feature file ran code"
    np.save(store / "features.npy", np.zeros((split.num_rows, split.seq_len, 8), dtype="<f4"))
    np.save(store / "last_hidden.npy", np.zeros((1, 2, 3), dtype="<f4"))
    refused(json.dumps(valid), "last_hidden.npy: shape")


# ----------------------------------------------------------------------------- checkpoints


def test_a_checkpoint_naming_a_file_outside_itself_is_refused(tmp_path: Path) -> None:
    """DCP opens ``checkpoint / relative_path`` for every item: ``../`` or an absolute path in a
    crafted ``.metadata`` would read any file into the model."""
    import dataclasses
    import pickle

    import torch
    import torch.distributed.checkpoint as dcp

    from csbp.training.checkpoint_integrity import checkpoint_problem, read_metadata, safe_dcp_load

    outside = tmp_path / "outside.distcp"
    checkpoint = tmp_path / "ck"
    dcp.save({"w": torch.arange(4.0)}, checkpoint_id=checkpoint, no_dist=True)
    outside.write_bytes(b"\0" * 4096)
    genuine = read_metadata(checkpoint)
    for escape in ("../outside.distcp", str(outside), "..", ".metadata"):  # ".." is its own Path().name
        metadata = dataclasses.replace(
            genuine,
            storage_data={key: dataclasses.replace(info, relative_path=escape) for key, info in genuine.storage_data.items()},
        )
        (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))
        with pytest.raises(ValueError, match="outside the checkpoint"):
            read_metadata(checkpoint)
        with pytest.raises(ValueError, match="outside the checkpoint"):
            safe_dcp_load({"w": torch.zeros(4)}, checkpoint, no_dist=True)
        assert "outside the checkpoint" in str(checkpoint_problem(checkpoint, state_file=None))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="renameat2(RENAME_EXCHANGE) is Linux-only")
def test_overwrite_swaps_in_one_step_so_a_crash_never_leaves_the_target_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import csbp.atomic

    target, built = tmp_path / "export", tmp_path / ".export.tmp-1"
    for directory, name in ((target, "old"), (built, "new")):
        directory.mkdir()
        (directory / name).write_text(name)
    real_replace = os.replace

    def replace(source: object, destination: object) -> None:
        assert Path(str(source)) != target, "the old directory was moved away before the new one was in place"
        real_replace(source, destination)

    monkeypatch.setattr(os, "replace", replace)
    csbp.atomic.replace_directory(built, target)
    assert [p.name for p in tmp_path.iterdir()] == ["export"]
    assert [p.name for p in target.iterdir()] == ["new"]
    monkeypatch.setattr(csbp.atomic, "_exchange", lambda first, second: False)  # elsewhere: two renames
    monkeypatch.setattr(os, "replace", real_replace)
    built.mkdir()
    (built / "newer").write_text("newer")
    csbp.atomic.replace_directory(built, target)
    assert [p.name for p in tmp_path.iterdir()] == ["export"] and [p.name for p in target.iterdir()] == ["newer"]


def test_a_checkpoint_declaring_more_than_it_stores_is_refused_before_allocation(tmp_path: Path) -> None:
    import dataclasses
    import pickle

    import torch
    import torch.distributed.checkpoint as dcp

    from csbp.training.checkpoint_integrity import checkpoint_problem, read_metadata

    checkpoint = tmp_path / "ck"
    dcp.save({"w": torch.arange(4.0), "step": torch.tensor(3)}, checkpoint_id=checkpoint, no_dist=True)
    assert checkpoint_problem(checkpoint, state_file=None) is None  # a genuine one, 0-dim tensors included
    genuine = read_metadata(checkpoint)
    item = genuine.state_dict_metadata["w"]
    huge = torch.Size([10**6, 10**6])
    forged = dataclasses.replace(
        item, size=huge, chunks=[dataclasses.replace(chunk, sizes=huge) for chunk in item.chunks]
    )
    metadata = dataclasses.replace(genuine, state_dict_metadata={**genuine.state_dict_metadata, "w": forged})
    (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))
    assert "declares [1000000, 1000000] torch.float32 for 'w' but stores" in str(
        checkpoint_problem(checkpoint, state_file=None)
    )
