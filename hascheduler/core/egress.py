"""The egress policy: where the product may send what it sends out (webhooks now). By
default only to globally routable addresses: never loopback, link-local (the cloud's
metadata service among them), private, shared or unique-local ranges, multicast, the
unspecified or reserved ones, nor the replica's own listeners. An operator allows named
hosts or ranges (``serve --egress-allow``); the replica's own listeners stay refused.

The rule is asked of every address a name resolves to at send time (process/egress.py),
so a name that resolves elsewhere later (DNS rebinding) is refused then; and of a URL's
host when it is written, where it is an address in any spelling (``127.1``,
``2130706433``, ``0x7f.0.0.1``, ``[::ffff:127.0.0.1]``) or a ``localhost`` name.
"""

from __future__ import annotations

import ipaddress
import re
import socket
import urllib.parse
from dataclasses import dataclass, field

from hascheduler.core.errors import ConfigError

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

SCHEMES = ("http", "https")
# A host name as the setting takes it: DNS labels, lowercase.
_HOST = re.compile(
    r"(?=.{1,253}$)([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*"
)
# What inet_aton reads as an IPv4 address: digits, hex and octal parts, dotted.
_LEGACY_IPV4 = re.compile(r"(0x[0-9a-f]+|[0-9]+)(\.(0x[0-9a-f]+|[0-9]+)){0,3}")


class EgressRefused(OSError):
    """An address the egress policy refuses (an OSError: a connection that could not be
    made, as the HTTP client reports it)."""


def address_of(host: str) -> Address | None:
    """``host`` as an address when it is one in any spelling (bracketed IPv6, IPv4 in
    inet_aton's forms), else None: a name, resolved at send time."""
    text = host.strip("[]").lower()
    try:
        return ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        pass
    if _LEGACY_IPV4.fullmatch(text):
        try:
            return ipaddress.IPv4Address(socket.inet_aton(text))
        except OSError:
            return None
    return None


def _kind(address: Address) -> str | None:
    """What makes ``address`` one the policy refuses by default, or None."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return _kind(address.ipv4_mapped)
    for name, flag in (
        ("a loopback", address.is_loopback),
        ("a link-local", address.is_link_local),
        ("an unspecified", address.is_unspecified),
        ("a multicast", address.is_multicast),
        ("a private", address.is_private),
        ("a reserved", address.is_reserved),
    ):
        if flag:
            return f"{name} address"
    if not address.is_global:
        return "an address that is not globally routable"
    return None


@dataclass(frozen=True)
class EgressPolicy:
    """Which addresses an outbound call may reach: every globally routable one, plus what
    the operator allows; never one of ``own`` (address, port) listeners."""

    allowed_networks: tuple[Network, ...] = ()
    allowed_hosts: frozenset[str] = frozenset()
    own: frozenset[tuple[Address | None, int]] = field(default_factory=frozenset)

    @classmethod
    def parse(cls, text: str | None) -> EgressPolicy:
        """``serve --egress-allow``: comma-separated ranges (``10.1.0.0/16``, an address)
        and host names (``hooks.internal``). Raises ConfigError naming the bad part."""
        networks: list[Network] = []
        hosts: set[str] = set()
        for part in (p.strip() for p in (text or "").split(",")):
            if not part:
                continue
            try:
                networks.append(ipaddress.ip_network(part, strict=False))
                continue
            except ValueError:
                pass
            if not _HOST.fullmatch(part.lower()):
                raise ConfigError(
                    f"{part!r} is neither an address range (10.0.0.0/8) nor a host name"
                )
            hosts.add(part.lower().rstrip("."))
        return cls(tuple(networks), frozenset(hosts))

    def listening(self, address: Address | None, port: int) -> EgressPolicy:
        """This policy, refusing also this replica's listener (``address`` None: every
        address of the machine)."""
        return EgressPolicy(self.allowed_networks, self.allowed_hosts, self.own | {(address, port)})

    def _own(self, address: Address, port: int) -> bool:
        return any(port == p and (a is None or a == address) for a, p in self.own)

    def refusal(self, host: str, address: Address, port: int) -> str | None:
        """Why a call to ``host`` (as the URL names it) at ``address``:``port`` is refused,
        or None when it may go."""
        if self._own(address, port):
            return f"{address} port {port} is this replica's own listener"
        kind = _kind(address)
        if kind is None:
            return None
        if host.lower().rstrip(".") in self.allowed_hosts or any(
            address in network for network in self.allowed_networks
        ):
            return None
        return f"{address} is {kind}: the egress policy refuses it (serve --egress-allow)"

    def url_refusal(self, url: str) -> str | None:
        """Why ``url`` can never be called (its scheme, a refused address written in it,
        a localhost name), or None: a name is resolved, and checked, at send time."""
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in SCHEMES or not parts.hostname:
            return "an http:// or https:// URL with a host"
        host = parts.hostname
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            return "the port is not a number from 0 to 65535"
        address = address_of(host)
        if address is not None:
            return self.refusal(host, address, port)
        name = host.lower().rstrip(".")
        if (name == "localhost" or name.endswith(".localhost")) and name not in self.allowed_hosts:
            return f"{host} is a loopback name: the egress policy refuses it (serve --egress-allow)"
        return None


def shown_url(url: str) -> str:
    """``url`` as it is shown back: a password in it never is."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    user = urllib.parse.quote(parts.username or "", safe="")
    host = parts.netloc.rpartition("@")[2]
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


# The default: public addresses only.
PUBLIC_ONLY = EgressPolicy()
