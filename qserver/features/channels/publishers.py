"""A channel's publishers at its master (seed 002 advertise/unadvertise; issue 37 item 11): the
connections that advertised it, in order, and which one leads.

The seed lets several instances of an application advertise one channel for fault tolerance,
one producing at a time: "a leader instance periodically announces the channels it is
producing ... the leader will override secondary instance announcement and subscribers will
sooner or later end up getting their data from the leader". Here the leader is the connection
that advertised with `leader` most recently while still advertising (the override). While one
leads, a publish from any other advertiser is a standby's: it is refused (E_STANDBY), neither
stored nor sent, so subscribers get the leader's data only. While none leads (none claimed it,
or the leader withdrew or its connection went) every advertiser publishes, as before release
0.3.0: an application of 0.2.0 with several publishers on one channel keeps working through the
upgrade, and the standbys of a leader that died go on publishing until one claims the lead.

Pure bookkeeping (connections are opaque keys): the hub calls it, tests/test_channel_publishers.py
runs it deterministically.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ADVERTISERS_PER_CHANNEL_MAX = 64         # connections advertising one channel at its master


@dataclass(slots=True)
class ChannelPublishers:
    """One channel's advertising connections and its override (the leader)."""
    advertisers: dict[Any, None] = field(default_factory=dict)
    override: Any | None = None

    def leader(self) -> Any | None:
        return self.override if self.override is not None and self.override in self.advertisers else None


class Publishers:
    def __init__(self) -> None:
        self.channels: dict[str, ChannelPublishers] = {}

    def advertise(self, channel: str, connection: Any, *, leader: bool = False) -> bool:
        """False when the channel has the most advertisers it may have (nothing changed)."""
        publishers = self.channels.setdefault(channel, ChannelPublishers())
        if connection not in publishers.advertisers:
            if len(publishers.advertisers) >= ADVERTISERS_PER_CHANNEL_MAX:
                if not publishers.advertisers:
                    del self.channels[channel]
                return False
            publishers.advertisers[connection] = None
        if leader:
            publishers.override = connection
        return True

    def withdraw(self, channel: str, connection: Any) -> None:
        publishers = self.channels.get(channel)
        if publishers is None:
            return
        publishers.advertisers.pop(connection, None)
        if publishers.override is connection:
            publishers.override = None
        if not publishers.advertisers:
            del self.channels[channel]

    def leader(self, channel: str) -> Any | None:
        publishers = self.channels.get(channel)
        return None if publishers is None else publishers.leader()

    def may_publish(self, channel: str, connection: Any) -> bool:
        """Whether an advertiser's publish goes out: it leads, or none leads."""
        leader = self.leader(channel)
        return leader is None or leader is connection

    def count(self, channel: str) -> int:
        publishers = self.channels.get(channel)
        return 0 if publishers is None else len(publishers.advertisers)
