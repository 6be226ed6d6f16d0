"""The command line: one module per command (serve, worker, schedules and runs, audit),
each stating its settings once (settings.py)."""
