"""One adapter over PyMongo's async API and Motor, so each scenario runs with both."""

from __future__ import annotations

from typing import Any

from motor.motor_asyncio import AsyncIOMotorClient
from pymongo import AsyncMongoClient


class Driver:
    name = "?"

    def client(self, uri: str, **options: Any) -> Any:
        raise NotImplementedError

    async def watch(
        self, target: Any, pipeline: list[dict[str, Any]] | None = None, **options: Any
    ) -> Any:
        raise NotImplementedError

    async def aggregate(self, coll: Any, pipeline: list[dict[str, Any]]) -> list[Any]:
        raise NotImplementedError

    async def close(self, client: Any) -> None:
        raise NotImplementedError

    async def list_indexes(self, coll: Any) -> list[Any]:
        raise NotImplementedError

    async def start_session(self, client: Any) -> Any:
        raise NotImplementedError

    async def start_transaction(self, session: Any) -> None:
        raise NotImplementedError

    async def end_session(self, session: Any) -> None:
        raise NotImplementedError


class PyMongoAsync(Driver):
    name = "pymongo"

    def client(self, uri: str, **options: Any) -> Any:
        options.setdefault("serverSelectionTimeoutMS", 10_000)
        return AsyncMongoClient(uri, **options)

    async def watch(
        self, target: Any, pipeline: list[dict[str, Any]] | None = None, **options: Any
    ) -> Any:
        return await target.watch(pipeline, **options)

    async def aggregate(self, coll: Any, pipeline: list[dict[str, Any]]) -> list[Any]:
        cursor = await coll.aggregate(pipeline)
        return [d async for d in cursor]

    async def close(self, client: Any) -> None:
        await client.close()

    async def list_indexes(self, coll: Any) -> list[Any]:
        return [i async for i in await coll.list_indexes()]

    async def start_session(self, client: Any) -> Any:
        return client.start_session()

    async def start_transaction(self, session: Any) -> None:
        await session.start_transaction()

    async def end_session(self, session: Any) -> None:
        await session.end_session()


class Motor(Driver):
    name = "motor"

    def client(self, uri: str, **options: Any) -> Any:
        options.setdefault("serverSelectionTimeoutMS", 10_000)
        return AsyncIOMotorClient(uri, **options)

    async def watch(
        self, target: Any, pipeline: list[dict[str, Any]] | None = None, **options: Any
    ) -> Any:
        stream = target.watch(pipeline, **options)
        # Motor opens the cursor lazily; open it now so the start point is fixed here,
        # as PyMongo's awaitable watch() does.
        return await stream.__aenter__()

    async def aggregate(self, coll: Any, pipeline: list[dict[str, Any]]) -> list[Any]:
        return [d async for d in coll.aggregate(pipeline)]

    async def close(self, client: Any) -> None:
        client.close()

    async def list_indexes(self, coll: Any) -> list[Any]:
        return [i async for i in coll.list_indexes()]

    async def start_session(self, client: Any) -> Any:
        return await client.start_session()

    async def start_transaction(self, session: Any) -> None:
        session.start_transaction()

    async def end_session(self, session: Any) -> None:
        await session.end_session()


DRIVERS: dict[str, Driver] = {"pymongo": PyMongoAsync(), "motor": Motor()}
