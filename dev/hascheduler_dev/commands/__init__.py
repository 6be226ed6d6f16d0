"""The development tools' commands, registered as entry points of ``hascheduler``."""
