"""Balanced steps: each rank's batches ordered so that step k costs about the same *time* on every rank.

In data-parallel training a step lasts as long as its slowest rank. The budget evens out each batch's padded
cost, but not its time: attention grows with the lengths squared, so under one budget a batch of a few long
samples takes longer than one of many short ones. Drawn in a random order, step k pairs a slow batch on one rank
with fast ones on the others, and the fast ranks wait.

The balanced order needs no collective. Every rank draws the same seeded sequence of *targets* (one quantile in
[0, 1) per batch position of a worker, from ``(seed, epoch)`` only: every slot, on every rank, reads the same
sequence), and each slot places its batches so that the position with the larger target gets the batch with the
larger time. The batches are only moved among those one batcher round emitted together (`BatchPlan.rounds`):
their samples are all in the window when the round is cut, so the order costs no memory and no reading ahead,
the batch set, the step count and every resume stay what they were, and the order across steps stays random
(targets are a seeded shuffle of strata). A repeated batch (``even_batches="pad"``) stays right after its
original, and with ``hardest_first`` the hardest batch stays first.

A batch may move further, among ``rounds`` consecutive rounds (`StepBalance`), at the price of the samples a
worker then reads ahead or keeps back: by default as many rounds as keep that within `BALANCE_BYTES` where the
index knows its samples' bytes (`balance_rounds()`: many for text, one or two for audio), else one.

The time of a batch is a `StepTime` model, fitted from timed steps by ``calibrate`` (`fit_step_time()`), or one
of `STEP_TIMES`. Only the order of the times of one round's batches matters, so a model's scale does not.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import OptionError, shown

#: a stratum of the targets: every run of this many batch positions holds one target in each 1/STRATA of [0, 1)
STRATA = 16
#: keys the targets' random streams apart from the batcher's and the deal's
_TARGET_STREAM = 0xBA1A


@dataclass(frozen=True)
class StepTime:
    """The time of one training step on a batch, in any unit (seconds if fitted):
    ``a + b·n + c·ΣL + d·ΣL² + e·n·max + f·n·max²`` for ``n`` samples of lengths ``L`` (``max``: the longest).

    ``c``, ``d`` are the work of a model that sees each sample's own length (variable-length attention, packed
    batches); ``e``, ``f`` that of a model run on the padded ``n × max`` tensor (``f``: padded attention);
    ``a``, ``b`` the fixed cost of a step and of a sample. Lengths are in the index's unit. Every coefficient is
    a finite number ≥ 0, not all zero."""

    a: float = 0.0
    b: float = 0.0
    c: float = 0.0
    d: float = 0.0
    e: float = 0.0
    f: float = 0.0

    def __post_init__(self) -> None:
        values = []
        for name in COEFFICIENTS:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not (0 <= float(v) < math.inf):
                raise OptionError(f"step_balance: StepTime.{name} must be a finite number >= 0, got {shown(v)}")
            object.__setattr__(self, name, float(v))
            values.append(float(v))
        if not any(values):
            raise OptionError("step_balance: a StepTime with every coefficient 0 times every batch alike; give one")

    def times(self, batches: Sequence[np.ndarray], lengths: np.ndarray) -> np.ndarray:
        """The time of each batch (non-empty arrays of positions into ``lengths``), as float64."""
        if not len(batches):
            return np.zeros(0)
        sizes = np.fromiter((len(b) for b in batches), dtype=np.int64, count=len(batches))
        x = np.asarray(lengths, dtype=np.float64)[np.concatenate([np.asarray(b) for b in batches])]
        first = np.cumsum(sizes) - sizes
        total, squares = np.add.reduceat(x, first), np.add.reduceat(x * x, first)
        return self.of(sizes, total, squares, np.maximum.reduceat(x, first))

    def of(self, n: Any, total: Any, squares: Any, longest: Any) -> Any:
        """The time from a batch's figures: ``n`` samples, ``total`` = ΣL, ``squares`` = ΣL², ``longest`` = max
        (numbers or arrays)."""
        return (
            self.a
            + self.b * n
            + self.c * total
            + self.d * squares
            + self.e * n * longest
            + self.f * n * np.square(longest)
        )

    def to_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


COEFFICIENTS = tuple(f.name for f in dataclasses.fields(StepTime))

#: the named time models ``step_balance`` takes; only their terms' order matters, so they need no unit:
#: ``attention``: a transformer on padded batches, whose attention work is ``n·max²`` (under the budget a batch of
#: long samples is the slow one); ``conv``: a convolutional or recurrent encoder on padded batches, ``n·max``
#: (about what the budget already evens out: the order then stays close to random); ``tokens``: a model whose
#: time follows the real (unpadded) lengths, ``ΣL``
STEP_TIMES: dict[str, StepTime] = {"attention": StepTime(f=1.0), "conv": StepTime(e=1.0), "tokens": StepTime(c=1.0)}


#: what a worker may hold of samples read ahead or kept back for the balanced order (`StepBalance.rounds`), in
#: bytes: as much as an automatic window may hold (`buckets.WINDOW_BYTES`)
BALANCE_BYTES = 256 << 20
#: the most consecutive batcher rounds one balanced group spans
MAX_BALANCE_ROUNDS = 64
#: spans of at most this many rounds slide (`band_order()`, plan version 7 on): each round's positions choose
#: their batches among the rounds within ``rounds - 1`` of theirs; longer spans (small samples: text) are matched
#: as whole groups of rounds, which holds most of a run's batches at once and matches them better there
BAND_ROUNDS = 8
#: rounds after a round whose batches (with it and the earlier ones) give the times a goal is read against
#: (`band_order()`): planning reads them ahead from the index, the worker holds none of their samples
REFERENCE_ROUNDS = 8


@dataclass(frozen=True)
class StepBalance:
    """How a slot's batches are balanced: the time model, and how many consecutive batcher rounds a batch may
    move within (1: the round it was formed in, which costs no memory; more: a batch may be yielded up to that
    many rounds earlier or later, so a worker holds up to ``rounds - 1`` rounds of samples more)."""

    time: StepTime
    rounds: int = 1
    #: whether spans of 2 to `BAND_ROUNDS` rounds slide (`band_order()`): set from the plan version by
    #: `BatchingConfig.balance` (7 on), not an option, so not in `to_dict()`
    band: bool = dataclasses.field(default=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        """The coefficients and ``rounds`` as plain numbers (what a config holds and a checkpoint records)."""
        return {**self.time.to_dict(), "rounds": self.rounds}

    def __post_init__(self) -> None:
        if not isinstance(self.time, StepTime):
            raise OptionError(f"step_balance: time must be a StepTime, got {shown(self.time)}")
        r = self.rounds
        if isinstance(r, bool) or not isinstance(r, numbers.Integral) or not 1 <= int(r) <= MAX_BALANCE_ROUNDS:
            raise OptionError(
                f"step_balance: rounds must be a whole number from 1 to {MAX_BALANCE_ROUNDS}, got {shown(r)}"
            )
        object.__setattr__(self, "rounds", int(r))


def resolve_step_time(value: Any) -> StepBalance | None:
    """``step_balance`` as a `StepBalance`: None or False (batches in their random order), a name of
    `STEP_TIMES`, a `StepTime`, a `StepBalance`, or a mapping of StepTime coefficients (a calibration file's
    ``step_time``, with ``rounds`` optionally)."""
    if value is None or value is False:
        return None
    if isinstance(value, StepBalance):
        return value
    if isinstance(value, StepTime):
        return StepBalance(value)
    if isinstance(value, str):
        if value not in STEP_TIMES:
            raise OptionError(
                f"step_balance={value!r}: use one of {', '.join(map(repr, STEP_TIMES))}, a StepTime (from "
                "streambatch.calibrate), or None for the batches' random order"
            )
        return StepBalance(STEP_TIMES[value])
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - set(COEFFICIENTS) - {"rounds"})
        if unknown:
            raise OptionError(f"step_balance: unknown StepTime coefficient(s) {', '.join(map(str, unknown))}")
        coef = {k: v for k, v in value.items() if k != "rounds"}
        return StepBalance(StepTime(**coef), value.get("rounds", 1))
    raise OptionError(
        f"step_balance must be a name ({', '.join(map(repr, STEP_TIMES))}), a StepTime, a StepBalance, a dict of "
        f"StepTime coefficients or None, got {shown(value)}"
    )


def balance_rounds(refill: int, sample_bytes: float | None) -> int:
    """Rounds a balanced group spans by default: as many as keep the samples a worker holds on their account
    within `BALANCE_BYTES` (``refill`` samples a round, ``sample_bytes`` each); 1 where the bytes are unknown."""
    if not sample_bytes or not math.isfinite(sample_bytes) or sample_bytes <= 0 or refill <= 0:
        return 1
    return int(max(1, min(MAX_BALANCE_ROUNDS, BALANCE_BYTES // (refill * float(sample_bytes)) + 1)))


def targets(seed: int, epoch: int, start: int, count: int) -> np.ndarray:
    """The targets of batch positions ``start`` to ``start + count`` of every slot in ``epoch``: each run of
    `STRATA` positions from a multiple of it holds one value in each stratum ``[i/STRATA, (i+1)/STRATA)``, the
    strata in a seeded random order (the same on every rank and worker)."""
    out = np.empty(count)
    first = start // STRATA
    for blk in range(first, (start + count + STRATA - 1) // STRATA):
        rng = np.random.default_rng([int(seed) & 0xFFFFFFFF, int(epoch), _TARGET_STREAM, blk])
        vals = (rng.permutation(STRATA) + rng.random(STRATA)) / STRATA
        lo, hi = max(start, blk * STRATA), min(start + count, (blk + 1) * STRATA)
        out[lo - start : hi - start] = vals[lo - blk * STRATA : hi - blk * STRATA]
    return out


def balanced_order(
    times: np.ndarray,
    rounds: Sequence[int],
    repeat: Sequence[bool],
    fixed_first: bool,
    goals: np.ndarray,
    span: int = 1,
    band: bool = False,
) -> np.ndarray:
    """The permutation that balances one slot's batches: ``order[p]`` is the batch placed at position ``p``.

    ``times``: each batch's time; ``rounds``: the batcher round each came from (batches of one round are
    consecutive); ``repeat[i]``: batch ``i`` repeats batch ``i - 1`` (the pair stays where it is);
    ``fixed_first``: position 0 stays (``hardest_first``); ``goals``: the target of each position
    (`targets()`); ``span``: consecutive rounds grouped (`StepBalance.rounds`). Within each group the movable
    batches are matched to the movable positions, the slowest to the position with the highest target (ties in
    their planned order). With ``band`` and a span of 2 to `BAND_ROUNDS` rounds the movable batches slide instead
    (`band_order()`)."""
    n = len(times)
    order = np.arange(n)
    if n < 2:
        return order
    group = np.asarray(rounds) // max(1, int(span))
    rep = np.asarray(repeat, dtype=bool)
    fixed = rep | np.append(rep[1:], False)  # a repeat and the batch it repeats
    if fixed_first:
        fixed[0] = True
    if band and 2 <= int(span) <= BAND_ROUNDS:
        pos = np.flatnonzero(~fixed)
        if len(pos) > 1:
            t, r = np.asarray(times, dtype=np.float64)[pos], np.asarray(rounds, dtype=np.int64)[pos]
            order[pos] = pos[band_order(t, r, np.asarray(goals, dtype=np.float64)[pos], int(span))]
        return order
    change = np.flatnonzero(np.diff(group) != 0) + 1
    for lo, hi in zip(np.concatenate([[0], change]), np.concatenate([change, [n]])):
        pos = lo + np.flatnonzero(~fixed[lo:hi])
        if len(pos) < 2:
            continue
        by_time = pos[np.argsort(times[pos], kind="stable")]
        by_goal = pos[np.argsort(goals[pos], kind="stable")]
        order[by_goal] = by_time
    return order


def band_order(times: np.ndarray, rounds: np.ndarray, goals: np.ndarray, span: int) -> np.ndarray:
    """The sliding balanced order of batches in their planned order (``rounds``: each one's batcher round, in
    non-decreasing order; position ``p`` belongs to batch ``p``'s round): ``order[p]`` is the batch at ``p``.

    A batch of round ``r`` may take a position of rounds ``r - span + 1`` to ``r + span - 1``, so a worker reads
    at most ``span - 1`` rounds ahead and holds a batch back at most ``span - 1`` rounds: at most ``span`` rounds
    of batches at once, as a group of ``span`` rounds. Round by round, the round's positions (sorted by goal) are
    matched in order to as many of the batches they may take (sorted by time), the choice that brings each
    batch's time closest to the time at its position's goal among the batches of this round, the earlier ones
    and the `REFERENCE_ROUNDS` after it (dynamic programming); the batches that would otherwise miss their last
    round are taken first (earliest last round first). A goal then reads about the same time on every rank,
    where a group's own ranks drift with the few slow or fast batches it happens to hold.

    Each round's choice depends only on the rounds up to `band_read_ahead()` after it, so a prefix of the
    rounds orders its first rounds as the whole slot does."""
    m = len(times)
    out = np.empty(m, dtype=np.int64)
    placed = np.zeros(m, dtype=bool)
    starts = np.flatnonzero(np.r_[True, rounds[1:] != rounds[:-1]])
    ends = np.r_[starts[1:], m]
    for lo, hi in zip(starts.tolist(), ends.tolist()):
        rho = int(rounds[lo])
        cand = np.flatnonzero(~placed[: int(np.searchsorted(rounds, rho + span - 1, side="right"))])
        ref = np.sort(times[: int(np.searchsorted(rounds, rho + REFERENCE_ROUNDS, side="right"))])
        here = np.arange(lo, hi)
        by_goal = here[np.argsort(goals[here], kind="stable")]
        want = ref[np.minimum((goals[by_goal] * len(ref)).astype(np.int64), len(ref) - 1)]
        by_time = cand[np.argsort(times[cand], kind="stable")]
        last = rounds[by_time] + span - 1  # the last round each may take
        forced = last <= rho
        cost = np.abs(times[by_time][None, :] - want[:, None])
        while True:
            pick = _matched(cost, forced)
            short = _short(last, pick, rounds, hi)
            if short is None:
                break
            # too few of the batches due by round ``x`` taken for the positions left before it: take the
            # ones closest to this round's median goal time as well
            x, deficit = short
            free = np.flatnonzero((last <= x) & ~np.isin(np.arange(len(by_time)), pick))
            mid = want[len(want) // 2]
            forced[free[np.argsort(np.abs(times[by_time][free] - mid), kind="stable")[:deficit]]] = True
        out[by_goal] = by_time[pick]
        placed[by_time[pick]] = True
    return out


def band_read_ahead(span: int) -> int:
    """The rounds after a round that `band_order()` reads to order it, for a sliding span of ``span`` rounds:
    the `REFERENCE_ROUNDS` its goals' times are read against, and ``2·span - 2``: its candidates come from up to
    ``span - 1`` rounds ahead, and whether the rounds after it can still take the ones due is counted over the
    positions up to their last round, ``span - 1`` rounds further (`_short()`). A prefix of a slot's rounds
    that runs this far past a round orders that round as the whole slot does (`resume.BalancedPrefix`)."""
    return max(REFERENCE_ROUNDS, 2 * int(span) - 2)


def _short(last: np.ndarray, pick: np.ndarray, rounds: np.ndarray, hi: int) -> tuple[int, int] | None:
    """The first round ``x`` by which the candidates due (``last`` ≤ x) and not picked outnumber the positions
    of the rounds after this one (which ends at position ``hi``) up to ``x``, with how many more must be picked
    now; None when every later round can still take its due batches."""
    left = np.ones(len(last), dtype=bool)
    left[pick] = False
    for x in np.unique(last).tolist():
        due = int(np.count_nonzero(left & (last <= x)))
        room = int(np.searchsorted(rounds, x, side="right")) - hi
        if due > room:
            return int(x), due - room
    return None


def _matched(cost: np.ndarray, forced: np.ndarray) -> np.ndarray:
    """The cheapest order-keeping match of every row (a position, by goal) to a distinct column (a batch, by
    time), every ``forced`` column matched: ``cost[i, j]`` for row ``i`` and column ``j``; each row's column."""
    rows, cols = cost.shape
    best = np.full(rows + 1, np.inf)
    best[0] = 0.0
    took = np.zeros((cols, rows + 1), dtype=bool)
    for j in range(cols):
        take = np.full(rows + 1, np.inf)
        take[1:] = best[:-1] + cost[:, j]
        skip = np.full(rows + 1, np.inf) if forced[j] else best
        took[j] = take < skip
        best = np.where(took[j], take, skip)
    out = np.empty(rows, dtype=np.int64)
    i = rows
    for j in range(cols - 1, -1, -1):
        if i and took[j, i]:
            i -= 1
            out[i] = j
    return out


def step_balance(step_times: np.ndarray) -> dict[str, float]:
    """How even the steps are, from each rank's step times (``ranks × steps``): the mean over steps of the
    slowest rank's time over the mean rank's (``max_mean``, 1.0: perfectly even), and the share of rank-time
    spent waiting for the slowest rank (``idle``)."""
    t = np.asarray(step_times, dtype=np.float64)
    if t.ndim != 2 or t.shape[1] == 0 or t.shape[0] == 0:
        return {"max_mean": 1.0, "idle": 0.0}
    slowest = t.max(axis=0)
    mean = t.mean(axis=0)
    return {
        "max_mean": float(slowest.sum() / mean.sum()),
        "idle": float(1.0 - mean.sum() / slowest.sum()) if slowest.sum() > 0 else 0.0,
    }


def rank_step_times(plan: Any, lengths: Any, time: StepTime) -> np.ndarray:
    """Each rank's step times (``ranks × steps``, in the model's unit) in an epoch plan (`EpochPlan`), its batches
    in the order the rank yields them, timed on ``lengths`` by global id; what `step_balance()` takes."""
    out = np.zeros((plan.world_size, plan.steps))
    for r in range(plan.world_size):
        batches = []
        for w, b in plan.rank_order(r):
            sp = plan.slots[r * plan.num_workers + w]
            batches.append(sp.gids[sp.batches[b]])
        if batches:
            ids = np.concatenate(batches)
            local = np.split(np.arange(len(ids)), np.cumsum([len(b) for b in batches])[:-1])
            out[r, : len(batches)] = time.times(local, np.asarray(lengths[ids], dtype=np.float64))
    return out
