"""``PackedLoader``: determinism, epochs, dp sharding, resume (same and different dp_size)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from csbp.data.artifact import ArtifactSplit, open_artifact
from csbp.data.loader import PackedLoader
from csbp.data.prepare import PrepareConfig, prepare_artifact

SEQ_LEN = 3


def make_split(num_rows: int, fingerprint: str = "f" * 64) -> ArtifactSplit:
    """Row ``i`` holds tokens ``3i, 3i+1, 3i+2`` so every value identifies its row."""
    tokens = np.arange(num_rows * SEQ_LEN, dtype=np.uint32).reshape(num_rows, SEQ_LEN)
    loss_mask = (tokens % 2).astype(np.uint8)
    doc_ids = (tokens // 5).astype(np.int32)
    return ArtifactSplit("train", SEQ_LEN, tokens, loss_mask, doc_ids, fingerprint)


def take(loader: PackedLoader, steps: int) -> list[dict[str, torch.Tensor]]:
    return [next(loader) for _ in range(steps)]


def rows_of(batches: list[dict[str, torch.Tensor]]) -> list[list[int]]:
    return [b["row_ids"].tolist() for b in batches]


def test_batch_contents_dtypes_and_shapes() -> None:
    split = make_split(10)
    batch = next(PackedLoader(split, batch_size=4, seed=0))
    assert batch["input_ids"].dtype == torch.int64 and batch["input_ids"].shape == (4, SEQ_LEN)
    assert batch["loss_mask"].dtype == torch.bool and batch["doc_ids"].dtype == torch.int64
    rows = batch["row_ids"].numpy()
    assert np.array_equal(batch["input_ids"].numpy(), split.tokens[rows].astype(np.int64))
    assert np.array_equal(batch["loss_mask"].numpy(), split.loss_mask[rows] == 1)
    assert np.array_equal(batch["doc_ids"].numpy(), split.doc_ids[rows])


def test_deterministic_and_seed_dependent() -> None:
    split = make_split(20)
    first = rows_of(take(PackedLoader(split, batch_size=3, seed=7), 12))
    again = rows_of(take(PackedLoader(split, batch_size=3, seed=7), 12))
    other = rows_of(take(PackedLoader(split, batch_size=3, seed=8), 12))
    assert first == again and first != other


def test_epochs_visit_each_row_once_and_reshuffle() -> None:
    split = make_split(11)
    loader = PackedLoader(split, batch_size=2, seed=0, dp_rank=0, dp_size=2)
    assert loader.steps_per_epoch == 2  # 11 // 4, remainder dropped
    epochs = [sum(rows_of(take(loader, 2)), []) for _ in range(3)]
    for rows in epochs:
        assert len(set(rows)) == 4
    assert loader.state_dict()["epoch"] == 2
    assert len({tuple(rows) for rows in epochs}) == 3  # a fresh permutation per epoch


def test_dp_ranks_get_disjoint_shards_of_the_global_batch() -> None:
    split = make_split(30)
    dp_size, batch_size, steps = 3, 2, 5  # one epoch: 30 // 6
    per_rank = [
        rows_of(take(PackedLoader(split, batch_size=batch_size, seed=4, dp_rank=r, dp_size=dp_size), steps))
        for r in range(dp_size)
    ]
    single = rows_of(take(PackedLoader(split, batch_size=batch_size * dp_size, seed=4), steps))
    for step in range(steps):
        shards = [set(per_rank[r][step]) for r in range(dp_size)]
        assert all(len(a & b) == 0 for i, a in enumerate(shards) for b in shards[i + 1 :])
        assert sum((per_rank[r][step] for r in range(dp_size)), []) == single[step]
    all_rows = [row for r in range(dp_size) for batch in per_rank[r] for row in batch]
    assert sorted(all_rows) == list(range(30))


@pytest.mark.parametrize("drop_last", [True, False])
def test_resume_reproduces_the_uninterrupted_run(drop_last: bool) -> None:
    split = make_split(13)
    reference = take(PackedLoader(split, batch_size=2, seed=5, dp_rank=1, dp_size=2, drop_last=drop_last), 11)
    interrupted = PackedLoader(split, batch_size=2, seed=5, dp_rank=1, dp_size=2, drop_last=drop_last)
    take(interrupted, 4)
    state = json.loads(json.dumps(interrupted.state_dict()))  # survives serialisation
    resumed = PackedLoader(split, batch_size=2, seed=5, dp_rank=1, dp_size=2, drop_last=drop_last)
    resumed.load_state_dict(state)
    for expected, actual in zip(reference[4:], take(resumed, 7)):  # crosses two epoch boundaries
        for key in expected:
            assert torch.equal(expected[key], actual[key])


def test_resume_with_another_dp_size_continues_from_the_global_cursor() -> None:
    split = make_split(24)
    before = [PackedLoader(split, batch_size=2, seed=9, dp_rank=r, dp_size=2) for r in range(2)]
    for loader in before:
        take(loader, 2)  # 8 global samples consumed
    state = before[0].state_dict()
    assert state == before[1].state_dict() and state["cursor"] == 8
    uninterrupted = PackedLoader(split, batch_size=4, seed=9)
    take(uninterrupted, 2)
    expected = rows_of(take(uninterrupted, 4))  # the rest of the epoch, 16 samples
    after = [PackedLoader(split, batch_size=1, seed=9, dp_rank=r, dp_size=4) for r in range(4)]
    for loader in after:
        loader.load_state_dict(state)
    resharded = [rows_of(take(loader, 4)) for loader in after]
    for step in range(4):
        assert sum((resharded[r][step] for r in range(4)), []) == expected[step]


def test_resume_with_a_larger_global_batch_never_repeats_a_row_of_the_epoch() -> None:
    # 20 rows, G = 6: the epoch ends at cursor 18. Resumed there with G' = 4, 2 rows remain, fewer
    # than a global batch: drop_last starts the next epoch instead of wrapping onto rows 0 and 1.
    split = make_split(20)
    before = [PackedLoader(split, batch_size=3, seed=1, dp_rank=r, dp_size=2) for r in range(2)]
    seen = [sum((rows_of(take(loader, 1))[0] for loader in before), []) for _ in range(3)]
    state = before[0].state_dict()
    assert state["cursor"] == 18 and state["epoch"] == 0
    after = [PackedLoader(split, batch_size=1, seed=1, dp_rank=r, dp_size=4) for r in range(4)]
    for loader in after:
        loader.load_state_dict(state)
    following = [sum((rows_of(take(loader, 1))[0] for loader in after), []) for _ in range(5)]
    assert all(loader.epoch == 1 for loader in after)
    assert sum(following, []) == after[0].epoch_order(1)[:20].tolist()
    assert len(set(sum(seen, []))) == 18


def test_drop_last_false_covers_every_row_with_wraparound() -> None:
    split = make_split(7)
    loader = PackedLoader(split, batch_size=2, seed=1, dp_rank=0, dp_size=2, drop_last=False)
    peer = PackedLoader(split, batch_size=2, seed=1, dp_rank=1, dp_size=2, drop_last=False)
    assert loader.steps_per_epoch == 2
    rows = sum(rows_of(take(loader, 2)) + rows_of(take(peer, 2)), [])
    order = loader.epoch_order(0).tolist()
    assert rows == order[:2] + order[4:6] + order[2:4] + [order[6], order[0]]
    assert sorted(set(rows)) == list(range(7))


def test_drop_last_false_starts_the_next_epoch_when_the_batches_divide_the_rows() -> None:
    """Without drop_last, an epoch whose rows the global batches divide exactly ends at its last row:
    the next batch is the start of the next epoch's order, not a wrap-around into the same one."""
    loader = PackedLoader(make_split(8), batch_size=4, seed=2, drop_last=False)
    assert loader.steps_per_epoch == 2
    first_epoch = sum(rows_of(take(loader, 2)), [])
    assert first_epoch == loader.epoch_order(0).tolist()
    assert rows_of(take(loader, 1)) == [loader.epoch_order(1)[:4].tolist()]
    assert loader.state_dict()["epoch"] == 1 and loader.state_dict()["cursor"] == 4


