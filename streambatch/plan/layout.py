"""Layout: how an epoch is spread over ranks and their workers, and how the ranks are made to step together.

One typed value instead of four loose arguments: the planner (`epoch`), a resume on another layout
(`resume`) and the loader's checkpoint all take it, so the four travel together and are checked once.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import OptionError, bool_option, choice_option, int_option

#: how ranks get equal steps: split batches of the ranks short of the longest, drop the surplus, or repeat batches
EVEN_BATCHES = ("split", "drop", "pad")
#: the most DataLoader workers per rank (``num_workers``): each a process, each a slot of every rank's plan
MAX_WORKERS = 1024
#: the most data-parallel ranks a plan takes (``world_size``, ``dp_size``, a mesh's or the job's): 64 times the
#: 1,000+ ranks the project targets. Every rank deals the epoch over every (rank, worker) slot, and a whole-epoch
#: plan (no process group, ``planning="global"``, a resume on another layout) plans each slot, its time and memory
#: growing with the slots: this bound keeps it to seconds, where a billion ranks would take days and terabytes
MAX_WORLD_SIZE = 1 << 16
#: the most (rank, worker) slots a plan takes: ``world_size × max(1, num_workers)``, each planned, dealt and held
#: as above
MAX_SLOTS = 1 << 18


@dataclass(frozen=True)
class Layout:
    """``world_size`` ranks × ``num_workers`` (rank, worker) slots, equalised with ``even_batches``."""

    world_size: int = 1
    """Ranks (data-parallel processes) the epoch is dealt to."""
    num_workers: int = 1
    """Slots per rank: its DataLoader workers (1 when the rank reads in its own process)."""
    even_batches: str = "split"
    """How every rank gets the same step count (`EVEN_BATCHES`): ``"split"`` the largest batches of the
    ranks short of the longest (repeating some where too few samples are left to split), ``"drop"`` the surplus
    (counted, rotating with the epoch), ``"pad"`` with repeats."""
    hardest_first: bool = False
    """Each rank's most expensive batch at step 1 (an out-of-memory shows at once, not hours in)."""

    def __post_init__(self) -> None:
        int_option("world_size", self.world_size, 1)
        int_option("num_workers", self.num_workers, 1, MAX_WORKERS)
        check_slots(self.world_size, self.num_workers)
        choice_option("even_batches", self.even_batches, EVEN_BATCHES)
        object.__setattr__(self, "hardest_first", bool_option("hardest_first", self.hardest_first))

    @property
    def num_slots(self) -> int:
        """(rank, worker) slots in all."""
        return self.world_size * self.num_workers

    def rank_slots(self, rank: int) -> range:
        """The slots of ``rank``: its workers'."""
        return range(rank * self.num_workers, (rank + 1) * self.num_workers)


def check_slots(world_size: int, num_workers: int, source: str = "world_size") -> None:
    """``world_size`` ranks (given as ``source``: the option, or where it was detected) within
    `MAX_WORLD_SIZE`, and their (rank, worker) slots within `MAX_SLOTS`, else an `OptionError`
    naming both options (each slot is dealt and planned; see `MAX_SLOTS`)."""
    if world_size > MAX_WORLD_SIZE:
        raise OptionError(
            f"{source}={world_size} ranks: at most {MAX_WORLD_SIZE:,} (every rank plans the epoch over every "
            "rank's slots)"
        )
    slots = world_size * max(1, num_workers)
    if slots > MAX_SLOTS:
        raise OptionError(
            f"{source}={world_size} with num_workers={num_workers} makes {slots:,} (rank, worker) slots, "
            f"at most {MAX_SLOTS:,}: each slot is dealt and planned (about 0.1 ms and a few KiB each for a "
            "whole-epoch plan); use fewer workers per rank"
        )
