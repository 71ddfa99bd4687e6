"""Encode ``csbp data prepare``'s chunks of documents in worker processes (``--workers N``).

Rendering chat templates (in the Jinja sandbox) and tokenizing is most of prepare's time and is done
per chunk of documents, each chunk independent of the others. With ``workers > 1`` the chunks go to a
pool of ``spawn``-ed processes (no ``fork`` of a process holding ``tokenizers``' threads), which
receive the tokenizer and the chat template once, when they start, and render with the same
:mod:`csbp.data.template_sandbox` limits (each tokenizes on one thread, ``TOKENIZERS_PARALLELISM``
unless set); results are taken back in chunk order, so the artifact is
byte-identical to ``workers == 1``. At most ``2 * workers`` chunks are in flight: the inputs are
read as a stream, never held whole.

Errors: a chunk's ``ValueError`` (a template error, the mask token in a document ...) is raised
again in the parent when that chunk's turn comes, so the first error in document order is reported,
as the same one line as in-process. Workers ignore ``SIGINT``: Ctrl-C reaches the parent, which
cancels the chunks not yet handed to a worker and waits for the ones that were (at most one per
worker plus one queued, each bounded) before the ``KeyboardInterrupt`` unwinds (and the staging directory is removed); no worker
outlives the call. A worker that dies (killed, out of memory) ends the call with one error instead of
a wait.

The pool is ``concurrent.futures.ProcessPoolExecutor``. ``multiprocessing.Pool`` was used before; its
``terminate()`` can deadlock (CPython issues 73945, 78178, 96995: a task-handler thread left waiting
on the task queue's lock), which hung a CI run in this module's error test, and it waits forever for
the result of a worker that died.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import numpy as np

from csbp.data.chat_template import ChatTemplate
from csbp.data.mask_checks import mask_in_text_message, mask_of
from csbp.data.packing import encode_documents
from csbp.data.sources import Document
from csbp.data.tokenizer import CsbpTokenizer

Encoded = list[tuple[np.ndarray, np.ndarray]]
Chunk = list[tuple[str, Document]]
Encode = Callable[[Sequence[Document], CsbpTokenizer, ChatTemplate | None], Encoded]
WORKERS_PER_CORE = 8
"""Encoding processes at most per CPU core (as ``run_local``'s ranks): more only thrash the machine
(``--workers 2**32`` was an OverflowError traceback from the pool's C-int queue size)."""


def max_workers() -> int:
    """The most ``--workers`` this machine takes: :data:`WORKERS_PER_CORE` per CPU core."""
    return WORKERS_PER_CORE * (os.cpu_count() or 1)


IN_FLIGHT_PER_WORKER = 2
"""Chunks queued per worker: one being encoded and one waiting, so no worker idles while the parent
writes; each chunk is bounded (``prepare.ENCODE_CHUNK_DOCUMENTS`` / ``_CHARACTERS``)."""


def encode_chunk(
    documents: Sequence[Document],
    tokenizer: CsbpTokenizer,
    template: ChatTemplate | None,
    encode: Encode = encode_documents,
) -> Encoded:
    """``encode(documents)``, refused (naming the first such document) when a document's tokens hold
    the mask token."""
    encoded = encode(documents, tokenizer, template)
    for doc, (token_ids, _) in zip(documents, encoded):
        if bool((token_ids == tokenizer.mask_token_id).any()):
            raise ValueError(f"{doc.where}: {mask_in_text_message(*mask_of(tokenizer))}")
    return encoded


def encoded_chunks(
    chunks: Iterable[Chunk],
    tokenizer: CsbpTokenizer,
    template: ChatTemplate | None,
    workers: int,
    encode: Encode = encode_documents,
) -> Iterator[tuple[Chunk, Encoded]]:
    """``(chunk, the encoding of its documents)`` for each of ``chunks`` (``(split, document)``
    pairs), in order; ``workers > 1`` encodes them in a process pool (module docstring), else here
    with ``encode``. Close the iterator (``contextlib.closing``) to stop the pool when the caller fails
    (the chunks being encoded end first)."""
    if workers <= 1:
        for chunk in chunks:
            yield chunk, encode_chunk([doc for _, doc in chunk], tokenizer, template, encode)
        return
    pool = ProcessPoolExecutor(
        workers, mp_context=multiprocessing.get_context("spawn"), initializer=_start_worker,
        initargs=(tokenizer, template),
    )
    finished = False
    try:
        pending: deque[tuple[Chunk, Future[Encoded]]] = deque()
        for chunk in chunks:
            pending.append((chunk, pool.submit(_encode_in_worker, [doc for _, doc in chunk])))
            if len(pending) >= IN_FLIGHT_PER_WORKER * workers:
                done, result = pending.popleft()
                yield done, _result(result)
        while pending:
            done, result = pending.popleft()
            yield done, _result(result)
        finished = True
    finally:
        # after an error, Ctrl-C or an early close: the chunks not handed to a worker are dropped, those
        # handed over end, and every worker has exited when this returns
        pool.shutdown(wait=True, cancel_futures=not finished)


def _result(future: Future[Encoded]) -> Encoded:
    """The chunk's encoding; a chunk's own error as it was raised, a dead worker as a ``ChildProcessError``
    (the CLI's one line, with its fix)."""
    try:
        return future.result()
    except BrokenProcessPool as error:
        raise ChildProcessError("an encoding worker of csbp data prepare --workers died") from error


_WORKER: tuple[CsbpTokenizer, ChatTemplate | None] | None = None


def _start_worker(tokenizer: CsbpTokenizer, template: ChatTemplate | None) -> None:
    global _WORKER
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and terminates the pool
    # one thread per worker: N workers each batch-encoding on every core would oversubscribe them
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _WORKER = (tokenizer, template)


def _encode_in_worker(documents: list[Document]) -> Encoded:
    assert _WORKER is not None, "worker not started"
    tokenizer, template = _WORKER
    return encode_chunk(documents, tokenizer, template)