def test_unshuffled_order_and_state_validation() -> None:
    split = make_split(6)
    loader = PackedLoader(split, batch_size=3, seed=0, shuffle=False)
    assert rows_of(take(loader, 3)) == [[0, 1, 2], [3, 4, 5], [0, 1, 2]]
    with pytest.raises(ValueError, match="loader state has seed=0 but this loader has 1"):
        PackedLoader(split, batch_size=3, seed=1, shuffle=False).load_state_dict(loader.state_dict())
    changed = PackedLoader(make_split(6, fingerprint="0" * 64), batch_size=3, seed=0, shuffle=False)
    with pytest.raises(ValueError, match="loader state has fingerprint="):
        changed.load_state_dict(loader.state_dict())
    with pytest.raises(ValueError, match="fewer than one global batch"):
        PackedLoader(split, batch_size=4, seed=0, dp_size=2)
    with pytest.raises(ValueError, match="dp_rank 2 / dp_size 2"):
        PackedLoader(split, batch_size=1, seed=0, dp_rank=2, dp_size=2)


def test_loader_over_a_prepared_artifact(tmp_path: Path) -> None:
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": f"document number {i} " * 3}) + "\n" for i in range(12)))
    config = PrepareConfig(
        inputs=(path,),
        out_dir=tmp_path / "art",
        seq_len=8,
        train_tokenizer=True,
        vocab_size=280,
        val_fraction=0.2,
    )
    prepare_artifact(config)
    artifact = open_artifact(tmp_path / "art")
    train = artifact.split("train")
    loader = PackedLoader(train, batch_size=2, seed=0)
    assert loader.state_dict()["fingerprint"] == artifact.fingerprint
    seen = torch.cat([b["row_ids"] for b in take(loader, loader.steps_per_epoch)])
    assert len(set(seen.tolist())) == seen.numel() == train.num_rows - train.num_rows % 2
    batch = next(PackedLoader(train, batch_size=2, seed=0))
    assert torch.equal(
        batch["input_ids"][0], torch.from_numpy(train.tokens[int(batch["row_ids"][0])].astype(np.int64))
    )
