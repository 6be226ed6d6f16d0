"""The package's errors: one base, the configuration error every command reports the same
way (exit 2, ``hascheduler <command>: <message>``), and the domain errors the API maps to
one HTTP status each, in one place (api/errors.py)."""

from __future__ import annotations


class HaschedulerError(Exception):
    """Base of every error hascheduler raises on purpose."""


class ConfigError(HaschedulerError, ValueError):
    """A setting is wrong; the message names it (the flag and its environment variable)."""


class ScheduleNotFound(HaschedulerError, LookupError):
    def __init__(self, schedule_id: str) -> None:
        super().__init__(f"schedule {schedule_id!r} does not exist")
        self.schedule_id = schedule_id


class ScheduleExists(HaschedulerError, ValueError):
    def __init__(self, schedule_id: str) -> None:
        super().__init__(f"schedule {schedule_id!r} already exists")
        self.schedule_id = schedule_id


class RevisionConflict(HaschedulerError):
    """The schedule changed since the revision the client read (HTTP If-Match)."""

    def __init__(self, schedule_id: str, expected: int, current: int) -> None:
        super().__init__(
            f"schedule {schedule_id!r} is at revision {current}, not the expected {expected}"
        )
        self.schedule_id = schedule_id
        self.expected = expected
        self.current = current


class RunNotFound(HaschedulerError, LookupError):
    def __init__(self, fire_id: str) -> None:
        super().__init__(f"no run for fire {fire_id!r}")
        self.fire_id = fire_id


class RunConflict(HaschedulerError):
    """The run is not in a state the operation needs (the message says which)."""


class BrokerRefused(HaschedulerError):
    """The broker did not take a message the operation had to publish; nothing changed."""
