"""A MongoDB-wire-compatible development server: in memory, a single-node replica set.

For tests and the local demo only; production uses MongoDB 6.0 or newer. See README.md,
section "The development MongoDB server", for what it supports and what it does not.

Importing the package loads none of its modules: ``hascheduler devmongo`` first chooses
whether they come from their compiled build (native.py).
"""
