"""Parallel topology: the ``(dp, cp, bp)`` degrees, which combinations are accepted, and where each
rank sits (csbp.md §5-§6).

Ranks are ordered ``rank = dp_rank * local + local_rank`` with ``local = max(cp, bp)``, the number
of ranks that cooperate on one sample. Inside a sample::

    cp_rank    = local_rank % cp     # which zigzag clean shard (0 when cp == 1)
    bp_rank    = local_rank          # which block-schedule worker (0 when bp == 1)
    ring_index = local_rank // cp    # which replicated CP ring (0 unless bp > cp)

Accepted layouts (anything else is rejected, fail closed):

* ``data``: ``cp == bp == 1`` (plain data parallelism, or a single process);
* ``cp``:   CP-only zigzag over ``[x_t ; x_0]``, ``bp == 1 < cp``;
* ``bp``:   BP-only clean-prefix replication, ``cp == 1 < bp``, needs ``replicate_clean_prefix``;
* ``csbp``: fused CP x BP, ``cp > 1``, ``bp >= cp`` and ``bp % cp == 0`` (``bp // cp`` rings).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

LayoutName = Literal["data", "cp", "bp", "csbp"]


@dataclass(frozen=True)
class RankCoords:
    """Coordinates of one global rank (csbp.md §6)."""

    rank: int
    dp_rank: int
    local_rank: int
    cp_rank: int
    bp_rank: int
    ring_index: int


@dataclass(frozen=True)
class Topology:
    """Data-, context- and block-parallel degrees of a run.

    Attributes:
        dp: data-parallel replicas (each works on different samples).
        cp: context-parallel degree, the number of shards of the clean stream inside a ring.
        bp: block-parallel degree, the number of ranks that own noisy blocks of one sample.
        replicate_clean_prefix: explicit opt-in for BP-only runs, where every rank recomputes the
            clean prefix it needs instead of sharding it (csbp.md §5.3).
    """

    dp: int = 1
    cp: int = 1
    bp: int = 1
    replicate_clean_prefix: bool = False

    def __post_init__(self) -> None:
        for name in ("dp", "cp", "bp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Topology.{name} must be a positive integer, got {value!r}")
        if not isinstance(self.replicate_clean_prefix, bool):
            raise ValueError(
                f"Topology.replicate_clean_prefix must be a bool, got {self.replicate_clean_prefix!r}"
            )
        cp, bp = self.cp, self.bp
        if cp > 1 and bp > 1:
            if bp < cp or bp % cp != 0:
                raise ValueError(
                    f"Topology(cp={cp}, bp={bp}) is not a valid fused CSBP layout: bp must be a multiple "
                    f"of cp (bp >= cp, bp % cp == 0), e.g. bp={_next_multiple(max(bp, cp), cp)}"
                )
        if cp == 1 and bp > 1 and not self.replicate_clean_prefix:
            raise ValueError(
                f"Topology(cp=1, bp={bp}) is BP-only: set replicate_clean_prefix=True to opt into "
                "clean-prefix replication, or use cp > 1 (fused CSBP)"
            )
        if self.replicate_clean_prefix and not (cp == 1 and bp > 1):
            raise ValueError(
                f"Topology.replicate_clean_prefix=True is only valid for BP-only (cp=1, bp>1), got "
                f"cp={cp}, bp={bp}: set replicate_clean_prefix=False"
            )

    @property
    def local(self) -> int:
        """Ranks that cooperate on one sample, ``max(cp, bp)``."""
        return max(self.cp, self.bp)

    @property
    def world_size(self) -> int:
        return self.dp * self.local

    @property
    def num_rings(self) -> int:
        """Number of CP rings inside one sample's local ranks (``bp // cp``; 1 for CP-only)."""
        return self.local // self.cp

    @property
    def layout(self) -> LayoutName:
        if self.cp == 1 and self.bp == 1:
            return "data"
        if self.bp == 1:
            return "cp"
        if self.cp == 1:
            return "bp"
        return "csbp"

    def coords(self, rank: int) -> RankCoords:
        """Coordinates of global ``rank``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}) for {self}, got {rank}")
        dp_rank, local_rank = divmod(rank, self.local)
        return RankCoords(
            rank=rank,
            dp_rank=dp_rank,
            local_rank=local_rank,
            cp_rank=local_rank % self.cp,
            bp_rank=local_rank if self.bp > 1 else 0,
            ring_index=local_rank // self.cp,
        )

    def check_world_size(self, world_size: int) -> None:
        """Raise unless the launched ``world_size`` equals ``dp * max(cp, bp)``."""
        if world_size != self.world_size:
            raise ValueError(
                f"world_size={world_size} does not match dp*max(cp, bp)={self.world_size} for "
                f"(dp={self.dp}, cp={self.cp}, bp={self.bp}): launch {self.world_size} processes "
                f"or choose dp, cp, bp with dp*max(cp, bp) == {world_size}"
            )

    def validate_sequence(self, seq_len: int, block_size: int) -> None:
        """Raise unless a sequence of ``seq_len`` tokens in blocks of ``block_size`` fits this layout.

        Rules: ``seq_len % block_size == 0``; at least ``bp`` blocks; CP-only needs the ``2*cp``
        zigzag chunks of ``[x_t ; x_0]`` on block boundaries (``seq_len % (cp*block_size) == 0``);
        fused CSBP needs the ``2*cp`` zigzag clean chunks on block boundaries
        (``seq_len % (2*cp*block_size) == 0``).
        """
        for name, value in (("seq_len", seq_len), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if seq_len % block_size != 0:
            raise ValueError(
                f"seq_len={seq_len} is not a multiple of block_size={block_size} "
                f"(fix: {self._sequence_fixes(seq_len, block_size)})"
            )
        num_blocks = seq_len // block_size
        chunks = self._chunks_per_block()
        if num_blocks < self.bp:
            shortest = _next_multiple(self.bp * block_size, chunks * block_size)
            raise ValueError(
                f"seq_len={seq_len} gives {num_blocks} blocks of block_size={block_size}, fewer than "
                f"bp={self.bp} (fix: seq_len >= {shortest}, or a smaller bp or block_size)"
            )
        if chunks == 1:
            return
        what = "cp*block_size (zigzag chunks of [x_t ; x_0])" if self.layout == "cp" else (
            "2*cp*block_size (zigzag clean chunks)")
        if seq_len % (chunks * block_size) != 0:
            raise ValueError(
                f"seq_len={seq_len} must be a multiple of {what} = {chunks * block_size} for cp={self.cp}, "
                f"block_size={block_size} (fix: {self._sequence_fixes(seq_len, block_size)})"
            )

    def _chunks_per_block(self) -> int:
        """What a sequence length must be a multiple of, in blocks: ``cp`` (CP-only's zigzag chunks of
        ``[x_t ; x_0]``), ``2*cp`` (fused CSBP's zigzag clean chunks), else 1."""
        return {"cp": self.cp, "csbp": 2 * self.cp}.get(self.layout, 1)

    def _sequence_fixes(self, seq_len: int, block_size: int) -> str:
        """``seq_len=a or b, or block_size=c or d``: the nearest lengths and block sizes that meet every
        rule of this layout (a fix for one rule that the next refused sent the user round in circles)."""
        chunks = self._chunks_per_block()
        unit = chunks * block_size
        shortest = _next_multiple(self.bp * block_size, unit)
        below = (seq_len // unit) * unit
        lengths = [n for n in (below, below + unit) if n >= shortest and n != seq_len] or [max(shortest, below + unit)]
        fixes = f"seq_len={' or '.join(str(n) for n in lengths)}"
        fitting = [d for d in _divisors(seq_len) if seq_len % (chunks * d) == 0 and seq_len // d >= self.bp]
        blocks = [d for d in fitting if d < block_size][-1:] + [d for d in fitting if d > block_size][:1]
        return fixes + (f", or block_size={' or '.join(str(d) for d in blocks)}" if blocks else "")


def sequence_error_in_flags(message: str, *, seq_len: str = "--seq-len", block_size: str = "--block-size") -> str:
    """A ``Topology.validate_sequence`` message for a command line: its ``seq_len=`` / ``block_size=``
    written as the command's flags (``seq_len=28`` -> ``--seq-len 28``)."""
    return (message.replace("seq_len >= ", f"{seq_len} >= ").replace("seq_len=", f"{seq_len} ")
            .replace("block_size=", f"{block_size} "))


def _next_multiple(value: int, unit: int) -> int:
    return -(-value // unit) * unit


_DIVISOR_SEARCH_LIMIT = 2**20
"""Trial divisions :func:`_divisors` makes at most (about 0.1 s): every divisor of a length up to 2^40."""


def _divisors(value: int) -> list[int]:
    """The divisors of ``value`` up to ``_DIVISOR_SEARCH_LIMIT`` and their cofactors, ascending: every
    divisor for ``value <= 2^40``. Beyond, a length no run reaches, some are left out: trial division up
    to the square root of ``data.seq_len: 9223372036854775807`` took 4 minutes of validation."""
    small = [d for d in range(1, min(math.isqrt(value), _DIVISOR_SEARCH_LIMIT) + 1) if value % d == 0]
    return sorted({*small, *(value // d for d in small)})
