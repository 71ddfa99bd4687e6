"""A crafted DCP ``.metadata`` cannot change csbp's process: only allow-listed globals are looked up,
nothing but containers and DCP metadata instances the file built itself is ever mutated, and values
of types DCP never writes are one line before anything is loaded."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path, PosixPath

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import WriteItemType

from csbp.atomic import Ownership, check_replaceable
from csbp.training.checkpoint_integrity import checkpoint_problem, read_metadata, safe_dcp_load


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


def _forged(genuine: Metadata, case: str) -> Metadata:
    item = genuine.state_dict_metadata["w"]
    chunk = item.chunks[0]
    negative = torch.Size([-1, -4])  # its product, 4, is backed by the stored bytes
    tensors = {
        "chunks are not a list": dataclasses.replace(item, chunks=5),
        "no properties": dataclasses.replace(item, properties=None),
        "a negative size": dataclasses.replace(item, size=negative, chunks=[dataclasses.replace(chunk, sizes=negative)]),
        "a dtype name": dataclasses.replace(item, properties=dataclasses.replace(item.properties, dtype="float32")),
    }
    if case in tensors:
        return dataclasses.replace(genuine, state_dict_metadata={**genuine.state_dict_metadata, "w": tensors[case]})
    if case == "storage is a list":
        return dataclasses.replace(genuine, storage_data=[1, 2])
    assert case == "a negative offset"
    return dataclasses.replace(
        genuine, storage_data={k: dataclasses.replace(v, offset=-100) for k, v in genuine.storage_data.items()}
    )


@pytest.mark.parametrize(
    "case",
    ["chunks are not a list", "no properties", "a negative size", "a dtype name", "storage is a list", "a negative offset"],
)
def test_metadata_of_the_wrong_types_is_one_line_before_any_load(checkpoint: Path, case: str) -> None:
    """Allowed classes holding values DCP never writes used to escape as an AttributeError or
    TypeError (a traceback), or, for negative sizes, pass the checks."""
    (checkpoint / ".metadata").write_bytes(pickle.dumps(_forged(read_metadata(checkpoint), case)))
    with pytest.raises(ValueError, match=r"\.metadata: .*damaged or forged, it was not loaded"):
        read_metadata(checkpoint)
    assert "damaged or forged" in str(checkpoint_problem(checkpoint, state_file=None))
    with pytest.raises(ValueError, match="damaged or forged"):
        safe_dcp_load({"w": torch.zeros(4), "step": torch.tensor(0)}, checkpoint, no_dist=True)


@pytest.mark.parametrize("linked", ["__0_0.distcp", ".metadata"])
def test_a_checkpoint_file_that_links_outside_the_checkpoint_is_refused(
    checkpoint: Path, tmp_path: Path, linked: str
) -> None:
    """A planted link (``__0_0.distcp -> ~/.ssh/id_rsa``) would read a file of the user's into the
    weights that an export then writes out. Links inside the checkpoint directory stay accepted."""
    outside = tmp_path / "secret.bin"
    (checkpoint / linked).rename(outside)
    (checkpoint / linked).symlink_to(outside)
    with pytest.raises(ValueError, match="is a link to a file outside the checkpoint"):
        read_metadata(checkpoint)
    assert "is a link to a file outside the checkpoint" in str(checkpoint_problem(checkpoint, state_file=None))
    (checkpoint / linked).unlink()
    outside.rename(checkpoint / f"{linked}.real")
    (checkpoint / linked).symlink_to(checkpoint / f"{linked}.real")
    assert checkpoint_problem(checkpoint, state_file=None) is None


def test_a_deeply_nested_forged_value_is_one_short_line(checkpoint: Path) -> None:
    """Naming a bad value used ``repr``, which raised RecursionError for a list nested 100000 deep."""
    placeholder = b"X\x0b\x00\x00\x00PLACEHOLDER"  # the pickled string "PLACEHOLDER"
    genuine = read_metadata(checkpoint)
    item = genuine.state_dict_metadata["w"]
    forged = dataclasses.replace(item, chunks=["PLACEHOLDER"])
    data = pickle.dumps(dataclasses.replace(genuine, state_dict_metadata={"w": forged}), protocol=2)
    depth = 100_000
    (checkpoint / ".metadata").write_bytes(data.replace(placeholder, b"]" * depth + b"a" * (depth - 1), 1))
    with pytest.raises(ValueError, match=r"has a chunk \[\[\[\[\.\.\.\]\]\]\]; the file is damaged") as info:
        read_metadata(checkpoint)
    assert len(str(info.value)) < 300


def test_a_negative_length_of_a_non_tensor_item_is_refused_before_any_load(tmp_path: Path) -> None:
    """A tensor's storage length is also bounded by its declared shape, a ``torch.save``'d value's
    (an optimizer's lr) by nothing else: without the sign rule its length -1 passed as intact (and
    lowered the size the file must have), so ``--resume`` chose the checkpoint, and DCP's reader,
    which reads a negative length as "to the end of the file", then failed in torch's zip reader
    (mutation audit of checkpoint_integrity.py: dropping ``length >= 0`` survived)."""
    checkpoint = tmp_path / "ck"
    dcp.save({"w": torch.arange(4.0), "lr": 0.25, "name": "abc"}, checkpoint_id=checkpoint, no_dist=True)
    genuine = read_metadata(checkpoint)
    for fqn in ("lr", "name", "w"):
        storage = {k: dataclasses.replace(v, length=-1) if k.fqn == fqn else v for k, v in genuine.storage_data.items()}
        (checkpoint / ".metadata").write_bytes(pickle.dumps(dataclasses.replace(genuine, storage_data=storage)))
        offset = next(v.offset for k, v in storage.items() if k.fqn == fqn)
        expected = (
            f"{checkpoint / '.metadata'}: storage entry for '{fqn}' has offset {offset}, length -1; "
            "the file is damaged or forged, it was not loaded"
        )
        assert checkpoint_problem(checkpoint, state_file=None) == expected
        with pytest.raises(ValueError) as refused:
            safe_dcp_load({"w": torch.zeros(4), "lr": 0.0, "name": ""}, checkpoint, no_dist=True)
        assert str(refused.value) == expected
