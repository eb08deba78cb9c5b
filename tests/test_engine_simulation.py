"""Deterministic simulation of a three-node cluster of real engines under faults
(tests/sim/engine_cluster.py).

Real cores, replication roles, pair driver, coordinator (leases, failover, handoff) and engine
(group commit, held answers) on a virtual-time loop, the real membership layer (Raft core and
driver) over an in-memory network, in-memory peers and in-memory storage. Fixed seeds run in
CI plus fresh ones each run; a failure names the seed and the line that replays it.
"""
from __future__ import annotations

import asyncio
import collections
import os
import random
from collections.abc import Callable
from typing import TypeVar

import pytest

from replication.digest import EMPTY_DIGEST
from replication.invariants import (
    epochs_with_two_masters,
    history_disagreements,
    lost_acknowledged,
    seen_but_uncommitted,
)
from replication.leases import NodeLease
from replication.master import MasterRole, ReplicaProgress
from replication.messages import AppendAck, Open, OpenAck
from replication.operations import Operation
from replication.oplog import MemoryOpLog
from replication.options import QueueOptions, QueueState, Strength
from replication.queue_core import QueueCore, QueueRecord
from replication.store import MemoryStore
from tests.sim import hash_seed
from tests.sim.engine_cluster import CLOCK_DRIFT, LEASE_MS, NODES, QUEUE, EngineSimulation
from tests.sim.master_restart import (
    RECOVERY_MAX_MS,
    RESTARTS,
    MasterRestartSimulation,
    StaleMapRestartSimulation,
)
from tests.sim.virtual_loop import InlineExecutor, VirtualTimeLoop

FIXED_SEEDS = [1, 2, 3, 4, 5, 6]
FRESH_SEEDS = [random.Random(os.getpid()).randrange(10**9), random.Random(os.getpid() + 1).randrange(10**9)]


def check_safety(sim: EngineSimulation) -> None:
    assert not sim.broken, f"engines stopped on an error: {sim.broken}"
    history = sim.history
    master, replica = sim.final_master, sim.final_replica
    assert not history.acked_twice, f"one message id acknowledged for two payloads: {history.acked_twice[:5]}"
    # (A master's node that does not act as master at that moment, down or with its map not
    # replayed yet, answers otherwise: then there is nothing to win against.)
    replica_won = [asked for asked in history.simultaneous_handoffs
                   if asked.get("replica") == "ok" and asked.get("master") in ("E_HANDOFF_REFUSED", "ok")]
    assert not replica_won, f"the replica's handoff won, or won too, over the master's asked at the same moment: " \
                            f"{replica_won}"
    two = epochs_with_two_masters(history.masters_seen)
    assert not two, f"epochs with two masters: {two}"
    assert not history.two_acknowledging, \
        f"two nodes could acknowledge writes as master at once (ms, nodes): {history.two_acknowledging[:5]}"
    surviving = sim.surviving_payloads(master)
    acked = set(history.acked_enqueues)
    # A message with a time to live may be gone for that reason: every one's time has passed by
    # the end of the run. (Under `full` both members must still agree on which, below.)
    timed = {index for index, payload in (*surviving.items(), *history.acked_enqueues.items())
             if payload in history.with_ttl}
    lost = lost_acknowledged(acked, sim.held(master), history.ack_invoked | timed)
    assert not lost, f"acknowledged enqueues lost: {sorted(lost)[:10]}"
    # A master that took a snapshot holds the queue's state, not its history: messages consumed
    # (or expired) before it, anywhere under `producer`, are in no record of it.
    consumed_before = history.ack_invoked | timed if sim.installed_snapshots(master) else set()
    missing = acked - set(surviving) - consumed_before
    assert not missing, f"acknowledged enqueues missing from the master's history: {sorted(missing)[:10]}"
    replaced = sorted(i for i, payload in history.acked_enqueues.items() if i in surviving and surviving[i] != payload)
    assert not replaced, f"acknowledged ids that now hold another message: {replaced[:10]}"
    seen = seen_but_uncommitted((index for index, _ in history.delivered), surviving) - consumed_before
    assert not seen, f"delivered but never committed: {sorted(seen)[:10]}"
    other = sorted({index for index, payload in history.delivered if index in surviving and surviving[index] != payload})
    assert not other, f"delivered a message that was not the committed one at its id: {other[:10]}"
    # A delayed message is delivered no sooner than its delay after its enqueue was sent, on the
    # fastest clock of the run (each member times it from its own enqueue, apply or restart).
    early = [(payload, answered, history.delayed[payload]) for payload, answered in history.answered_at
             if payload in history.delayed
             and answered < history.delayed[payload][0] + history.delayed[payload][1] / (1 + sim.clock_drift) - 2]
    assert not early, f"delayed messages delivered early (payload, answered, (sent, delay)): {early[:5]}"
    if sim.strength is Strength.FULL:
        assert sim.held(master) == sim.held(replica), "under full both members hold the same messages"
        # An acknowledged ack is replicated like an enqueue: the message is gone for good.
        back = history.consumed & sim.held(master)
        assert not back, f"messages whose ack was acknowledged are held again: {sorted(back)[:10]}"
        early = leases_expired_early(sim)
        assert not early, f"leases that ended before their duration (id, sent, answered, duration, " \
                          f"redelivered): {early[:5]}"
    else:
        # Each member keeps its own consumption state: what the replica lacks was consumed there
        # (or, if it took a snapshot, anywhere: a snapshot carries the master's live messages).
        absent = set(surviving) - sim.held(replica) - history.ack_invoked - timed
        assert not absent, f"the replica lacks committed enqueues: {sorted(absent)[:10]}"


