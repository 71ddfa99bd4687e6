"""A crafted DCP ``.metadata`` cannot change csbp's process: only allow-listed globals are looked up,
and nothing but containers and DCP metadata instances the file built itself is ever mutated."""

from __future__ import annotations

from pathlib import Path, PosixPath

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.planner import WriteItemType

from csbp.atomic import Ownership, check_replaceable
from csbp.training.checkpoint_integrity import read_metadata


def _build_on_class(genuine: bytes, module: str, name: str, attribute: str, value: tuple[str, str]) -> bytes:
    """``genuine`` preceded by: push class ``module.name``, BUILD it with the slot state
    ``{attribute: value}`` (a setattr on the class itself), pop it."""
    setter = f"c{module}\n{name}\nN}}(V{attribute}\nc{value[0]}\n{value[1]}\nu\x86b0".encode("latin-1")
    return b"\x80\x02" + setter + genuine


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    path = tmp_path / "ck"
    dcp.save({"w": torch.arange(4.0), "step": torch.tensor(3)}, checkpoint_id=path, no_dist=True)
    return path


def test_genuine_metadata_reads_as_dcp_reads_it(checkpoint: Path) -> None:
    stock = FileSystemReader(str(checkpoint)).read_metadata()
    ours = read_metadata(checkpoint)
    assert ours.state_dict_metadata == stock.state_dict_metadata and ours.storage_data == stock.storage_data


def test_metadata_cannot_rewrite_pathlib_and_defeat_the_overwrite_ownership_check(
    checkpoint: Path, tmp_path: Path
) -> None:
    """The attack: ``PosixPath.iterdir = tuple`` makes every directory look empty, so ``--overwrite``
    would take a foreign directory for an empty one and delete its files."""
    foreign = tmp_path / "thesis"
    foreign.mkdir()
    (foreign / "chapter1.tex").write_text("precious")
    metadata = checkpoint / ".metadata"
    metadata.write_bytes(_build_on_class(metadata.read_bytes(), "pathlib", "PosixPath", "iterdir", ("builtins", "tuple")))
    try:
        with pytest.raises(ValueError, match=r"refused BUILD on the class PosixPath"):
            read_metadata(checkpoint)
        assert "iterdir" not in PosixPath.__dict__, "the checkpoint rewrote pathlib"
        with pytest.raises(ValueError, match="has no model.json"):
            check_replaceable(foreign, Ownership("model", "model.json", frozenset({"model.json"})))
    finally:
        if "iterdir" in PosixPath.__dict__:  # undo the poisoning for the rest of the session (old code)
            del PosixPath.iterdir


def test_metadata_cannot_set_attributes_of_shared_enum_members(checkpoint: Path) -> None:
    """An enum member is one object for the whole process: BUILD on it is refused too."""
    member = (
        b"\x80\x02ctorch.distributed.checkpoint.planner\nWriteItemType\nK\x02\x85R"
        b"N}(Vcsbp_planted\ncbuiltins\ntuple\nu\x86b0"
    )
    metadata = checkpoint / ".metadata"
    metadata.write_bytes(member + metadata.read_bytes())
    try:
        with pytest.raises(ValueError, match=r"refused BUILD on a WriteItemType"):
            read_metadata(checkpoint)
        assert not hasattr(WriteItemType.TENSOR, "csbp_planted")
    finally:
        WriteItemType.TENSOR.__dict__.pop("csbp_planted", None)


def test_metadata_instances_take_only_plain_attribute_dicts(checkpoint: Path) -> None:
    """BUILD on a DCP instance with a slot state (``setattr``) is refused; a dict state is what DCP writes."""
    metadata = checkpoint / ".metadata"
    # (Metadata instance, (None, {"planner_data": ()})) BUILD: a slot state, setattr on the instance
    slot = (
        b"\x80\x02ctorch.distributed.checkpoint.metadata\nMetadata\n)\x81"
        b"N}(Vplanner_data\n)u\x86b0"
    )
    metadata.write_bytes(slot + metadata.read_bytes())
    with pytest.raises(ValueError, match=r"refused BUILD with a tuple state"):
        read_metadata(checkpoint)
