"""What happens after a failed attempt (pure: no I/O, randomness injected)."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass


class PermanentFailure(Exception):
    """Raised by a handler for a run that can never succeed (a bad payload, a deleted
    account): the run ends ``dead`` at once, with this message as its error."""


class RunTimeout(Exception):
    """An attempt outlived its policy's ``timeout_s``."""


class PolicyError(ValueError):
    """A retry policy that cannot work (message names the field)."""


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Per target: at most ``max_attempts`` attempts, each bounded by ``timeout_s``; after
    failed attempt n the run waits a uniformly random time in
    [0, min(backoff_cap_s, backoff_base_s * 2**(n-1))] ("full jitter": retries of many
    runs that failed together spread out instead of arriving together)."""

    max_attempts: int = 5
    backoff_base_s: float = 1.0
    backoff_cap_s: float = 300.0
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if not isinstance(self.max_attempts, int) or self.max_attempts < 1:
            raise PolicyError("max_attempts must be a whole number of at least 1")
        for name in ("backoff_base_s", "backoff_cap_s", "timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0 < value < 1e9:
                raise PolicyError(f"{name} must be a number of seconds above 0")
        if self.backoff_cap_s < self.backoff_base_s:
            raise PolicyError("backoff_cap_s must be at least backoff_base_s")

    def backoff_s(
        self, attempt: int, uniform: Callable[[float, float], float] = random.uniform
    ) -> float:
        """The wait after failed attempt ``attempt`` (1-based)."""
        ceiling = self.backoff_base_s * 2.0 ** min(attempt - 1, 64)
        return uniform(0.0, min(self.backoff_cap_s, ceiling))


@dataclass(frozen=True, slots=True)
class Verdict:
    """After a failed attempt: ``retry`` after ``delay_s``, or ``dead``; ``error`` is what
    the ledger records."""

    outcome: str
    error: str
    delay_s: float = 0.0


MAX_ERROR_CHARS = 2000  # a traceback's worth; a handler's error text is not a log sink


def after_failure(
    policy: RetryPolicy,
    attempt: int,
    error: BaseException,
    uniform: Callable[[float, float], float] = random.uniform,
) -> Verdict:
    text = f"{type(error).__name__}: {error}"[:MAX_ERROR_CHARS]
    if isinstance(error, PermanentFailure):
        return Verdict("dead", text)
    if attempt >= policy.max_attempts:
        return Verdict("dead", f"{text} (attempt {attempt} of {policy.max_attempts})")
    return Verdict("retry", text, policy.backoff_s(attempt, uniform))
