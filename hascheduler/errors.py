"""Domain errors. The API maps each to one HTTP status, in one place (api/errors.py)."""

from __future__ import annotations


class ScheduleNotFound(LookupError):
    def __init__(self, schedule_id: str) -> None:
        super().__init__(f"schedule {schedule_id!r} does not exist")
        self.schedule_id = schedule_id


class ScheduleExists(ValueError):
    def __init__(self, schedule_id: str) -> None:
        super().__init__(f"schedule {schedule_id!r} already exists")
        self.schedule_id = schedule_id


class RevisionConflict(Exception):
    """The schedule changed since the revision the client read (HTTP If-Match)."""

    def __init__(self, schedule_id: str, expected: int, current: int) -> None:
        super().__init__(f"schedule {schedule_id!r} is at revision {current}, not the "
                         f"expected {expected}")
        self.schedule_id = schedule_id
        self.expected = expected
        self.current = current