def leases_expired_early(sim: EngineSimulation) -> list[tuple[int, int, int, int, int]]:
    """Under `full` a lease is replicated as a duration and timed on the serving member's
    monotonic clock; a member that inherits it (a takeover, a restart) times it from then.
    So a message is delivered again no sooner than a lease's duration after that lease was
    asked for, on the fastest clock of the run, whatever the wall clocks (skewed between
    nodes, stepped during the run) said. A lease is granted between its receive's send and
    its answer, and answers may arrive out of order (one held through a pause): only a lease
    answered before another was asked for is surely the earlier one."""
    early = []
    by_message: dict[int, list[tuple[int, int, int, int]]] = {}
    for lease in sim.history.leases:
        by_message.setdefault(lease[0], []).append(lease)
    for leases in by_message.values():
        for before in leases:
            for after in leases:
                if before[2] < after[1] and after[2] < before[1] + before[3] / (1 + sim.clock_drift) - 2:
                    early.append((*before, after[2]))
    return early


def check_converged(sim: EngineSimulation) -> None:
    entry = sim.final_entry
    assert entry is not None
    master, replica = sim.final[entry.master], sim.final[entry.replica]
    assert entry.in_sync, f"the map never recorded the replica in sync again: {entry}"
    assert master["master_status"] == "master" and master["epoch"] == entry.epoch, f"no master: {master}"
    assert replica["replication_state"] == "following", f"replica never caught up: {replica}"
    assert master["commit_order"] == master["last_order"], f"the master did not commit everything: {master}"
    assert (replica["last_order"], replica["digest"]) == (master["last_order"], master["digest"]), \
        f"the members' digests differ: {master} {replica}"
    # Each member truncates its log on its own schedule: where both still hold an order, it is the same.
    start = max(sim.members[node].storage.first(sim.queue_id(node)) for node in (entry.master, entry.replica))
    master_rows = [row for row in sim.oplog_rows(entry.master) if row[0] > start]
    replica_rows = [row for row in sim.oplog_rows(entry.replica) if row[0] > start]
    assert not history_disagreements(master_rows, replica_rows)
    assert [row[:2] for row in master_rows] == [row[:2] for row in replica_rows], "op logs hold other orders"
    for node_id in set(NODES) - {entry.master, entry.replica}:
        assert sim.members[node_id].storage.queue_id(QUEUE) is None, f"{node_id} kept an instance it left"


