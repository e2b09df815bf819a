"""How many range requests a worker's read-ahead keeps in flight: adapted to the store's measured latency.

An object store answers each request after a latency (20–100 ms in the cloud) and then streams it; one
request at a time delivers at most ``chunk / (latency + chunk / bandwidth)`` bytes/s. By Little's law a parser
that takes ``rate`` bytes/s needs ``rate × duration / chunk`` requests in flight, where ``duration`` is how long
one request takes in all. `InFlight` measures both (the parser's rate while it was not waiting, each
request's duration and size, as moving averages) and sets the target to twice that need, rounded up, between
``read_concurrency`` (the start, before anything was measured) and ``max_read_concurrency`` (the bound). Each
time the parser had to wait for a chunk the target grows by one more (a rate measured while starved is the
supply's, not the demand's), and each chunk that was there in time gives one back. The bytes the requests
hold are bounded separately, by ``read_ahead``.
"""

from __future__ import annotations

import math
import threading
import time

#: weight of the newest measurement in the moving averages
_ALPHA = 0.3
#: requests kept in flight per request Little's law asks for (headroom for jitter in latency and rate)
HEADROOM = 2.0


class InFlight:
    """The adaptive in-flight target of one worker's read-ahead, and what it reached (``peak``)."""

    def __init__(self, start: int, bound: int):
        self.start, self.bound = max(1, min(start, bound)), bound
        self.target = self.start
        self.now = 0  # requests submitted and not finished
        self.peak = 0  # the most requests in flight at once
        self.duration: float | None = None  # seconds per request (moving average)
        self.size: float | None = None  # bytes per request (moving average)
        self.rate: float | None = None  # bytes/s the parser takes while not waiting (moving average)
        self._stalls = 0  # extra requests granted because the parser waited
        self._lock = threading.Lock()
        self._last_take: float | None = None

    def room(self, shared: int = 0) -> bool:
        """Whether one more request may start now; ``shared``: requests in flight that do not take a place of
        their own (they share one with another request), never beyond ``bound``."""
        return self.now < min(self.bound, self.target + shared)

    def started(self) -> None:
        """A request was submitted."""
        with self._lock:
            self.now += 1
            self.peak = max(self.peak, self.now)

    def ended(self) -> None:
        """A request finished, failed or was cancelled."""
        with self._lock:
            self.now -= 1

    def measured(self, nbytes: int, seconds: float) -> None:
        """A request for ``nbytes`` took ``seconds`` (from its start to its last byte)."""
        with self._lock:
            self.duration = _avg(self.duration, seconds)
            self.size = _avg(self.size, float(max(1, nbytes)))
            self._update()

    def took(self, nbytes: int, waited: float) -> None:
        """The parser took a chunk of ``nbytes`` after waiting ``waited`` seconds for it: its rate is the bytes
        over the time since its previous chunk, less the wait."""
        now = time.monotonic()
        with self._lock:
            if self._last_take is not None:
                busy = max(now - self._last_take - waited, 1e-4)  # a chunk parsed at once: a rate, not 1/0
                self.rate = _avg(self.rate, nbytes / busy)
                if waited > 0.001:  # starved: the measured rate is the supply's, so ask for one more
                    self._stalls = min(self._stalls + 1, self.bound)
                else:  # fed in time: give one back (extra requests cost the store, and CPU on a small machine)
                    self._stalls = max(self._stalls - 1, 0)
            self._last_take = now
            self._update()

    def need(self) -> float:
        """Requests in flight Little's law asks for at the measured rate and request time (0: not known yet)."""
        if self.rate is None or self.duration is None or not self.size:
            return 0.0
        return self.rate * self.duration / self.size

    def _update(self) -> None:
        want = math.ceil(HEADROOM * self.need()) + self._stalls
        self.target = max(self.start, min(self.bound, want))


def _avg(old: float | None, new: float) -> float:
    return new if old is None else (1 - _ALPHA) * old + _ALPHA * new
