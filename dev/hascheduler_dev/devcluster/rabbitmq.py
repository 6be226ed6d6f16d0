"""A RabbitMQ node as our own child process, its data, logs and Erlang port mapper under
one directory: for `hascheduler dev --broker rabbitmq` and the tests (Debian's
rabbitmq-server package)."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

# Debian's wrapper, /usr/sbin/rabbitmq-server, switches to the rabbitmq user, who cannot
# write our directory; this is the server script it runs.
SERVER_SCRIPTS = ("/usr/lib/rabbitmq/bin/rabbitmq-server", "/usr/sbin/rabbitmq-server")


def rabbitmq_server_binary() -> str:
    for path in SERVER_SCRIPTS:
        if os.access(path, os.X_OK):
            return path
    found = shutil.which("rabbitmq-server")
    if found:
        return found
    raise FileNotFoundError(
        "rabbitmq-server is not installed (Debian: apt-get install rabbitmq-server)"
    )


@dataclass(frozen=True)
class RabbitNode:
    """Where one node listens and keeps its state."""

    directory: Path
    port: int  # AMQP, on 127.0.0.1
    dist_port: int  # Erlang distribution (rabbitmqctl)
    epmd_port: int  # a port mapper of its own, stopped with the node
    name: str = "hascheduler"

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}/"

    def environment(self) -> dict[str, str]:
        """The process environment that puts everything of the node under ``directory``
        (the files it needs are written here)."""
        d = self.directory
        for sub in ("mnesia", "log"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        (d / "enabled_plugins").write_text("[].\n")
        (d / "rabbitmq.conf").write_text(
            f"listeners.tcp.default = 127.0.0.1:{self.port}\n"
            # Quorum queues and publisher confirms want a disk that is not nearly full;
            # the default alarm (50 MB free) stops publishers, which the tests would see
            # as an outage.
            "disk_free_limit.absolute = 10MB\n"
        )
        return {
            **os.environ,
            "HOME": str(d),
            "RABBITMQ_NODENAME": f"{self.name}@localhost",
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "ERL_EPMD_PORT": str(self.epmd_port),
            "RABBITMQ_MNESIA_BASE": str(d / "mnesia"),
            "RABBITMQ_LOG_BASE": str(d / "log"),
            "RABBITMQ_LOGS": "-",
            "RABBITMQ_CONFIG_FILE": str(d / "rabbitmq"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(d / "enabled_plugins"),
            "RABBITMQ_FEATURE_FLAGS_FILE": str(d / "feature_flags"),
            "RABBITMQ_PID_FILE": str(d / "rabbitmq.pid"),
            # The server script then execs the Erlang VM instead of waiting on it as a
            # child: our process is the node, and a signal to it reaches the node.
            "RUNNING_UNDER_SYSTEMD": "true",
        }

    def stop_port_mapper(self) -> None:
        """The Erlang port mapper outlives the node: stop ours."""
        epmd = shutil.which("epmd") or next(
            (str(p) for p in Path("/usr/lib/erlang").glob("erts-*/bin/epmd")), None
        )
        if epmd:
            subprocess.run(
                [epmd, "-port", str(self.epmd_port), "-kill"],
                capture_output=True,
                timeout=10,
                check=False,
            )
