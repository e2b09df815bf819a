"""Layout: how an epoch is spread over ranks and their workers, and how the ranks are made to step together.

One typed value instead of four loose arguments: the planner (:mod:`.epoch`), a resume on another layout
(:mod:`.resume`) and the loader's checkpoint all take it, so the four travel together and are checked once.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import bool_option, choice_option, int_option

#: how ranks get equal steps: split batches of the ranks short of the longest, drop the surplus, or repeat batches
EVEN_BATCHES = ("split", "drop", "pad")


@dataclass(frozen=True)
class Layout:
    """``world_size`` ranks × ``num_workers`` (rank, worker) slots, equalised with ``even_batches``."""

    world_size: int = 1
    """Ranks (data-parallel processes) the epoch is dealt to."""
    num_workers: int = 1
    """Slots per rank: its DataLoader workers (1 when the rank reads in its own process)."""
    even_batches: str = "split"
    """How every rank gets the same step count (:data:`EVEN_BATCHES`): ``"split"`` the largest batches of the
    ranks short of the longest, ``"drop"`` the surplus (counted, rotating with the epoch), ``"pad"`` with repeats."""
    hardest_first: bool = False
    """Each rank's most expensive batch at step 1 (an out-of-memory shows at once, not hours in)."""

    def __post_init__(self) -> None:
        int_option("world_size", self.world_size, 1)
        int_option("num_workers", self.num_workers, 1)
        choice_option("even_batches", self.even_batches, EVEN_BATCHES)
        object.__setattr__(self, "hardest_first", bool_option("hardest_first", self.hardest_first))

    @property
    def num_slots(self) -> int:
        """(rank, worker) slots in all."""
        return self.world_size * self.num_workers

    def rank_slots(self, rank: int) -> range:
        """The slots of ``rank``: its workers'."""
        return range(rank * self.num_workers, (rank + 1) * self.num_workers)
