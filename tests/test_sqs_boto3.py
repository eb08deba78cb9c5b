"""The SQS endpoint through boto3 (the JSON protocol) against a real 3-node cluster: every action,
the errors SDKs see, queue URLs used at any node, long polling, visibility, batches and purge
(qserver/features/sqs/, docs/SQS.md). One cluster for the whole file (tests/sqs_support.py)."""
from __future__ import annotations

import hashlib
import json
import threading
import time
from typing import Any

import pytest
import requests
from botocore.exceptions import ClientError

from client import Client
from tests.sqs_support import REGION, SqsCluster, boto_client, sqs_cluster

__all__ = ["sqs_cluster"]
pytestmark = pytest.mark.timeout(60)


def error_of(call: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
    with pytest.raises(ClientError) as caught:
        call(*args, **kwargs)
    return caught.value.response  # type: ignore[no-any-return]


def test_create_send_receive_delete_with_attributes_and_digests(sqs_cluster: SqsCluster) -> None:
    sqs = sqs_cluster.sqs("n1")
    url = sqs.create_queue(QueueName="basics")["QueueUrl"]
    assert url == f"{sqs_cluster.url('n1')}/sqs/000000000000/basics"
    assert sqs.get_queue_url(QueueName="basics")["QueueUrl"] == url
    # The same create again is the same queue; other attributes are QueueNameExists.
    assert sqs.create_queue(QueueName="basics")["QueueUrl"] == url
    refused = error_of(sqs.create_queue, QueueName="basics", Attributes={"VisibilityTimeout": "7"})
    assert refused["Error"]["Code"] == "QueueAlreadyExists"
    attributes = {"color": {"DataType": "String", "StringValue": "blue"},
                  "count": {"DataType": "Number", "StringValue": "42"},
                  "blob": {"DataType": "Binary", "BinaryValue": b"\x00\xffbytes"},
                  "kind": {"DataType": "String.custom", "StringValue": "k"}}
    # boto3 checks MD5OfMessageBody and MD5OfMessageAttributes itself: a wrong digest raises.
    sent = sqs.send_message(QueueUrl=url, MessageBody="héllo ☃", MessageAttributes=attributes)
    assert sent["MD5OfMessageBody"] == hashlib.md5("héllo ☃".encode()).hexdigest()
    received = sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=10, WaitTimeSeconds=5,
                                   MessageAttributeNames=["All"], AttributeNames=["All"])["Messages"]
    assert len(received) == 1
    message = received[0]
    assert message["Body"] == "héllo ☃" and message["MessageId"] == sent["MessageId"]
    assert message["MessageAttributes"]["blob"]["BinaryValue"] == b"\x00\xffbytes"
    assert message["MessageAttributes"]["count"] == {"DataType": "Number", "StringValue": "42"}
    assert message["MD5OfMessageAttributes"] == sent["MD5OfMessageAttributes"]
    system = message["Attributes"]
    assert system["ApproximateReceiveCount"] == "1" and system["SenderId"] == sqs_cluster.keys["admin"].client_id
    assert abs(int(system["SentTimestamp"]) / 1000 - time.time()) < 60
    sqs.delete_message(QueueUrl=url, ReceiptHandle=message["ReceiptHandle"])
    sqs.delete_message(QueueUrl=url, ReceiptHandle=message["ReceiptHandle"])     # again: still fine, as SQS
    assert "Messages" not in sqs.receive_message(QueueUrl=url, WaitTimeSeconds=0)

    # Our own consumers see a String attribute as a header of the same name, and a header our
    # producers set comes out as a String attribute.
    with Client(sqs_cluster.url("n1"), sqs_cluster.cluster.credentials_path) as own:      # n1: the master
        sqs.send_message(QueueUrl=url, MessageBody="to ours", MessageAttributes={"color": attributes["color"]})
        ours = own.receive("basics", 1, 5.0)
        assert ours[0].headers["color"] == "blue" and ours[0].payload == b"to ours"
        ours[0].ack()
        own.enqueue("basics", b"from ours", headers={"trace": "abc"})
    got = sqs.receive_message(QueueUrl=url, WaitTimeSeconds=5, MessageAttributeNames=["tr*", "trace"],
                              AttributeNames=["All"])["Messages"]
    assert got[0]["Body"] == "from ours" and got[0]["MessageAttributes"] == {
        "trace": {"DataType": "String", "StringValue": "abc"}}
    assert "SentTimestamp" not in got[0]["Attributes"]       # enqueued otherwise: no SQS send time kept
    assert "Messages" not in sqs.receive_message(QueueUrl=url)      # none: no list at all, as SQS answers