def run_checked(seed: int, strength: Strength, clock_drift: float = CLOCK_DRIFT,
                ttl_share: float = 0.0) -> EngineSimulation:
    sim = EngineSimulation(seed, strength, clock_drift, ttl_share)
    return judged(sim, lambda: f"seed {seed} ({strength.value}) fails: replay with {hash_seed()} "
                               f"EngineSimulation({seed}, Strength.{strength.name}, {clock_drift}, {ttl_share}).run(); "
                               f"faults {sim.log}")


Simulated = TypeVar("Simulated", bound=EngineSimulation)


def judged(sim: Simulated, replay: Callable[[], str]) -> Simulated:
    """Run `sim` and judge it with the checkers above; a failure begins with `replay()`, the
    line that replays it (read after the run: it may name what the run did)."""
    try:
        sim.run()
        assert not sim.broken, f"engines stopped on an error: {sim.broken}"
        assert sim.history.acked_enqueues, "the workload never got an enqueue acknowledged"
        check_safety(sim)
        check_converged(sim)
    except AssertionError as failure:
        raise AssertionError(f"{replay()}\n{failure}") from None
    return sim


@pytest.mark.timeout(60)
@pytest.mark.parametrize("strength", [Strength.FULL, Strength.PRODUCER])
@pytest.mark.parametrize("seed", FIXED_SEEDS + FRESH_SEEDS)
def test_a_cluster_of_engines_under_faults_loses_nothing_acknowledged_and_converges(seed: int,
                                                                                    strength: Strength) -> None:
    run_checked(seed, strength)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("strength", [Strength.FULL, Strength.PRODUCER])
@pytest.mark.parametrize("seed", FIXED_SEEDS[:4])
def test_timed_messages_expire_and_mature_under_faults_and_the_members_agree(seed: int, strength: Strength) -> None:
    """A third of the enqueues carry a time to live of 150 ms or 1.5 s, a third a delivery delay
    of 100 or 800 ms (issue 14, items 6 and 7): expiries and maturities are decided by whichever
    node is master through failovers, handoffs, crashes and stepped clocks, and the checks above
    still hold: nothing acknowledged is lost but what expired, no delayed message is delivered
    early, and under `full` both members hold the same."""
    sim = run_checked(seed, strength, ttl_share=0.3)
    history = sim.history
    timed = {index for index, payload in history.acked_enqueues.items() if payload in history.with_ttl}
    expired = timed - sim.held(sim.final_master) - history.ack_invoked
    assert timed and expired, "no message expired: the run did not exercise time to live"
    assert any(payload in history.delayed for payload, _ in history.answered_at), "no delayed message was delivered"


