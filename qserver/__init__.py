"""The queue server node. Its rooms, and what each may import (docs/ARCHITECTURE.md, held by
tests/test_layers.py):

    core/       the engine: one task owning every queue core of the node, its inbox, the commit
                pipeline. Imports storage/, replication/, wire/, never cluster/, api/, features/.
    storage/    LMDB: queue records and messages, the membership layer's log, journal export.
    cluster/    queue pairs (replication roles), the coordinator (lease, failover, handoffs), the
                membership layer, relays from replicas to masters.
    transport/  peer links and TLS.
    api/        REST, WebSocket, authentication and grants.
    features/   channels, macro queues, recipient surveillance, store-and-forward, redrive: they
                reach the node only through `qserver.services.NodeServices`.
    dev/        the local cluster, the demo and their helpers.

`node.py` wires the rooms together; `cli.py` is the `qserver` command.
"""
