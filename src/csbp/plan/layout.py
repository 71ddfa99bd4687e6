"""A candidate layout of the planner: the csbp topology plus the knobs that change cost and memory
(transport, activation checkpointing, micro-batch, ring placement, state sharding, block schedule).

``parse_topology("dp2/cp8/bp8")`` reads the notation of ``csbp plan --topology`` and of the
published runs (absent axes are 1).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Literal

from csbp.topology import Topology

Transport = Literal["collective", "streaming", "halo"]
Checkpointing = Literal["full", "none", "selective"]
SHORT_LABELS: dict[str, str] = {"none": "none", "full": "full", "selective": "sel"}
"""Checkpointing modes in a table's five-character column."""
Placement = Literal["packed", "striped"]
Sharding = Literal["fsdp2", "zero2", "ddp"]

_AXIS = re.compile(r"^(dp|cp|bp)(\d+)$")

MAX_DEVICES = 2**31 - 1
"""Devices of one job at most: torch.distributed (c10d) and NCCL number ranks with a C ``int``."""


def divisors(n: int, at_most: int | None = None) -> list[int]:
    """The divisors of ``n`` up to ``at_most`` (default: all), ascending, in about
    ``min(at_most, sqrt(n))`` steps (a loop over every number up to ``n`` never ended for
    ``csbp plan --gpus 10**12``)."""
    limit = n if at_most is None else min(n, at_most)
    if limit < 1:
        return []
    root = math.isqrt(n)
    small = [d for d in range(1, min(root, limit) + 1) if n % d == 0]
    # a cofactor n // d is at most limit where d >= n / limit: none when limit <= sqrt(n)
    large = [n // d for d in range(-(-n // limit), root + 1) if n % d == 0]
    return sorted({*small, *large})


@dataclass(frozen=True)
class Layout:
    """One point of the search.

    Attributes:
        dp, cp, bp: the csbp degrees (``csbp.topology.Topology``).
        transport: clean K/V transport of CP rings (``collective`` or ``streaming``; ``halo``: the
            mask-aware CP-only baseline ``cp-aware``, considered with packed documents).
        checkpointing: ``full`` (recompute every layer in backward), ``selective`` (recompute all but
            the attention, whose results are kept) or ``none``.
        micro_batch: samples per data-parallel replica per micro-step.
        placement: ``packed`` rings (csbp's rank order: a sample's ranks are consecutive, so a ring
            stays inside a node when it fits) or ``striped`` across nodes (the published recipe).
        sharding: optimizer/gradient/weight sharding: ``fsdp2`` (csbp ``train.fsdp``), ``zero2`` (the
            published recipe) or ``ddp`` (everything replicated).
        schedule: block schedule over BP ranks (``balanced``: dealt by document cost, considered
            with packed documents).
    """

    dp: int
    cp: int = 1
    bp: int = 1
    transport: Transport = "collective"
    checkpointing: Checkpointing = "full"
    micro_batch: int = 1
    placement: Placement = "packed"
    sharding: Sharding = "fsdp2"
    schedule: Literal["dual_end", "contiguous", "balanced"] = "dual_end"

    @property
    def topology(self) -> Topology:
        return Topology(
            dp=self.dp, cp=self.cp, bp=self.bp, replicate_clean_prefix=self.cp == 1 and self.bp > 1
        )

    @property
    def kind(self) -> str:
        return self.topology.layout

    @property
    def local(self) -> int:
        return max(self.cp, self.bp)

    @property
    def world(self) -> int:
        return self.dp * self.local

    @property
    def name(self) -> str:
        parts = [f"dp{self.dp}"]
        if self.cp > 1:
            parts.append(f"cp{self.cp}")
        if self.bp > 1:
            parts.append(f"bp{self.bp}")
        return "/".join(parts)


def parse_topology(text: str, *, name: str = "topology") -> tuple[int, int, int]:
    """``"dp2/cp8/bp8"`` -> ``(2, 8, 8)``; axes in any order, each at most once, absent axes 1. Errors
    start with ``name`` (the flag or field the text came from)."""
    degrees = {"dp": 1, "cp": 1, "bp": 1}
    seen = set()
    for part in text.lower().split("/"):
        match = _AXIS.match(part.strip())
        if match is None or match.group(1) in seen or int(match.group(2)) < 1:
            raise ValueError(
                f"{name} {text!r} is not of the form dpA/cpB/bpC (e.g. dp2/cp8/bp8; absent axes are 1)"
            )
        seen.add(match.group(1))
        degrees[match.group(1)] = int(match.group(2))
    cp, bp = degrees["cp"], degrees["bp"]
    if cp > 1 and bp > 1 and bp % cp:  # said in this notation, not as a Topology(...)
        fixed = re.sub(r"bp\s*\d+", f"bp{-(-max(bp, cp) // cp) * cp}", text, flags=re.IGNORECASE)
        raise ValueError(f"{name} {text!r}: bp{bp} is not a multiple of cp{cp}, which a fused CSBP layout needs "
                         f"(fix: e.g. {fixed})")
    Topology(
        dp=degrees["dp"],
        cp=degrees["cp"],
        bp=degrees["bp"],
        replicate_clean_prefix=degrees["cp"] == 1 and degrees["bp"] > 1,
    )  # fail closed on an invalid fused layout
    return degrees["dp"], degrees["cp"], degrees["bp"]
