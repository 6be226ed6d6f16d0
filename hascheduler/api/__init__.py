"""The HTTP API every replica serves (aiohttp)."""

from hascheduler.api.routes import create_app

__all__ = ["create_app"]
