"""``csbp data prepare``: read sources, tokenize once, pack into a memory-mapped artifact.

Tokenization happens here only, never in the training loop. The steps:

1. parse every input (``sources.py``) and count documents (``prepare_inputs.py``); empty ones are
   skipped and counted; chat records that would need a role marker a given tokenizer lacks are
   refused here;
2. split documents (not rows) into train/val: ``round(val_fraction * N)`` documents, at least one
   when ``val_fraction > 0`` and ``N >= 2``, chosen by a permutation seeded with ``seed``
   (``chat_documents="turn"``: the documents a chat record becomes, one per assistant turn, are
   made at encoding and go to its split);
3. load the tokenizer, or train a byte-level BPE on the train documents;
4. encode and pack each split (``packing.py``; in chunks, in ``workers`` processes with
   ``encode_pool.py``, the same bytes for any number), write ``tokenizer.json`` and ``manifest.json``
   (``prepare_manifest.py``); a train split of fewer tokens than ``seq_len`` (one row of mostly
   padding) is refused before its padding is written;
5. refuse the result if an input's size or modification time changed since step 1 (the inputs are
   read once per step, and a file still being written would give each step other documents).

The mask token must be a token of its own: an id shared with EOS, pad or a role marker is refused
(by name before a tokenizer is trained, by id once a given one is loaded), and so is a document
whose tokens hold it (for a trained tokenizer, whose mask token is a special token, its text is
looked for while counting, before training; the checks are in ``mask_checks.py``). Every split
records ``supervised_mask_tokens`` (0), which ``csbp train`` relies on.

Writes are atomic: everything is built in a hidden temporary directory next to ``out_dir`` and
moved into place in one rename at the end (:func:`csbp.atomic.publish_directory`, which checks
``out_dir`` again then, so a directory another process created there meanwhile is never replaced
without ``overwrite``); on any failure the temporary directory is removed and no (partial) artifact
exists.

Usage::

    prepare_artifact(PrepareConfig(inputs=(Path("data.jsonl"),), out_dir=Path("art"), seq_len=512,
                                   train_tokenizer=True, vocab_size=4096, val_fraction=0.01))
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import closing
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from csbp.atomic import OutputExistsError, Ownership, check_replaceable, publish_directory
from csbp.data.artifact import ARRAY_DTYPES, MANIFEST_NAME, SPLITS, TOKENIZER_FILE, array_file_name
from csbp.data.chat_template import ChatTemplate, resolve_chat_template
from csbp.data.encode_pool import Chunk, encoded_chunks, max_workers
from csbp.data.mask_checks import check_mask_token_of_its_own, mask_fix, shared_mask_message
from csbp.data.packing import (
    PackedSplitWriter,
    SplitCounts,
    TurnTally,
    encode_documents,
    reasoning_refusal,
    turn_documents,
    unsupervised_rows_note,
)
from csbp.data.prepare_inputs import (
    check_role_markers,
    check_unchanged,
    count_documents,
    file_states,
    non_empty_documents,
)
from csbp.data.prepare_manifest import build_manifest, write_manifest
from csbp.data.sources import ChatDocuments, Document, TxtMode, expand_inputs
from csbp.data.tokenizer import (
    CsbpTokenizer,
    SpecialTokens,
    load_tokenizer,
    min_trained_vocab_size,
    train_bpe_tokenizer,
)
from csbp.staging import staging_directory
from csbp.wording import counted

ENCODE_CHUNK_DOCUMENTS = 256
ENCODE_CHUNK_CHARACTERS = 1 << 23
"""Documents are encoded in batches of at most this many documents and (unless one document alone is
longer) characters: ``tokenizers`` holds some hundred bytes per token of a batch at once, so 256 long
documents (books, long-context records) in one batch would ask for tens of GB."""
ARTIFACT_OWNERSHIP = Ownership(
    what="data artifact (manifest.json, tokenizer.json, *.bin)",
    marker=MANIFEST_NAME,
    names=frozenset(
        {MANIFEST_NAME, TOKENIZER_FILE, *(array_file_name(s, f) for s in SPLITS for f in ARRAY_DTYPES)}
    ),
)
"""What ``--overwrite`` may replace: a directory holding only the files of an artifact."""


@dataclass(frozen=True)
class PrepareConfig:
    """Options of ``csbp data prepare``.

    Attributes:
        inputs: files or directories (``.jsonl``, ``.txt``, ``.parquet``).
        out_dir: the artifact directory to create.
        seq_len: tokens per packed row.
        tokenizer_path: a local tokenizer directory or ``tokenizer.json`` (exclusive with training).
        train_tokenizer: train a byte-level BPE of ``vocab_size`` on the train documents.
        vocab_size: size of the trained tokenizer.
        val_fraction: share of documents held out for the ``val`` split, in ``[0, 1)``.
        seed: seeds the train/val document split.
        txt_mode: ``file`` (one document per .txt) or ``paragraphs`` (split on blank lines).
        special: special token names.
        overwrite: replace an existing ``out_dir``.
        chat_template: ``auto`` (the tokenizer directory's chat template if it has one, else csbp's
            role markers), ``none`` (role markers) or the path of a ``.jinja`` file; see
            ``chat_template.py``.
        chat_documents: ``record`` (one document per chat record, every assistant turn supervised)
            or ``turn`` (one per assistant turn, the conversation up to it, only it supervised:
            for templates that rewrite earlier turns, such as Qwen3's); see ``chat_template.py``.
        workers: processes that render and tokenize (``encode_pool.py``); the artifact is the same
            byte for byte whatever their number, which the manifest therefore does not record.
    """

    inputs: tuple[Path, ...]
    out_dir: Path
    seq_len: int
    tokenizer_path: Path | None = None
    train_tokenizer: bool = False
    vocab_size: int | None = None
    val_fraction: float = 0.0
    seed: int = 0
    txt_mode: TxtMode = "file"
    special: SpecialTokens = field(default_factory=SpecialTokens)
    overwrite: bool = False
    chat_template: str = "auto"
    chat_documents: ChatDocuments = "record"
    workers: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 1:
            raise ValueError(f"--workers is {self.workers!r}; use 1 or more (1: encode in this process)")
        if self.workers > max_workers():
            raise ValueError(
                f"--workers {self.workers}: more than {max_workers()} encoding processes on this machine's "
                f"{os.cpu_count() or 1} CPU cores would only thrash it (fix: --workers {max_workers()} or fewer)"
            )
        if self.chat_documents not in ("record", "turn"):
            raise ValueError(f"chat_documents is {self.chat_documents!r}; use 'record' or 'turn'")
        if self.chat_documents == "turn" and self.chat_template == "none":
            raise ValueError(_TURN_NEEDS_TEMPLATE)
        if self.seq_len < 2:
            raise ValueError(f"--seq-len {self.seq_len}: a row needs at least 2 tokens (fix: --seq-len 2 or more)")
        if self.train_tokenizer == (self.tokenizer_path is not None):
            raise ValueError(
                "no tokenizer chosen, or two: prepare reads one (fix: pass exactly one of --tokenizer DIR or "
                "--train-tokenizer --vocab-size N)"
            )
        if self.train_tokenizer and self.vocab_size is None:
            raise ValueError(
                "--train-tokenizer: the trained tokenizer's size is not given (fix: add --vocab-size N, e.g. 4096 for "
                "a small corpus)"
            )
        if self.train_tokenizer and self.vocab_size is not None and self.vocab_size < min_trained_vocab_size(self.special):
            raise ValueError(
                f"--vocab-size {self.vocab_size} is too small: a byte-level BPE needs at least "
                f"{min_trained_vocab_size(self.special)} (256 bytes + special tokens)"
            )
        if self.vocab_size is not None and not self.train_tokenizer:
            raise ValueError(
                "--vocab-size only applies with --train-tokenizer; drop it when using --tokenizer"
            )
        for name, token in asdict(self.special).items():
            if not token.strip():
                which = f"--{name}-token" if name in ("eos", "mask", "pad") else f"the {name} role marker"
                raise ValueError(f"{which} is {token!r}; name a token (default {getattr(SpecialTokens(), name)})")
        if self.seed < 0:
            raise ValueError(f"--seed is {self.seed}; use 0 or more")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ValueError(f"val_fraction is {self.val_fraction}; use a value in [0, 1)")
        if self.txt_mode not in ("file", "paragraphs"):
            raise ValueError(f"txt_mode is {self.txt_mode!r}; use 'file' or 'paragraphs'")
        if self.train_tokenizer:  # a given tokenizer's ids are checked once it is loaded
            for name, other in asdict(self.special).items():
                if name != "mask" and other == self.special.mask:
                    mask = self.special.mask
                    raise ValueError(
                        shared_mask_message(f"--mask-token {mask!r}", name, other, mask_fix(mask, True))
                    )


def prepare_artifact(config: PrepareConfig, *, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Build the artifact described by ``config``; returns its manifest."""
    say = log or (lambda message: None)
    out_dir = Path(config.out_dir)
    if os.path.lexists(out_dir) and not config.overwrite:
        raise OutputExistsError(
            f"output {out_dir} already exists (fix: choose another --out, or pass --overwrite to replace it)"
        )
    out_dir = check_replaceable(out_dir, ARTIFACT_OWNERSHIP)
    files = expand_inputs(config.inputs)
    snapshot = file_states(files)  # the inputs are read three times: they must not change meanwhile
    # A given tokenizer (path, special tokens) is checked before the inputs are read.
    given = load_tokenizer(config.tokenizer_path, special=config.special) if config.tokenizer_path is not None else None
    if given is not None:
        check_mask_token_of_its_own(given)
    template = resolve_chat_template(config.chat_template, config.tokenizer_path)

    # A trained tokenizer makes the mask token a special token, so its text anywhere in a document
    # would become the mask id: refused here, before training.
    literal_mask = config.special.mask if given is None else None
    found = count_documents(files, config.txt_mode, literal_mask)
    num_documents, num_empty, num_chats = found.documents, found.empty, found.chats
    template = template if num_chats else None  # recorded only when it formatted something
    if config.chat_documents == "turn" and num_chats and template is None:
        raise ValueError(f"{found.first_chat}: {_TURN_NEEDS_TEMPLATE}")
    if template is None and found.first_reasoning is not None:  # role markers have no place for it
        raise ValueError(reasoning_refusal(found.first_reasoning))
    if given is not None and template is None:  # chats get csbp's role markers: refused before encoding
        check_role_markers(given, found.first_use_of_role)
    if template is not None:
        say(f"{counted(num_chats, 'chat record')}: chat template {template.source} (sha256 {template.sha256[:12]})")
    if num_documents == 0:
        raise ValueError(f"the inputs hold no non-empty documents ({counted(num_empty, 'empty one')} skipped)")
    val_ordinals = _choose_val_documents(num_documents, config.val_fraction, config.seed)
    _check_document_ids_fit(num_documents - len(val_ordinals), len(val_ordinals))
    turns = TurnTally() if config.chat_documents == "turn" and template is not None else None
    if turns is not None:  # each split holds at most all of them
        _check_document_ids_fit(found.turn_documents, 0, "--chat-documents turn")
    unit = "record" if turns is not None else "document"  # each record becomes documents, counted below
    say(f"{counted(num_documents, unit)} ({len(val_ordinals)} val), {num_empty} empty skipped")

    tokenizer = given if given is not None else _train_tokenizer(config, files, val_ordinals, say)
    check_mask_token_of_its_own(tokenizer)  # a trained one's special names are distinct: a safety net
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with staging_directory(out_dir) as build_dir:  # removed on any error; a killed run's by the next one
        build_dir.chmod(0o755)  # mkdtemp's 0700 would keep the artifact from anyone else (csbp.atomic does the same)
        counts = _write_splits(build_dir, files, config, tokenizer, val_ordinals, template, turns)
        tokenizer.save(build_dir)
        manifest = build_manifest(config, files, tokenizer, counts, num_documents, num_empty, build_dir)
        manifest["chat_template"] = template.manifest_entry() if template is not None else None
        write_manifest(build_dir, manifest)
        check_unchanged(files, snapshot)
        # checked again: another process may have created out_dir while this one was tokenizing
        publish_directory(
            build_dir, out_dir, overwrite=config.overwrite, owned=ARTIFACT_OWNERSHIP, shown=config.out_dir
        )
    if turns is not None:
        say(f"--chat-documents turn: {turns.summary(num_chats)}")
    say(f"wrote {config.out_dir}: " + ", ".join(f"{s} {counted(counts[s].rows, 'row')}" for s in SPLITS))
    if note := unsupervised_rows_note({s: counts[s].unsupervised_rows for s in SPLITS}, {s: counts[s].rows for s in SPLITS}):
        say(note)
    return manifest


MAX_DOCUMENTS_PER_SPLIT = 2**31
"""Document ids are stored as int32 (``artifact.ARRAY_DTYPES``): ordinals ``0 .. 2**31 - 1``."""


def _check_document_ids_fit(num_train: int, num_val: int, why: str = "") -> None:
    for split, count in (("train", num_train), ("val", num_val)):
        if count > MAX_DOCUMENTS_PER_SPLIT:
            raise ValueError(
                f"{why + ': ' if why else ''}the {split} split would hold {'up to ' if why else ''}{count} "
                f"documents, more than the {MAX_DOCUMENTS_PER_SPLIT} "
                "int32 document ids can number (fix: prepare the inputs as several artifacts, or join short records)"
            )


def _choose_val_documents(num_documents: int, val_fraction: float, seed: int) -> frozenset[int]:
    if val_fraction == 0.0 or num_documents < 2:
        return frozenset()
    num_val = min(max(1, round(val_fraction * num_documents)), num_documents - 1)
    order = np.random.default_rng(seed).permutation(num_documents)
    return frozenset(int(i) for i in order[:num_val])


def _train_tokenizer(
    config: PrepareConfig, files: list[Path], val_ordinals: frozenset[int], say: Callable[[str], None]
) -> CsbpTokenizer:
    assert config.vocab_size is not None  # checked in PrepareConfig
    say(f"training a byte-level BPE tokenizer, vocab_size {config.vocab_size}")
    train_texts = (
        text
        for ordinal, doc in enumerate(non_empty_documents(files, config.txt_mode))
        if ordinal not in val_ordinals
        for text in doc.texts()
    )
    tokenizer = train_bpe_tokenizer(train_texts, vocab_size=config.vocab_size, special=config.special)
    if tokenizer.vocab_size < config.vocab_size:  # BPE stops when no pair is left to merge: say so
        say(f"note: the tokenizer has {tokenizer.vocab_size} ids, not --vocab-size {config.vocab_size}: the training "
            "text has no more pairs to merge (a small corpus); the artifact records the real size")
    return tokenizer


def _write_splits(
    build_dir: Path,
    files: list[Path],
    config: PrepareConfig,
    tokenizer: CsbpTokenizer,
    val_ordinals: frozenset[int],
    template: ChatTemplate | None,
    turns: TurnTally | None = None,
) -> dict[str, SplitCounts]:
    writers = {
        split: PackedSplitWriter(
            build_dir, split, seq_len=config.seq_len, pad_id=tokenizer.pad_id, mask_token_id=tokenizer.mask_token_id
        )
        for split in SPLITS
    }
    try:
        chunks = _chunks(non_empty_documents(files, config.txt_mode), val_ordinals, turns is not None)
        with closing(encoded_chunks(chunks, tokenizer, template, config.workers, encode_documents)) as encoded:
            for chunk, pairs in encoded:
                for (split, doc), (token_ids, loss_mask) in zip(chunk, pairs):
                    writers[split].add_document(token_ids, loss_mask)
                    if turns is not None and doc.messages is not None:
                        turns.add(doc, int(token_ids.shape[0]))
        _check_train_fills_a_row(writers["train"].num_tokens, config.seq_len)
        return {split: writer.finish() for split, writer in writers.items()}
    finally:
        for writer in writers.values():
            writer.close()


def _chunks(records: Iterator[Document], val_ordinals: frozenset[int], by_turn: bool) -> Iterator[Chunk]:
    """``(split, document)`` pairs in batches of at most ``ENCODE_CHUNK_DOCUMENTS`` documents and (but
    for a document longer alone) ``ENCODE_CHUNK_CHARACTERS`` characters; ``by_turn``: one document per
    assistant turn of a chat (``--chat-documents turn``)."""
    chunk: Chunk = []
    characters = 0
    for ordinal, record in enumerate(records):
        for doc in turn_documents(record) if by_turn else (record,):
            length = sum(len(segment.text) for segment in doc.segments)
            if chunk and characters + length > ENCODE_CHUNK_CHARACTERS:
                yield chunk
                chunk, characters = [], 0
            chunk.append(("val" if ordinal in val_ordinals else "train", doc))
            characters += length
            if len(chunk) == ENCODE_CHUNK_DOCUMENTS:
                yield chunk
                chunk, characters = [], 0
    yield chunk


def _check_train_fills_a_row(train_tokens: int, seq_len: int) -> None:
    """``ValueError`` when the train split holds fewer tokens than one row: it would be one row,
    padded to ``seq_len`` (checked before the padding is written)."""
    if train_tokens < seq_len:
        padding = 100.0 * (seq_len - train_tokens) / seq_len
        raise ValueError(
            f"--seq-len {seq_len} is longer than the {train_tokens} tokens of the train split: its one row "
            f"would be {padding:.2f}% padding (fix: --seq-len {train_tokens} or less, or add data)"
        )


_TURN_NEEDS_TEMPLATE = (
    "--chat-documents turn renders each assistant turn with the model's chat template, but these chats get "
    "csbp's role markers (--chat-template none, or a tokenizer directory without a template) (fix: "
    "--chat-template PATH of the model's template, or drop --chat-documents turn)"
)
