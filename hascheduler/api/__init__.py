"""The HTTP API every replica serves (aiohttp): ``routes.create_app`` builds it. Nothing is
imported here: the commands that only read this package's access rules (``token``) need
not load the server."""
