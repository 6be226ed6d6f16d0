"""Where fires go: one folder per kind of broker (publisher, consumer, reader), the
contracts they keep (base.py) and the registry that picks one by URL (registry.py)."""
