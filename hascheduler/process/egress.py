"""Outbound HTTP under the egress policy (core/egress.py): a client whose every connection
goes only to addresses the policy allows, checked on the addresses the name resolves to
at that moment (a name rebound to a private address is refused then), and for a URL
written with an address, on that address. Redirects are never followed."""

from __future__ import annotations

import socket

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import DefaultResolver

from hascheduler.core.egress import EgressPolicy, EgressRefused, address_of


class PolicyResolver(AbstractResolver):
    """Resolves as the system does, then keeps only the addresses the policy allows; none
    left is EgressRefused."""

    def __init__(self, policy: EgressPolicy) -> None:
        self.policy = policy
        self.resolver = DefaultResolver()

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        found = await self.resolver.resolve(host, port, family)
        allowed, refusals = [], []
        for result in found:
            address = address_of(result["host"])
            refusal = (
                "not an address" if address is None else self.policy.refusal(host, address, port)
            )
            if refusal is None:
                allowed.append(result)
            else:
                refusals.append(refusal)
        if not allowed:
            raise EgressRefused(refusals[0] if refusals else f"{host} resolves to no address")
        return allowed

    async def close(self) -> None:
        await self.resolver.close()


def egress_session(policy: EgressPolicy, timeout_s: float, limit: int) -> aiohttp.ClientSession:
    """An HTTP client that reaches only what ``policy`` allows (every name resolved anew,
    so that a change of its address is checked too)."""
    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=timeout_s),
        connector=aiohttp.TCPConnector(
            limit=limit, resolver=PolicyResolver(policy), use_dns_cache=False
        ),
    )