def test_a_queue_url_from_n1_works_at_n2_and_n3(sqs_cluster: SqsCluster) -> None:
    url = sqs_cluster.sqs("n1").create_queue(QueueName="orders")["QueueUrl"]      # placed on n1/n2
    n2, n3 = sqs_cluster.sqs("n2", "worker"), sqs_cluster.sqs("n3", "worker")
    ids = {n2.send_message(QueueUrl=url, MessageBody=f"m{i}")["MessageId"] for i in range(5)}
    seen: set[str] = set()
    deadline = time.monotonic() + 20
    while len(seen) < 5 and time.monotonic() < deadline:
        for message in n3.receive_message(QueueUrl=url, MaxNumberOfMessages=10, WaitTimeSeconds=2).get("Messages", []):
            seen.add(message["MessageId"])
            n2.delete_message(QueueUrl=url, ReceiptHandle=message["ReceiptHandle"])     # at another node again
    assert seen == ids
    assert sqs_cluster.admin.queue_stats("orders")["depth"] == 0


def test_long_polling_waits_for_a_message_sent_meanwhile(sqs_cluster: SqsCluster) -> None:
    sqs = sqs_cluster.sqs("n2")
    url = sqs.create_queue(QueueName="polling")["QueueUrl"]
    result: dict[str, Any] = {}

    def consume() -> None:
        started = time.monotonic()
        result["answer"] = sqs_cluster.sqs("n3").receive_message(QueueUrl=url, WaitTimeSeconds=10)
        result["waited_s"] = time.monotonic() - started
    consumer = threading.Thread(target=consume)
    consumer.start()
    time.sleep(1.5)
    sqs.send_message(QueueUrl=url, MessageBody="late")
    consumer.join(15)
    assert result["answer"]["Messages"][0]["Body"] == "late"
    assert 1.0 < result["waited_s"] < 9
    # The queue's ReceiveMessageWaitTimeSeconds applies when a receive names no WaitTimeSeconds.
    sqs.set_queue_attributes(QueueUrl=url, Attributes={"ReceiveMessageWaitTimeSeconds": "2"})
    started = time.monotonic()
    assert sqs.receive_message(QueueUrl=url).get("Messages", []) == []
    assert 1.5 < time.monotonic() - started < 6


def test_visibility_changes_and_redelivery(sqs_cluster: SqsCluster) -> None:
    sqs = sqs_cluster.sqs("n3")
    url = sqs.create_queue(QueueName="visible", Attributes={"VisibilityTimeout": "30"})["QueueUrl"]
    sqs.send_message(QueueUrl=url, MessageBody="v")
    first = sqs.receive_message(QueueUrl=url, WaitTimeSeconds=5, AttributeNames=["ApproximateReceiveCount"]
                                )["Messages"][0]
    assert sqs.receive_message(QueueUrl=url).get("Messages", []) == []       # leased for 30 s
    sqs.change_message_visibility(QueueUrl=url, ReceiptHandle=first["ReceiptHandle"], VisibilityTimeout=0)
    again = sqs.receive_message(QueueUrl=url, WaitTimeSeconds=5, AttributeNames=["ApproximateReceiveCount"],
                                VisibilityTimeout=3)["Messages"][0]
    assert again["MessageId"] == first["MessageId"] and again["Attributes"]["ApproximateReceiveCount"] == "2"
    sqs.change_message_visibility(QueueUrl=url, ReceiptHandle=again["ReceiptHandle"], VisibilityTimeout=20)
    time.sleep(3.5)
    assert sqs.receive_message(QueueUrl=url).get("Messages", []) == []       # extended past its 3 s
    # The first lease has ended: its handle is not in flight any more.
    stale = error_of(sqs.change_message_visibility, QueueUrl=url, ReceiptHandle=first["ReceiptHandle"],
                     VisibilityTimeout=5)
    assert stale["Error"]["Code"] in ("AWS.SimpleQueueService.MessageNotInflight", "ReceiptHandleIsInvalid")
    batch = sqs.change_message_visibility_batch(QueueUrl=url, Entries=[
        {"Id": "a", "ReceiptHandle": again["ReceiptHandle"], "VisibilityTimeout": 0},
        {"Id": "b", "ReceiptHandle": "garbage", "VisibilityTimeout": 0}])
    assert [s["Id"] for s in batch["Successful"]] == ["a"]
    assert batch["Failed"][0]["Id"] == "b" and batch["Failed"][0]["Code"] == "ReceiptHandleIsInvalid"
    assert sqs.receive_message(QueueUrl=url, WaitTimeSeconds=5)["Messages"][0]["MessageId"] == first["MessageId"]


