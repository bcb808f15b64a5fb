"""ExpertPlacement: which rank of the expert-parallel group holds which expert.

Shape legend: E experts (global), P ranks, e experts per rank, S = P * e dispatch slots.

A placement numbers the (rank, local expert) pairs in rank-major order: slot ``s = p * e + j`` is
local expert j of rank p. Tokens routed to global expert g go to ``slot_E[g]``; sorting routed
rows by slot groups them by destination rank and, within a rank, by local expert, which is the
order every dispatcher sends in. Today's layout is contiguous (rank p holds experts
``[p*e, (p+1)*e)``, so ``slot_E`` is the identity); any bijection works, e.g. a HybridEP domain
that re-places experts. Replicated experts (one expert on several ranks) are a per-source choice
of slot and will come as a subclass that overrides ``slot_E`` per source rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

from moesaic.checks import check_positive_int, is_int

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class ExpertPlacement:
    """Experts of one MoE layer over the ranks of its expert-parallel group.

    Attributes:
        num_experts: E.
        experts_of_rank: for each rank p, the global ids of its local experts in local order
            (every rank holds the same number e; together they hold each expert exactly once).
    """

    num_experts: int
    experts_of_rank: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        check_positive_int("num_experts", self.num_experts)
        if not self.experts_of_rank:
            raise ValueError("experts_of_rank must list the experts of at least one rank")
        sizes = {len(ids) for ids in self.experts_of_rank}
        if len(sizes) != 1:
            raise ValueError(
                f"experts_of_rank must give every rank the same number of experts, got sizes "
                f"{[len(ids) for ids in self.experts_of_rank]}"
            )
        flat = [g for ids in self.experts_of_rank for g in ids]
        if not all(is_int(g) for g in flat) or sorted(flat) != list(range(self.num_experts)):
            raise ValueError(
                f"experts_of_rank must hold each expert id 0..{self.num_experts - 1} exactly "
                f"once, got {self.experts_of_rank}"
            )
        # The derived facts now, not at a first read inside a torch.compile'd forward: a
        # cached_property's first read takes a lock there (Python < 3.12), a graph break.
        for name in ("slot_of_expert", "owner_of_expert", "_slot_tensors"):
            getattr(self, name)

    @classmethod
    def contiguous(cls, num_experts: int, ep_size: int) -> ExpertPlacement:
        """Rank p holds experts ``[p*e, (p+1)*e)``: the default layout."""
        check_positive_int("ep_size", ep_size)
        check_positive_int("num_experts", num_experts)
        if num_experts % ep_size:
            raise ValueError(
                f"num_experts ({num_experts}) must be divisible by the expert-parallel "
                f"size ({ep_size})"
            )
        e = num_experts // ep_size
        return cls(num_experts, tuple(tuple(range(p * e, (p + 1) * e)) for p in range(ep_size)))

    @classmethod
    def from_owners(cls, owner_E: Sequence[int], ep_size: int) -> ExpertPlacement:
        """From the owning rank of each expert; local order follows the global ids."""
        ranks: list[list[int]] = [[] for _ in range(ep_size)]
        for g, p in enumerate(owner_E):
            if not is_int(p) or not 0 <= p < ep_size:
                raise ValueError(f"owner of expert {g} ({p!r}) must be a rank in [0, {ep_size})")
            ranks[p].append(g)
        return cls(len(owner_E), tuple(tuple(r) for r in ranks))

    # ---- derived facts (pure Python, no torch) --------------------------------------------

    @property
    def ep_size(self) -> int:
        """P, ranks in the group."""
        return len(self.experts_of_rank)

    @property
    def num_local(self) -> int:
        """e, experts per rank."""
        return len(self.experts_of_rank[0])

    @property
    def is_contiguous(self) -> bool:
        return self.slot_of_expert == tuple(range(self.num_experts))

    @cached_property
    def slot_of_expert(self) -> tuple[int, ...]:
        """Dispatch slot ``p * e + j`` of every global expert (E entries)."""
        slot = [0] * self.num_experts
        for p, ids in enumerate(self.experts_of_rank):
            for j, g in enumerate(ids):
                slot[g] = p * self.num_local + j
        return tuple(slot)

    @cached_property
    def owner_of_expert(self) -> tuple[int, ...]:
        """The rank holding each global expert (E entries)."""
        return tuple(s // self.num_local for s in self.slot_of_expert)

    def local_experts(self, rank: int) -> tuple[int, ...]:
        """Global ids of ``rank``'s experts, in local order."""
        if not 0 <= rank < self.ep_size:
            raise ValueError(f"rank ({rank}) must be in [0, {self.ep_size})")
        return self.experts_of_rank[rank]

    def peers(self, counts_E: Sequence[int], rank: int) -> tuple[int, ...]:
        """Ranks other than ``rank`` that receive at least one row given per-expert ``counts_E``."""
        dest = {self.owner_of_expert[g] for g, c in enumerate(counts_E) if c}
        return tuple(sorted(dest - {rank}))

    # ---- tensors for the routing plan -------------------------------------------------------

    def slot_tensor(self, device: torch.device | str | None = None) -> torch.Tensor:
        """``slot_of_expert`` as an int64 tensor [E] (shared: do not modify it).

        Made once per device: building it from the tuple is a copy of host memory to the device
        (on CUDA a blocking one), which routing must not pay every step.
        """
        import torch

        key = str(torch.device(device) if device is not None else torch.get_default_device())
        cached = self._slot_tensors.get(key)
        if cached is None:
            cached = torch.tensor(self.slot_of_expert, dtype=torch.int64, device=device)
            self._slot_tensors[key] = cached
        return cached

    @cached_property
    def _slot_tensors(self) -> dict[str, torch.Tensor]:
        """``slot_tensor`` by device (filled on first use; a cache, not part of the value)."""
        return {}

    def counts_Pe(self, counts_E: torch.Tensor) -> torch.Tensor:
        """Per-expert counts [E] rearranged to (rank, local expert) [P, e]."""
        if self.is_contiguous:
            return counts_E.view(self.ep_size, self.num_local)
        by_slot = counts_E.new_empty(counts_E.shape)
        by_slot[self.slot_tensor(counts_E.device)] = counts_E
        return by_slot.view(self.ep_size, self.num_local)

    def send_counts_P(self, counts_E: torch.Tensor) -> torch.Tensor:
        """Rows sent to each rank [P] for per-expert counts [E]."""
        return self.counts_Pe(counts_E).sum(dim=1)
