"""A Python client for the HTTP API: ``Client`` (blocking) and ``AsyncClient``, typed with
the models the server validates with, raising the API's problems as typed errors."""

from hascheduler.client.clients import AsyncClient, Client
from hascheduler.client.errors import (
    Conflict,
    HaschedulerError,
    Invalid,
    NotFound,
    RateLimited,
    Unauthorized,
    Unavailable,
)

__all__ = ["AsyncClient", "Client", "Conflict", "HaschedulerError", "Invalid", "NotFound",
           "RateLimited", "Unauthorized", "Unavailable"]
