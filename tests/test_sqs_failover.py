"""boto3 producers and consumers through the SQS endpoint while the queue's master hands off and
then is killed (kill -9): every SendMessage that was acknowledged is received and deleted at
least once (docs/ARCHITECTURE.md, Guarantee 2; docs/SQS.md, "Failures")."""
from __future__ import annotations

import threading
import time

import pytest
from botocore.exceptions import BotoCoreError, ClientError

from tests.sqs_support import SqsCluster, sqs_cluster

__all__ = ["sqs_cluster"]
pytestmark = pytest.mark.timeout(90)
PRODUCERS, CONSUMERS = 3, 2
RUN_S = 12.0          # producers send for this long; the handoff at 3 s, the kill at 7 s
DRAIN_S = 40.0        # then consumers take what is left


def test_nothing_acknowledged_is_lost_through_a_handoff_and_a_kill(sqs_cluster: SqsCluster) -> None:
    cluster = sqs_cluster.cluster
    retries = {"retries": {"max_attempts": 10, "mode": "standard"}, "read_timeout": 20}
    # n3 serves the SDKs and is never killed; the queue's pair is n1 (master) and n2.
    # `moving` made through SQS (so `full`), `moving-p` by our own client (`producer`).
    url = sqs_cluster.sqs("n3").create_queue(QueueName="moving", Attributes={"VisibilityTimeout": "5"})["QueueUrl"]
    sqs_cluster.admin.create_queue("moving-p", strength="producer", visibility_timeout_s=5.0)
    urls = [url, url + "-p"]
    queues = sqs_cluster.admin.cluster()["queues"]
    assert queues["moving"]["master"] == queues["moving-p"]["master"] == "n1"
    assert queues["moving"]["options"]["strength"] == "full"
    acknowledged: set[str] = set()
    acknowledged_at: dict[str, float] = {}
    received: set[str] = set()
    failures: list[str] = []
    stop_producing = threading.Event()
    stop_consuming = threading.Event()
    lock = threading.Lock()

    def produce(number: int) -> None:
        sqs = sqs_cluster.sqs("n3", "worker", **retries)
        sequence = 0
        while not stop_producing.is_set():
            body = f"p{number}-{sequence}"
            sequence += 1
            try:
                sqs.send_message(QueueUrl=urls[sequence % 2], MessageBody=body)
            except (ClientError, BotoCoreError) as error:     # not acknowledged: may or may not be stored
                with lock:
                    failures.append(f"send {body}: {error}")
                continue
            with lock:
                acknowledged.add(body)
                acknowledged_at[body] = time.monotonic()
            time.sleep(0.01)

    def consume(url: str) -> None:
        sqs = sqs_cluster.sqs("n3", "worker", **retries)
        while not stop_consuming.is_set():
            try:
                messages = sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=10, WaitTimeSeconds=1
                                               ).get("Messages", [])
                with lock:
                    received.update(message["Body"] for message in messages)
                if messages:
                    sqs.delete_message_batch(QueueUrl=url, Entries=[
                        {"Id": str(i), "ReceiptHandle": message["ReceiptHandle"]}
                        for i, message in enumerate(messages)])
            except (ClientError, BotoCoreError) as error:      # redelivered after its visibility timeout
                with lock:
                    failures.append(f"consume: {error}")

    threads = [threading.Thread(target=produce, args=(i,)) for i in range(PRODUCERS)]
    threads += [threading.Thread(target=consume, args=(url,)) for url in urls for _ in range(CONSUMERS)]
    for thread in threads:
        thread.start()
    started = time.monotonic()
    try:
        time.sleep(3.0)
        for queue in ("moving", "moving-p"):
            sqs_cluster.admin.handoff(queue)         # n2 masters them now
            assert sqs_cluster.admin.cluster()["queues"][queue]["master"] == "n2"
        time.sleep(max(0.0, started + 7.0 - time.monotonic()))
        cluster.kill("n2")                           # and dies: n1 takes over (failover)
        killed_at = time.monotonic()
        time.sleep(max(0.0, started + RUN_S - time.monotonic()))
        stop_producing.set()
        for thread in threads[:PRODUCERS]:          # their last sends are answered (or failed) first
            thread.join(30)
        deadline = time.monotonic() + DRAIN_S
        while time.monotonic() < deadline:
            with lock:
                if acknowledged <= received:
                    break
            time.sleep(0.5)
    finally:
        stop_producing.set()
        stop_consuming.set()
        for thread in threads:
            thread.join(30)
    missing = acknowledged - received
    assert not missing, f"{len(missing)} acknowledged messages never received, e.g. {sorted(missing)[:5]}; " \
                        f"failures: {failures[:5]}"
    assert len(acknowledged) > 100, f"only {len(acknowledged)} sends acknowledged: {failures[:5]}"
    queues = sqs_cluster.admin.cluster()["queues"]
    assert queues["moving"]["master"] == queues["moving-p"]["master"] == "n1"
    # The run went on through the failover: sends were acknowledged after the kill too.
    assert any(at > killed_at + 1.0 for at in acknowledged_at.values()), "no send acknowledged after the kill"
