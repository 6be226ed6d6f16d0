"""The HTTP API every replica serves (aiohttp)."""

from .app import create_app

__all__ = ["create_app"]
