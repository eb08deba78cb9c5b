"""The order of one batch (qserver/core/pipeline.py): the operations a turn decided go to the
replicas, then to this node's disk, and only then are their answers given; an answer about a
replicated operation waits further for the pair's commit point. The engine is built with fakes
of its cluster side (tests/sim/fakes.py) on in-memory storage."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from qserver.config import NodeConfig
from qserver.core import commands as c
from qserver.core.engine import Engine
from qserver.storage.lmdb_store import CommitResult, SealedBatch
from replication.operations import Operation
from replication.queue_core import QueueCore
from tests.sim.fakes import FakePairs, FakeRelay
from tests.sim.memory_storage import MemoryStorage


class RecordingStorage(MemoryStorage):
    def __init__(self, events: list[Any]) -> None:
        super().__init__("n1")
        self.events = events

    def commit(self, sealed: SealedBatch) -> CommitResult:
        self.events.append(("persist", len(sealed.operations)))
        return super().commit(sealed)


class RecordingPairs(FakePairs):
    """Streams nothing, but says when; holds answers for `required` when asked to."""

    def __init__(self, events: list[Any], *, clustered: bool = False, required: int = 0) -> None:
        super().__init__(clustered=clustered)
        self.events = events
        self.required = required
        self.held: list[Any] = []

    def before_commit(self, operations: list[Operation], oplog_rows: list[tuple[int, int, int, bytes, bytes]],
                      mono_ms: int, touched: dict[str, QueueCore]) -> None:
        self.events.append(("send", len(operations)))

    def replicated_order(self, core: QueueCore, ops: list[Operation]) -> int:
        return self.required if ops else 0

    def hold(self, name: str, required_order: int, release: Any, refuse: Any = None, *, write: bool = False) -> bool:
        if not self.required:
            return False
        self.events.append(("held", name, required_order, write))
        self.held.append(release)
        return True


async def started(pairs: RecordingPairs, storage: RecordingStorage) -> Engine[Any, Any]:
    engine: Engine[Any, Any] = Engine(NodeConfig(), storage)      # type: ignore[arg-type]
    engine.connect(pairs, None, FakeRelay())
    await engine.start()
    return engine


@pytest.mark.asyncio
async def test_a_batch_goes_to_the_replicas_then_to_disk_then_its_answer_goes_out() -> None:
    events: list[Any] = []
    engine = await started(RecordingPairs(events), RecordingStorage(events))
    await engine.call(lambda r: c.CreateQueue("jobs", {}, {}, r))
    events.clear()
    answer = await engine.call(lambda r: c.Enqueue("jobs", b"x", 4, None, "test", r))
    events.append("answer")
    assert answer[0] == 1
    assert events == [("send", 1), ("persist", 1), "answer"]
    await engine.stop()


@pytest.mark.asyncio
async def test_the_answer_about_a_replicated_enqueue_waits_for_the_pairs_commit_point() -> None:
    events: list[Any] = []
    pairs = RecordingPairs(events)
    engine = await started(pairs, RecordingStorage(events))
    await engine.call(lambda r: c.CreateQueue("jobs", {}, {}, r))
    pairs.clustered, pairs.required = True, 1
    pairs.masters["jobs"] = SimpleNamespace(core=engine.cores["jobs"])     # type: ignore[assignment]
    events.clear()
    replier = c.FutureReplier()
    engine.submit(c.Enqueue("jobs", b"x", 4, None, "test", replier))
    while not pairs.held:
        await engine.call(lambda r: c.Invoke(lambda now_ms: r.reply(0, None)))     # a turn goes by
    assert events == [("send", 1), ("persist", 1), ("held", "jobs", 1, True)]
    assert not replier.future.done()
    pairs.held.pop()()                          # the replica acknowledged: the pair releases it
    assert (await replier.future)[0] == 1
    await engine.stop()
