"""Partitions for real: nodes in Linux network namespaces on one bridge, links cut with
nftables (needs root, ``ip`` and ``nft``).

``Network`` makes a hub namespace holding a bridge, and one namespace per node with a veth
pair into the hub and an address of its own; every namespace, link and address is made
here and removed when the network closes, so the machine's own network is never touched.
A process runs in a node by prefixing its command with ``node.run_in``; the calling thread
itself can step into a node (``observe``) to talk to the others, since a socket belongs to
the namespace its thread was in when it was made.

Faults are nftables rules in the faulty node's own namespace (``cut``, ``lossy``), removed
by ``heal``. The kernel here has no ``tc netem``: ``lossy`` drops a share of packets at
random, and TCP's retransmissions turn that into a slow link too.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field

CLONE_NEWNET = 0x40000000
SUBNET = "10.77.0"  # inside the hub only: each Network has a bridge of its own
TABLE = "hascheduler"


def _run(*args: str) -> None:
    result = subprocess.run(args, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise NetworkError(f"{' '.join(args)}: {result.stderr.strip() or result.returncode}")


class NetworkError(RuntimeError):
    """A namespace, link or rule could not be made (not root, no ``ip`` or ``nft``)."""


@dataclass
class Node:
    name: str
    namespace: str
    address: str
    cuts: list[str] = field(default_factory=list)  # the rules in place, for messages

    @property
    def run_in(self) -> list[str]:
        """The prefix that runs a command inside this node."""
        return ["ip", "netns", "exec", self.namespace]

    def nft(self, *args: str) -> None:
        _run("ip", "netns", "exec", self.namespace, "nft", *args)


class Network:
    """``with Network() as net``: ``net.add("db")`` is a node; leaving removes them all."""

    def __init__(self) -> None:
        self.tag = secrets.token_hex(2)
        self.hub = f"hs-{self.tag}-hub"
        self.nodes: dict[str, Node] = {}
        self._made: list[str] = []
        self._next = 2  # the next node's address (.1 is nobody's)

    def __enter__(self) -> Network:
        try:
            self._namespace(self.hub)
            _run("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", self.hub, "link", "set", "br0", "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for namespace in reversed(self._made):
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, check=False)
        self._made.clear()

    def _namespace(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._made.append(name)
        _run("ip", "-n", name, "link", "set", "lo", "up")

    def add(self, name: str) -> Node:
        if name in self.nodes:
            raise NetworkError(f"node {name!r} exists")
        index, self._next = self._next, self._next + 1
        if index > 254:
            raise NetworkError("no address left on the bridge")
        node = Node(name, f"hs-{self.tag}-{name}", f"{SUBNET}.{index}")
        self._namespace(node.namespace)
        # Interface names have at most 15 characters.
        inside, outside = f"h{self.tag}n{index}", f"h{self.tag}b{index}"
        _run("ip", "link", "add", inside, "type", "veth", "peer", "name", outside)
        _run("ip", "link", "set", inside, "netns", node.namespace)
        _run("ip", "link", "set", outside, "netns", self.hub)
        _run("ip", "-n", self.hub, "link", "set", outside, "master", "br0", "up")
        _run("ip", "-n", node.namespace, "addr", "add", f"{node.address}/24", "dev", inside)
        _run("ip", "-n", node.namespace, "link", "set", inside, "up")
        node.nft("add", "table", "inet", TABLE)
        for chain, hook in (("in", "input"), ("out", "output")):
            node.nft(
                "add", "chain", "inet", TABLE, chain, f"{{ type filter hook {hook} priority 0; }}"
            )
        self.nodes[name] = node
        return node

    def remove(self, node: Node) -> None:
        """Delete ``node``'s namespace (its processes have exited) and its link."""
        self.nodes.pop(node.name, None)
        if node.namespace in self._made:
            self._made.remove(node.namespace)
            subprocess.run(["ip", "netns", "del", node.namespace], capture_output=True, check=False)

    def cut(self, node: Node, *peers: Node, outgoing: bool = True, incoming: bool = True) -> None:
        """Drop what ``node`` sends to (``outgoing``) and receives from (``incoming``)
        each of ``peers``: both for a partition, one for a one-way cut."""
        for peer in peers:
            if outgoing:
                node.nft("add", "rule", "inet", TABLE, "out", "ip", "daddr", peer.address, "drop")
                node.cuts.append(f"{node.name} -> {peer.name}")
            if incoming:
                node.nft("add", "rule", "inet", TABLE, "in", "ip", "saddr", peer.address, "drop")
                node.cuts.append(f"{peer.name} -> {node.name}")

    def lossy(self, node: Node, peer: Node, percent: int) -> None:
        """Drop ``percent`` of the packets between ``node`` and ``peer``, each way."""
        if not 0 < percent < 100:
            raise ValueError("percent: between 1 and 99")
        for chain, direction in (("out", "daddr"), ("in", "saddr")):
            node.nft(
                "add",
                "rule",
                "inet",
                TABLE,
                chain,
                "ip",
                direction,
                peer.address,
                "numgen",
                "random",
                "mod",
                "100",
                "<",
                str(percent),
                "drop",
            )
        node.cuts.append(f"{node.name} <-> {peer.name} losing {percent}%")

    def heal(self, node: Node) -> None:
        for chain in ("in", "out"):
            node.nft("flush", "chain", "inet", TABLE, chain)
        node.cuts.clear()

    @contextlib.contextmanager
    def observe(self, node: Node) -> Iterator[None]:
        """Run the calling thread inside ``node`` (the sockets it makes meanwhile stay
        there), and back where it was at the end."""
        libc = ctypes.CDLL(None, use_errno=True)
        with (
            open("/proc/thread-self/ns/net") as home,
            open(f"/run/netns/{node.namespace}") as target,
        ):
            if libc.setns(target.fileno(), CLONE_NEWNET) != 0:
                raise NetworkError(
                    f"setns into {node.namespace}: {os.strerror(ctypes.get_errno())}"
                )
            try:
                yield
            finally:
                libc.setns(home.fileno(), CLONE_NEWNET)
