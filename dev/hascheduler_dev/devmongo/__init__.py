"""A MongoDB-wire-compatible development server: in memory, a single-node replica set.

For tests and the local demo only; production uses MongoDB 6.0 or newer. See README.md,
section "The development MongoDB server", for what it supports and what it does not.
"""

from hascheduler_dev.devmongo.node import Settings
from hascheduler_dev.devmongo.server import DevMongoServer, serve_forever

__all__ = ["DevMongoServer", "Settings", "serve_forever"]
