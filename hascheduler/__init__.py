"""hascheduler: a highly available scheduler cluster."""

__version__ = "0.1.0"