# Seeds that failed before a fix, each kept as a replay of what it found.
REGRESSIONS = [
    pytest.param(2, Strength.FULL, id="a-replica-ignores-a-refusal-of-what-it-sent-as-master-2-full"),
    pytest.param(4, Strength.PRODUCER, id="a-replica-ignores-a-refusal-of-what-it-sent-as-master-4-producer"),
    pytest.param(20, Strength.FULL, id="a-core-without-a-role-decides-no-expiry-20-full"),
    pytest.param(147, Strength.FULL, id="a-core-without-a-role-decides-no-expiry-147-full"),
    pytest.param(118, Strength.FULL, id="the-membership-twin-elects-a-leader-when-a-majority-is-back-118-full"),
    pytest.param(40, Strength.PRODUCER, id="the-membership-twin-elects-a-leader-when-a-majority-is-back-40-producer"),
    pytest.param(58, Strength.FULL, id="a-node-that-left-the-pair-never-answers-success-for-it-58-full"),
    pytest.param(217, Strength.PRODUCER, id="answers-in-flight-past-a-deposed-masters-commit-are-unknown-217-producer"),
    pytest.param(250, Strength.FULL, id="a-deposed-master-counts-its-unstreamed-operations-250-full"),
    pytest.param(276, Strength.FULL, id="a-deposed-master-counts-its-unstreamed-operations-276-full"),
    # QueueCore.apply(Released) of a message whose ready page was not loaded since a restart
    # left it twice in the ready heap; the copy left after the next Leased/Acked was leased
    # again once the member mastered the queue.
    pytest.param(145, Strength.FULL, id="a-released-message-on-an-unloaded-page-is-not-ready-twice-145-full"),
    pytest.param(43, Strength.FULL, id="a-released-message-on-an-unloaded-page-is-not-ready-twice-43-full"),
    # Found once every commit ran on the writer thread. A deposed master's commit under way
    # finished while its replica role was opening: its ack told the new master, in the new
    # session, that it held its diverged suffix, and the snapshot counted as installed.
    pytest.param(313170479, Strength.FULL, id="a-replica-acks-nothing-while-it-opens-313170479-full"),
    # An answer held for an index past the commit point of a master deposed by a handoff was
    # released against the new master's commit point, which gave that index to another message.
    pytest.param(334968335, Strength.PRODUCER,
                 id="held-answers-past-a-handed-off-masters-commit-are-unknown-334968335-producer"),
    # Found once the simulation ran the real Raft core: a master deposed by a handoff crashed,
    # came back as the replica the map counted in sync, and dropped what lay past its record's
    # commit point (an index it had acknowledged itself); promoted again before it caught up,
    # it gave that index to another message.
    pytest.param(2092, Strength.PRODUCER, id="a-handed-off-master-keeps-its-acknowledged-suffix-2092-producer"),
]


# Found on drifting clocks (the check that no two nodes could acknowledge as master at once).
DRIFTING_REGRESSIONS = [
    # A node restarted while the leader's failover of its queues was still uncommitted got a
    # lease granted against the leader's applied map and acted as master in its old epoch
    # until it applied the failover (LeaseGrant.map_version now counts the leader's log).
    pytest.param(2093, Strength.PRODUCER, id="a-lease-counts-from-the-leaders-uncommitted-failover-2093-producer"),
    # The checker's own defect: a master refused because its replica was out of sync is no
    # contest with the replica's request asked at the same moment, which waits at the master
    # and succeeds once the replica is in sync.
    pytest.param(3164, Strength.PRODUCER, id="a-master-refused-for-an-out-of-sync-replica-is-no-contest-3164-producer"),
    # The membership leader, paused with its disk, resumed and granted itself a node lease
    # before its Raft core was fed the ticks it had missed; another node mastered its queue
    # already (RaftMembership.is_leader counts the ticks the core has not seen).
    pytest.param(500012, Strength.PRODUCER, id="a-resumed-leader-counts-the-ticks-it-missed-500012-producer"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("seed", "strength"), REGRESSIONS)
def test_a_seed_that_found_a_bug_passes(seed: int, strength: Strength) -> None:
    run_checked(seed, strength, clock_drift=0.0)     # the clocks they were found with


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("seed", "strength"), DRIFTING_REGRESSIONS)
def test_a_seed_that_found_a_bug_on_drifting_clocks_passes(seed: int, strength: Strength) -> None:
    run_checked(seed, strength)


@pytest.mark.timeout(60)
def test_the_fixed_seeds_go_through_failovers_and_handoffs() -> None:
    """The faults are not idle: over the fixed seeds the queue changed master both ways."""
    changes: collections.Counter[str] = collections.Counter()
    for seed in FIXED_SEEDS:
        for strength in Strength:
            changes.update(EngineSimulation(seed, strength).run().pair_changes())
    assert changes["failover"] >= 2 and changes["handoff"] >= 2, changes