def test_batches_purge_attributes_and_listing(sqs_cluster: SqsCluster) -> None:
    sqs = sqs_cluster.sqs("n1")
    url = sqs.create_queue(QueueName="batched", Attributes={
        "DelaySeconds": "0", "MessageRetentionPeriod": "3600",
        "RedrivePolicy": json.dumps({"deadLetterTargetArn": f"arn:aws:sqs:{REGION}:000000000000:batched.dlq",
                                     "maxReceiveCount": 3})})["QueueUrl"]
    sent = sqs.send_message_batch(QueueUrl=url, Entries=[
        {"Id": f"e{i}", "MessageBody": f"b{i}", "MessageAttributes": {"n": {"DataType": "Number",
                                                                            "StringValue": str(i)}}}
        for i in range(10)])
    assert sorted(s["Id"] for s in sent["Successful"]) == [f"e{i}" for i in range(10)] and not sent.get("Failed")
    attributes = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["All"])["Attributes"]
    assert attributes["ApproximateNumberOfMessages"] == "10" and attributes["MessageRetentionPeriod"] == "3600"
    assert json.loads(attributes["RedrivePolicy"])["maxReceiveCount"] == 3
    assert attributes["QueueArn"] == f"arn:aws:sqs:{REGION}:000000000000:batched"
    got = sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=10, WaitTimeSeconds=5)["Messages"]
    deleted = sqs.delete_message_batch(QueueUrl=url, Entries=[
        {"Id": f"d{i}", "ReceiptHandle": m["ReceiptHandle"]} for i, m in enumerate(got)])
    assert len(deleted["Successful"]) == len(got)
    # A delayed message counts as delayed; purge takes everything.
    sqs.send_message(QueueUrl=url, MessageBody="later", DelaySeconds=60)
    assert sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["ApproximateNumberOfMessagesDelayed"]
                                    )["Attributes"] == {"ApproximateNumberOfMessagesDelayed": "1"}
    sqs.purge_queue(QueueUrl=url)
    assert sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["ApproximateNumberOfMessagesDelayed"]
                                    )["Attributes"]["ApproximateNumberOfMessagesDelayed"] == "0"
    sqs.set_queue_attributes(QueueUrl=url, Attributes={"VisibilityTimeout": "45", "DelaySeconds": "2"})
    attributes = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["VisibilityTimeout", "DelaySeconds"])
    assert attributes["Attributes"] == {"VisibilityTimeout": "45", "DelaySeconds": "2"}
    # Listing: prefix and pages
    for name in ("list-a", "list-b", "list-c"):
        sqs.create_queue(QueueName=name)
    first = sqs.list_queues(QueueNamePrefix="list-", MaxResults=2)
    assert [u.rsplit("/", 1)[1] for u in first["QueueUrls"]] == ["list-a", "list-b"]
    second = sqs.list_queues(QueueNamePrefix="list-", MaxResults=2, NextToken=first["NextToken"])
    assert [u.rsplit("/", 1)[1] for u in second["QueueUrls"]] == ["list-c"] and "NextToken" not in second
    # A dead-letter queue is not listed (as our listing), but it has a URL and can be read.
    assert [u.rsplit("/", 1)[1] for u in sqs.list_queues(QueueNamePrefix="batched")["QueueUrls"]] == ["batched"]
    dlq = sqs.get_queue_url(QueueName="batched.dlq")["QueueUrl"]
    assert "Messages" not in sqs.receive_message(QueueUrl=dlq)
    sqs.delete_queue(QueueUrl=sqs.get_queue_url(QueueName="list-c")["QueueUrl"])
    assert error_of(sqs.get_queue_url, QueueName="list-c")["Error"]["Code"] == \
        "AWS.SimpleQueueService.NonExistentQueue"


