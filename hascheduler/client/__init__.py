"""A Python client for the HTTP API: ``Client`` (blocking) and ``AsyncClient``, typed with
the models the server validates with, raising the API's problems as typed errors;
``verify_webhook`` checks a webhook delivery's signature on the receiving side."""

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
from hascheduler.core.webhooks import verify as verify_webhook

__all__ = [
    "AsyncClient",
    "Client",
    "Conflict",
    "HaschedulerError",
    "Invalid",
    "NotFound",
    "RateLimited",
    "Unauthorized",
    "Unavailable",
    "verify_webhook",
]