@pytest.mark.timeout(60)
def test_the_check_of_one_acknowledging_master_catches_a_master_that_ignores_its_lease(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The check is not idle: a master that goes on past its lease (on clocks that drift) is
    seen acknowledging while the master promoted after it does too."""
    monkeypatch.setattr(NodeLease, "valid", lambda self, now_ms: True)
    # Whether a seed's run catches it depends on the timing the hash seed gives set iteration
    # (PYTHONHASHSEED 1 caught it in one of the first 12 seeds, in 23 of the first 60): seeds
    # are tried until two caught it, within a bound.
    caught: list[int] = []
    for seed in range(SEEDS_TO_CATCH_MAX):
        if EngineSimulation(seed, Strength.PRODUCER).run().history.two_acknowledging:
            caught.append(seed)
            if len(caught) == 2:
                return
    raise AssertionError(f"only seeds {caught} of the first {SEEDS_TO_CATCH_MAX} caught it")


SEEDS_TO_CATCH_MAX = 40


@pytest.mark.timeout(30)
def test_the_same_seed_replays_the_same_run() -> None:
    first = EngineSimulation(3, Strength.FULL).run()
    second = EngineSimulation(3, Strength.FULL).run()
    assert first.log == second.log
    assert first.history == second.history
    assert [node.map_commands for node in first.members.values()] == \
        [node.map_commands for node in second.members.values()]
    assert first.oplog_rows(first.final_master) == second.oplog_rows(second.final_master)


def test_the_virtual_loop_jumps_over_idle_time_and_the_inline_executor_commits_at_once() -> None:
    loop = VirtualTimeLoop()
    try:
        async def main() -> float:
            value = await loop.run_in_executor(InlineExecutor(), lambda: 42)
            assert value == 42
            await asyncio.sleep(3600)
            return loop.time()
        assert loop.run_until_complete(main()) == pytest.approx(3600.0)
    finally:
        loop.close()


# --- a master restarted inside its lease (issue 40, item 2; docs/PROTOCOL.md) ----------------
Restarts = TypeVar("Restarts", bound=MasterRestartSimulation)


def run_restarts_checked(kind: type[Restarts], seed: int, strength: Strength) -> Restarts:
    """Run a restart scenario (tests/sim/master_restart.py) and judge it with the checkers
    above; a failure names the line that replays it and what each restart did."""
    sim = kind(seed, strength)
    return judged(sim, lambda: f"seed {seed} ({strength.value}) fails: replay with {hash_seed()} "
                               f"{kind.__name__}({seed}, Strength.{strength.name}).run(); restarts "
                               f"{[restart.describe() for restart in sim.restarts]}; events {sim.log}")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("strength", [Strength.FULL, Strength.PRODUCER])
@pytest.mark.parametrize("seed", FIXED_SEEDS[:4] + FRESH_SEEDS)
def test_a_master_restarted_inside_its_lease_resumes_in_a_new_epoch_loses_nothing_and_takes_writes_again_soon(
        seed: int, strength: Strength) -> None:
    """The master's node is killed six times, at any moment, right after a batch of the queue
    was written (before the replica's acknowledgement counts) and right before (the replica
    may hold what the master loses), and comes back after less than the lease, under steady
    enqueues, receives and acks. Nothing acknowledged is lost, no epoch has two masters, the
    journals agree; writes are acknowledged again within RECOVERY_MAX_MS of each restart, and
    never in the epoch the master restarted in: one that kept its role serves in the next one
    (its replica may hold orders of the old epoch that the master lost)."""
    sim = run_restarts_checked(MasterRestartSimulation, seed, strength)
    restarts = sim.restarts
    described = [restart.describe() for restart in restarts]
    replay = f"replay with {hash_seed()} MasterRestartSimulation({seed}, Strength.{strength.name}).run()"
    assert len(restarts) == RESTARTS, described
    assert all(restart.down_ms < LEASE_MS for restart in restarts), described
    slow = [restart.describe() for restart in restarts
            if restart.recovery_ms is None or restart.recovery_ms > RECOVERY_MAX_MS]
    assert not slow, f"seed {seed} ({strength.value}): writes not acknowledged again within {RECOVERY_MAX_MS} ms " \
                     f"of a restart: {slow}; {replay}"
    assert not any(restart.resumed_at_same_epoch for restart in restarts), \
        f"a restarted master served again in the epoch it restarted in: {described}; {replay}"
    assert any(restart.master_after == restart.node and restart.epoch_after == restart.epoch + 1
               for restart in restarts), f"no restart kept its role (each was failed over): {described}; {replay}"
    assert {"after persist", "before persist"} <= {restart.moment for restart in restarts}, \
        f"the kills around a commit never found their batch: {described}"


@pytest.mark.timeout(60)
def test_a_snapshot_installed_as_a_new_epoch_begins_is_served_by_the_replica() -> None:
    """Found by seed 480194086 (full) in a clean-clone CI run: the restarted master, still in
    its old epoch, sent its replica a snapshot (the replica held an order it had lost); the
    epoch the restart asked for began while the install was being written, and the replica's
    new role skipped serving what storage held, so its core lacked the snapshot's leases and
    stopped on the first release of one."""
    run_restarts_checked(MasterRestartSimulation, 480194086, Strength.FULL)


STALE_MAP_SEEDS = list(range(1, 7))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strength", [Strength.FULL, Strength.PRODUCER])
def test_a_master_restarted_on_a_map_behind_the_leaders_offers_nothing_a_failover_in_parallel_takes_back(
        strength: Strength) -> None:
    """The master is killed right after a write its replica never received, between the
    leader's record of the replica as in sync and its own copy of that record; it comes back
    inside its lease but cut off, so the leader fails it over meanwhile, and a consumer at the
    restarted node receives everything it offers. Nothing it delivers may be taken back."""
    hits = sum(run_restarts_checked(StaleMapRestartSimulation, seed, strength).hits for seed in STALE_MAP_SEEDS)
    assert hits, f"no kill of seeds {STALE_MAP_SEEDS} came back in the window"


# --- bugs this simulation found, kept as scenarios ------------------------------------------
def test_a_master_acknowledging_alone_records_its_replica_in_sync_only_once_it_holds_every_acknowledged_index() -> None:
    """Found by seed 42 (full) while the simulated links still reordered messages: a master in
    degraded mode acknowledged live operations during a transfer; the replica's OpenAck for
    the transfer's end arrived before it held them, the master recorded it in sync at once,
    and the failover that followed promoted a replica without them. The record must wait
    until the replica holds every acknowledged index."""
    store, oplog = MemoryStore(), MemoryOpLog(EMPTY_DIGEST)
    core = QueueCore(QueueRecord(1, QUEUE, QueueOptions(strength=Strength.FULL), 0, state=QueueState.OPEN), store,
                     random.Random(1), lease_clock=lambda: 0)
    role = MasterRole(core, oplog, node_id="n1", replica_id="n2", epoch=2, incarnation=1, recorded_in_sync=False,
                      last_order=0, digest=EMPTY_DIGEST)

    def acknowledge_alone(count: int, now_ms: int) -> None:
        ops: list[Operation] = []
        for _ in range(count):
            core.enqueue(b"m", 4, None, "producer", now_ms, ops)
        store.apply(ops)
        role.replicate(ops, now_ms)
        for row in role.to_log:
            oplog.append(1, row.ops, row.digest, row.encoded)
        role.to_log.clear()
        role.local_durable_to(role.last_order, now_ms)

    acknowledge_alone(3, 0)
    role.receive(Open(QUEUE, 1, 2, 1, 0, EMPTY_DIGEST, session=7), 10)      # the transfer ends at 3
    acknowledge_alone(2, 11)                                                 # live, answered alone
    assert role.commit_order == 5
    role.receive(AppendAck(QUEUE, 1, 2, 0, 3, session=7), 12)
    role.receive(OpenAck(QUEUE, 1, 2, 3, session=7), 13)
    assert role.progress is ReplicaProgress.CAUGHT_UP
    assert not role.proposals, "recorded in sync while the replica lacks acknowledged indices 4 and 5"
    role.receive(AppendAck(QUEUE, 1, 2, 0, 5, session=7), 14)
    role.tick(15)
    assert [proposal.in_sync for proposal in role.proposals] == [True]