def test_errors_sdks_see(sqs_cluster: SqsCluster) -> None:
    url = sqs_cluster.url("n2")
    admin = sqs_cluster.keys["admin"]
    unknown = boto_client(url, "AKQCUNKNOWNUNKNOWN00", "x" * 40)
    answer = error_of(unknown.list_queues)
    assert answer["Error"]["Code"] == "InvalidClientTokenId" and answer["ResponseMetadata"]["HTTPStatusCode"] == 403
    wrong = boto_client(url, admin.key_id, "y" * 40)
    assert error_of(wrong.list_queues)["Error"]["Code"] == "SignatureDoesNotMatch"
    sqs = sqs_cluster.sqs("n2")
    with pytest.raises(sqs.exceptions.QueueDoesNotExist):
        sqs.get_queue_url(QueueName="nowhere")
    missing = error_of(sqs.send_message, QueueUrl=f"{url}/sqs/000000000000/nowhere", MessageBody="x")
    assert missing["Error"]["Code"] == "AWS.SimpleQueueService.NonExistentQueue"
    fifo = error_of(sqs.create_queue, QueueName="jobs.fifo", Attributes={"FifoQueue": "true"})
    assert fifo["Error"]["Code"] == "InvalidParameterValue" and "FIFO" in fifo["Error"]["Message"]
    queue = sqs.create_queue(QueueName="errors")["QueueUrl"]
    assert error_of(sqs.send_message, QueueUrl=queue, MessageBody="x", MessageGroupId="g")["Error"]["Code"] == \
        "InvalidParameterValue"
    bad = error_of(sqs.set_queue_attributes, QueueUrl=queue, Attributes={"KmsMasterKeyId": "k"})
    assert bad["Error"]["Code"] == "InvalidAttributeName"
    bad = error_of(sqs.set_queue_attributes, QueueUrl=queue, Attributes={"VisibilityTimeout": "99999"})
    assert bad["Error"]["Code"] == "InvalidAttributeValue"
    other_dlq = json.dumps({"deadLetterTargetArn": f"arn:aws:sqs:{REGION}:000000000000:elsewhere",
                            "maxReceiveCount": 2})
    bad = error_of(sqs.set_queue_attributes, QueueUrl=queue, Attributes={"RedrivePolicy": other_dlq})
    assert bad["Error"]["Code"] == "InvalidAttributeValue" and "errors.dlq" in bad["Error"]["Message"]
    too_long = error_of(sqs.send_message, QueueUrl=queue, MessageBody="x" * 262_145)
    assert too_long["Error"]["Code"] == "InvalidParameterValue"
    entries = [{"Id": "same", "MessageBody": "a"}, {"Id": "same", "MessageBody": "b"}]
    assert error_of(sqs.send_message_batch, QueueUrl=queue, Entries=entries)["Error"]["Code"] == \
        "AWS.SimpleQueueService.BatchEntryIdsNotDistinct"
    eleven = [{"Id": f"i{i}", "MessageBody": "a"} for i in range(11)]
    assert error_of(sqs.send_message_batch, QueueUrl=queue, Entries=eleven)["Error"]["Code"] == \
        "AWS.SimpleQueueService.TooManyEntriesInBatchRequest"
    assert error_of(sqs.send_message_batch, QueueUrl=queue, Entries=[])["Error"]["Code"] in (
        "AWS.SimpleQueueService.EmptyBatchRequest", "ParamValidation")
    eleven_attributes = {f"a{i}": {"DataType": "String", "StringValue": "v"} for i in range(11)}
    assert error_of(sqs.send_message, QueueUrl=queue, MessageBody="x", MessageAttributes=eleven_attributes
                    )["Error"]["Code"] == "InvalidParameterValue"
    assert error_of(sqs.delete_message, QueueUrl=queue, ReceiptHandle="nonsense")["Error"]["Code"] == \
        "ReceiptHandleIsInvalid"
    # Missing grants: the worker may not purge or delete queues (admin), the reader may not send.
    worker = sqs_cluster.sqs("n3", "worker")
    denied = error_of(worker.purge_queue, QueueUrl=queue)
    assert denied["Error"]["Code"] == "AccessDenied" and denied["ResponseMetadata"]["HTTPStatusCode"] == 403
    reader = sqs_cluster.sqs("n1", "reader")
    assert error_of(reader.send_message, QueueUrl=queue, MessageBody="x")["Error"]["Code"] == "AccessDenied"
    # The node counts its SQS calls by action and outcome.
    metrics = requests.get(f"{sqs_cluster.url('n1')}/metrics", timeout=10).text
    assert 'qserver_sqs_calls_total{action="SendMessage",outcome="AccessDenied"}' in metrics
    assert 'qserver_sqs_calls_total{action="ListQueues",outcome="ok"}' in metrics
