"""The local cluster's front door: one address that stays while replicas come and go (a
killed leader, a scale). Every request is forwarded to a live replica, the first that
answers: the dashboard URL ``dev`` prints keeps working across leader kills and scaling."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import aiohttp
from aiohttp import web

# What a request carries to a replica, and what of its answer comes back.
FORWARDED = ("Authorization", "Content-Type", "If-Match", "X-Reason", "Idempotency-Key")
RETURNED = ("Content-Type", "ETag", "Location", "Retry-After", "WWW-Authenticate")
TIMEOUT_S = 10.0
HTTP = web.AppKey("http", aiohttp.ClientSession)


def front_app(replicas: Callable[[], list[str]], headers: dict[str, str]) -> web.Application:
    """Forward every request to the first of ``replicas()`` (their base URLs) that
    answers; 503 when none does."""
    app = web.Application()

    async def session(app: web.Application) -> AsyncIterator[None]:
        app[HTTP] = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=TIMEOUT_S), headers=headers
        )
        yield
        await app[HTTP].close()

    async def forward(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        sent = {k: v for k in FORWARDED if (v := request.headers.get(k)) is not None}
        http = request.app[HTTP]
        for base in replicas():
            try:
                async with http.request(
                    request.method,
                    base + request.path_qs,
                    data=body or None,
                    headers=sent,
                    allow_redirects=False,
                ) as answer:
                    payload = await answer.read()
                    kept = {k: v for k in RETURNED if (v := answer.headers.get(k)) is not None}
                    return web.Response(status=answer.status, body=payload, headers=kept)
            except (aiohttp.ClientError, TimeoutError):
                continue  # gone meanwhile: the next
        return web.Response(status=503, text="no replica of the local cluster answers")

    app.cleanup_ctx.append(session)
    app.router.add_route("*", "/{tail:.*}", forward)
    return app
