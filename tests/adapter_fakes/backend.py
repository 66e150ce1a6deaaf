"""The kvmesh mocker as the model behind a fake engine API."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from kvmesh.runtime.kv_events import CachedBlock, KvEventKind, KvEventRecord
from kvmesh.runtime.types import EngineOutput, EngineRequest, LoadInfo
from kvmesh.workers.engine import RequestHandle
from kvmesh.workers.mocker import MockerConfig, MockerEngine

VOCAB = 1000
SPECIAL = (0, 1)
EOS = (2,)


class Stream:
    """One request's EngineOutputs as an async iterator (an OutputSink for the mocker)."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[EngineOutput | BaseException] = asyncio.Queue()
        self.handle: RequestHandle | None = None

    def output(self, out: EngineOutput) -> None:
        self.queue.put_nowait(out)

    def fail(self, exc: BaseException) -> None:
        self.queue.put_nowait(exc)

    def cancel(self) -> None:
        if self.handle is not None:
            self.handle.cancel()

    def __aiter__(self) -> Stream:
        return self

    async def __anext__(self) -> EngineOutput:
        item = await self.queue.get()
        if isinstance(item, BaseException):
            raise item
        return item


class Backend:
    """A started-on-demand mocker: requests in, EngineOutputs out, cache changes as events."""

    def __init__(
        self,
        *,
        block_size: int = 16,
        num_blocks: int = 256,
        context_length: int = 1024,
        prefix_caching: bool = True,
        speedup_ratio: float = 1e6,
    ) -> None:
        self.mocker = MockerEngine(
            MockerConfig(
                num_gpu_blocks=num_blocks,
                block_size=block_size,
                speedup_ratio=speedup_ratio,
                enable_prefix_caching=prefix_caching,
            ),
            served_model_name="fake",
            vocab_size=VOCAB,
            special_token_ids=SPECIAL,
            eos_token_ids=EOS,
            context_length=context_length,
        )
        self.started = False

    async def ensure_started(self) -> None:
        if not self.started:
            self.started = True
            await self.mocker.start()

    def submit(self, request: EngineRequest) -> Stream:
        stream = Stream()
        stream.handle = self.mocker.submit(request, stream)
        return stream

    def load(self) -> LoadInfo:
        return self.mocker.load()

    def cached_blocks(self) -> dict[int, CachedBlock]:
        return self.mocker.cached_blocks()

    async def events(self) -> AsyncIterator[KvEventKind]:
        """The mocker's cache changes from now on (after its initial, empty snapshot)."""
        log = self.mocker.kv_events
        assert log is not None
        async for item in log.subscribe(None):
            if isinstance(item, KvEventRecord):
                yield item.kind
            else:  # the snapshot (empty when subscribed before the first request)
                for chain in item.chains:
                    yield chain

    async def stop(self) -> None:
        if self.started:
            self.started = False
            await self.mocker.stop()
