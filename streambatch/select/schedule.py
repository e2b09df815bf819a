"""Mixture weights that change over training (curricula, annealing): ``weights`` as a schedule, a list of
per-epoch weights (the last holds for later epochs) or a callable ``epoch -> weights``.

Each epoch's mixture is the `MixedIndex` of that epoch's weights, its virtual
shards laid out for them (`MixedIndex.reweighted()`). A dataset's samples still come from one endless
sequence of seeded permutations (`streambatch.plan.mixing`): epoch ``e`` takes the next ``round(w_e·N)``
positions, beginning where epoch ``e - 1`` ended, so the per-epoch counts are exact and no sample repeats before
the whole dataset was taken, whatever the weights do. A callable runs here, in the main process, once per epoch
(and for every earlier epoch, to know where the epoch begins); the workers receive the resulting mixture, never
the callable. It must be deterministic: every rank and every resume must get the same weights for an epoch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import OptionError
from ..plan.mixing import DatasetDraw
from .mixture import MixedIndex, weights_by_name

if TYPE_CHECKING:
    from .mixture import AnyIndex


#: how many epochs' mixtures a schedule keeps (the current one and one planned or inspected beside it)
KEPT = 2


def is_schedule(weights: Any) -> bool:
    """Whether ``weights`` is a schedule (a callable, or a non-empty list of per-epoch weights, each a
    ``{name: weight}`` mapping or a list of numbers) rather than one set of weights for the whole run."""
    if callable(weights):
        return True
    if isinstance(weights, (str, bytes, Mapping)) or not isinstance(weights, Sequence) or not weights:
        return False
    entries = [isinstance(w, Mapping) or (isinstance(w, Sequence) and not isinstance(w, (str, bytes))) for w in weights]
    return any(entries) and all(e or w is None for e, w in zip(entries, weights))  # None: refused as an entry


class WeightSchedule:
    """A mixture's weights per epoch: a list (the last entry holds for later epochs) or a callable of the epoch,
    each epoch's weights checked as fixed weights are (names, finite numbers ≥ 0, the plan's size)."""

    def __init__(self, given: Sequence[Any] | Callable[[int], Any]):
        self.fn: Callable[[int], Any] | None = given if callable(given) else None
        self.entries: list[Any] = [] if callable(given) else list(given)
        self._given: dict[int, Any] = {}  # a callable's results, by epoch
        self._weights: dict[int, dict[str, float]] = {}  # checked, by epoch
        self._takes: list[list[int]] = []  # per epoch so far: the samples each dataset contributes
        self._indexes: dict[int, MixedIndex] = {}
        self.base: MixedIndex | None = None

    @classmethod
    def of(cls, weights: Any) -> WeightSchedule | None:
        """The schedule ``weights`` names, or None for fixed weights."""
        return cls(weights) if is_schedule(weights) else None

    def given(self, epoch: int) -> Any:
        """What the user's schedule says for ``epoch``, checked only to be given (a callable is called once per
        epoch): None, which means equal weights as a fixed ``weights``, is in a schedule a function that missed
        its ``return``, an `OptionError`."""
        if self.fn is None:
            got = self.entries[min(epoch, len(self.entries) - 1)]
        else:
            if epoch not in self._given:
                self._given[epoch] = self.fn(epoch)
            got = self._given[epoch]
        if got is None:
            where = "the weight function returned" if self.fn is not None else "the schedule gives"
            raise OptionError(
                f"weights for epoch {epoch}: {where} None; give every epoch its weights ({{name: weight}} or a list "
                "of numbers; {} for equal weights)"
            )
        return got

    def bind(self, index: AnyIndex | None) -> MixedIndex:
        """Attach the mixture the loader opened with epoch 0's weights, and check every entry of a list at once
        (a callable's result is checked when its epoch is set); returns epoch 0's mixture."""
        if not isinstance(index, MixedIndex):
            raise OptionError("a weight schedule needs several datasets: a {name: folder} mapping or a list of folders")
        self.base = index
        for epoch in range(len(self.entries)):
            self.index_for(epoch)
        return self.index_for(0)

    def weights(self, epoch: int) -> dict[str, float]:
        """Epoch ``epoch``'s weights by dataset name, checked (an `OptionError` naming the epoch)."""
        if epoch < 0:
            raise OptionError(f"a weight schedule has no epoch {epoch}")
        if epoch not in self._weights:
            assert self.base is not None, "bind() the mixture first"
            given = self.given(epoch)
            try:
                self._weights[epoch] = weights_by_name(given, self.names)
            except OptionError as e:
                raise OptionError(f"weights for epoch {epoch}: {e}") from None
        return self._weights[epoch]

    def starts(self, epoch: int) -> list[int]:
        """Where epoch ``epoch`` begins in each dataset's cycle sequence: the samples the epochs before it took
        (a list's last entry repeats, so its takes multiply)."""
        last = epoch if self.fn is not None else len(self.entries) - 1
        upto = min(epoch, last)
        while len(self._takes) < upto:
            self._takes.append(self._take(len(self._takes)))
        out = [sum(t[d] for t in self._takes[:upto]) for d in range(len(self.names))]
        if epoch > upto:
            out = [a + (epoch - upto) * t for a, t in zip(out, self._take(last))]
        return out

    def _take(self, epoch: int) -> list[int]:
        """The samples each dataset contributes to epoch ``epoch`` (``round(w·N)``, the draw's own rule)."""
        assert self.base is not None, "bind() the mixture first"
        w = self.weights(epoch)
        sizes = [ix.num_samples for ix in self.base.indexes]
        return [DatasetDraw.of(n, w[name], 0, d).take for d, (name, n) in enumerate(zip(self.names, sizes))]

    @property
    def names(self) -> list[str]:
        assert self.base is not None, "bind() the mixture first"
        return self.base.names

    def index_for(self, epoch: int) -> MixedIndex:
        """Epoch ``epoch``'s mixture: its weights, its windows, its virtual shards (the plan's size checked)."""
        epoch = int(epoch)
        if epoch not in self._indexes:
            assert self.base is not None, "bind() the mixture first"
            weights, starts = self.weights(epoch), self.starts(epoch)
            try:
                ix = self.base.reweighted(weights, starts)
            except OptionError as e:
                raise OptionError(f"weights for epoch {epoch}: {e}") from None
            while len(self._indexes) >= KEPT:
                del self._indexes[next(iter(self._indexes))]
            self._indexes[epoch] = ix
        return self._indexes[epoch]
