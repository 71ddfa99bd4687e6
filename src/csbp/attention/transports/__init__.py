"""Attention transports: one module per way of computing a layer's attention over the rows a rank
holds (csbp.md §9-§11).

Each transport is a forward/backward pair run through ``function.TransportFunction`` (plus a small
callable class matching the decoder's ``AttentionFn``), built on the kernels of
``csbp.attention.kernel``: it computes ``(out, lse)`` partials over key subsets, merges them online
(``csbp.attention.merge``), and in backward computes each subset's dQ/dK/dV from the final merged
``(out, lse)``, sending the dK/dV of remote rows back to their owners with the mirror collective.
Metadata travels as one plan structure built once per step, never as a long positional argument
list.

* ``local``: every key is local (single-process reference, BP-only with clean-prefix replication);
  no communication.
* ``collective``: async all-gather of exchanged rows, local partial overlapped, reduce-scatter of
  dK/dV to owners. Exchanging all rows is the CP-only baseline; exchanging clean rows is CSBP.
* ``streaming``: CSBP over ``CP-1`` ring steps with bounded memory and query-row skipping.
* ``window``: CSBP sliding-window layers, one variable-split all-to-all of the needed clean rows.
* ``exchange``: what the ring transports that exchange K/V rows share (``ExchangeSpec``, the packed
  ``kv_shard`` wire format).
* ``factory``: ``build_attention`` picks the transport of a topology.
* ``function``: the autograd Function shared by all of them.
"""
