"""Key-value stores of single-node launches that listen on loopback only.

A ``torch.distributed.TCPStore`` server binds its port on every interface (``*:PORT``), whatever
host name it is given: ``TCPStore("127.0.0.1", 0, is_master=True)`` is reachable from the network,
and the store accepts any client (no authentication), so during a run anyone who can reach the
machine could read or overwrite the rendezvous keys. torch 2.13 offers one way to choose the
address: ``master_listen_fd``, a socket the caller has already bound and put into listening state,
which the store's libuv server adopts (and closes when the store is destroyed). Here:

* :func:`loopback_store` makes a store server on ``127.0.0.1`` that way (or a client of one);
  ``csbp.parallel.launch.run_local`` (``csbp verify``, the benchmarks, the multi-process tests)
  joins its process group through it;
* :func:`register_loopback_rendezvous` registers the torch elastic rendezvous backend
  ``csbp-loopback`` that single-node ``csbp train`` launches use: torch's c10d rendezvous, with
  its store and the store it shares with the workers (``MASTER_ADDR``/``MASTER_PORT``) both
  listening on ``127.0.0.1``.

Multi-node launches cannot listen on loopback; see "Network exposure" in docs/failures.md.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousParameters,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

LOOPBACK = "127.0.0.1"
LOOPBACK_INTERFACE = "lo"
"""Single-node launches rendezvous at 127.0.0.1 and keep gloo's worker connections on loopback."""
RENDEZVOUS_BACKEND = "csbp-loopback"
_BACKLOG = 2048


def loopback_store(
    port: int,
    *,
    is_master: bool,
    timeout: timedelta,
    world_size: int | None = None,
    wait_for_workers: bool = False,
    multi_tenant: bool = False,
) -> dist.TCPStore:
    """A ``TCPStore`` on ``127.0.0.1:port``: a server listening on loopback only when ``is_master``
    (``port`` 0 picks a free one; read it from ``.port``), else a client of such a server."""
    if not is_master:
        return dist.TCPStore(
            LOOPBACK, port, world_size, is_master=False, timeout=timeout, wait_for_workers=wait_for_workers
        )
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind((LOOPBACK, port))
        listener.listen(_BACKLOG)
        bound = int(listener.getsockname()[1])
    except BaseException:
        listener.close()
        raise
    fd = listener.detach()  # the store owns the descriptor from here on and closes it
    return dist.TCPStore(
        LOOPBACK,
        bound,
        world_size,
        is_master=True,
        timeout=timeout,
        wait_for_workers=wait_for_workers,
        multi_tenant=multi_tenant,
        master_listen_fd=fd,
        use_libuv=True,  # adopts master_listen_fd since torch 2.8 (torch#150215)
    )


class LoopbackRendezvousHandler(DynamicRendezvousHandler):
    """torch's c10d rendezvous handler whose shared worker store (``MASTER_ADDR``/``MASTER_PORT``)
    listens on loopback only.

    It overrides the one method torch 2.13 creates that server in (a private one, so
    ``tests/test_loopback.py`` checks a real launch's listening sockets with every torch upgrade)."""

    def get_backend(self) -> str:
        return RENDEZVOUS_BACKEND  # torch elastic checks it against the requested backend's name

    def _create_tcp_store_server(self, master_addr: str, master_port: int) -> dist.TCPStore:
        return loopback_store(master_port, is_master=True, timeout=timedelta(seconds=300), multi_tenant=True)


def _create_loopback_handler(params: RendezvousParameters) -> RendezvousHandler:
    read_timeout = params.get_as_int("read_timeout", 60) or 60
    store = loopback_store(0, is_master=True, timeout=timedelta(seconds=read_timeout), multi_tenant=True)
    backend = C10dRendezvousBackend(store, params.run_id)
    return LoopbackRendezvousHandler.from_backend(
        params.run_id, store, backend, params.min_nodes, params.max_nodes, LOOPBACK
    )


def register_loopback_rendezvous() -> str:
    """Register the ``csbp-loopback`` rendezvous backend with torch elastic (idempotent); returns
    its name, for ``LaunchConfig(rdzv_backend=...)`` of a single-node launch."""
    rendezvous_handler_registry.register(RENDEZVOUS_BACKEND, _create_loopback_handler)
    return RENDEZVOUS_BACKEND
