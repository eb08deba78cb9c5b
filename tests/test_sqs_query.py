"""The SQS endpoint in the query protocol older SDKs speak (form-encoded requests signed with
botocore's SigV4Auth, XML answers), then the AWS CLI and the AWS SDK for JavaScript against the
same real 3-node cluster (qserver/features/sqs/, docs/SQS.md)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import requests
from botocore.auth import SigV4Auth, SigV4QueryAuth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

from client import Client
from tests.sqs_support import (
    EVERYTHING,
    REGION,
    XMLNS,
    Key,
    SqsCluster,
    boto_client,
    isolated_aws_environment,
    query,
    sqs_cluster,
    xml_texts,
)

__all__ = ["sqs_cluster"]
pytestmark = pytest.mark.timeout(60)
REPOSITORY = Path(__file__).resolve().parent.parent
JS_MODULES = REPOSITORY / ".venv" / "sqs-js"


def ok(answer: tuple[int, Any]) -> Any:
    status, root = answer
    assert status == 200, (status, xml_texts(root, "Code"), xml_texts(root, "Message"))
    return root


def test_every_action_in_the_query_protocol(sqs_cluster: SqsCluster) -> None:
    url, key = sqs_cluster.url("n3"), sqs_cluster.keys["admin"]
    created = ok(query(url, key, {"Action": "CreateQueue", "QueueName": "legacy",
                                  "Attribute.1.Name": "VisibilityTimeout", "Attribute.1.Value": "40"}))
    queue_url = xml_texts(created, "QueueUrl")[0]
    assert created.tag == XMLNS + "CreateQueueResponse" and queue_url.endswith("/sqs/000000000000/legacy")
    assert xml_texts(ok(query(url, key, {"Action": "GetQueueUrl", "QueueName": "legacy"})), "QueueUrl") == [queue_url]
    listed = ok(query(url, key, {"Action": "ListQueues", "QueueNamePrefix": "leg"}, method="GET"))
    assert xml_texts(listed, "QueueUrl") == [queue_url]
    sent = ok(query(url, key, {"Action": "SendMessage", "QueueUrl": queue_url, "MessageBody": "a&b <c>",
                               "MessageAttribute.1.Name": "n", "MessageAttribute.1.Value.DataType": "Number",
                               "MessageAttribute.1.Value.StringValue": "7"}))
    message_id = xml_texts(sent, "MessageId")[0]
    assert xml_texts(sent, "MD5OfMessageBody") and xml_texts(sent, "MD5OfMessageAttributes")
    batch = {"Action": "SendMessageBatch", "QueueUrl": queue_url}
    for i in (1, 2):
        batch.update({f"SendMessageBatchRequestEntry.{i}.Id": f"e{i}",
                      f"SendMessageBatchRequestEntry.{i}.MessageBody": f"batch {i}"})
    assert sorted(xml_texts(ok(query(url, key, batch)), "Id")) == ["e1", "e2"]
    attributes = ok(query(url, key, {"Action": "GetQueueAttributes", "QueueUrl": queue_url,
                                     "AttributeName.1": "All"}))
    shown = dict(zip(xml_texts(attributes, "Name"), xml_texts(attributes, "Value"), strict=True))
    assert shown["VisibilityTimeout"] == "40" and shown["ApproximateNumberOfMessages"] == "3"
    ok(query(url, key, {"Action": "SetQueueAttributes", "QueueUrl": queue_url,
                        "Attribute.1.Name": "VisibilityTimeout", "Attribute.1.Value": "50"}))

    # Old SDKs post to the queue URL itself, without a QueueUrl parameter.
    path = "/sqs/000000000000/legacy"
    received = ok(query(url, key, {"Action": "ReceiveMessage", "MaxNumberOfMessages": "10", "WaitTimeSeconds": "5",
                                   "AttributeName.1": "All", "MessageAttributeName.1": "All"}, path=path))
    bodies = dict(zip(xml_texts(received, "MessageId"), xml_texts(received, "Body"), strict=True))
    assert bodies[message_id] == "a&b <c>" and len(bodies) == 3
    assert "ApproximateReceiveCount" in xml_texts(received, "Name") and xml_texts(received, "StringValue") == ["7"]
    handles = xml_texts(received, "ReceiptHandle")
    ok(query(url, key, {"Action": "ChangeMessageVisibility", "QueueUrl": queue_url, "ReceiptHandle": handles[0],
                        "VisibilityTimeout": "100"}))
    changed = ok(query(url, key, {"Action": "ChangeMessageVisibilityBatch", "QueueUrl": queue_url,
                                  "ChangeMessageVisibilityBatchRequestEntry.1.Id": "c1",
                                  "ChangeMessageVisibilityBatchRequestEntry.1.ReceiptHandle": handles[1],
                                  "ChangeMessageVisibilityBatchRequestEntry.1.VisibilityTimeout": "100"}))
    assert [e.tag for e in changed.iter() if e.tag.endswith("ResultEntry")] == \
        [XMLNS + "ChangeMessageVisibilityBatchResultEntry"]
    ok(query(url, key, {"Action": "DeleteMessage", "QueueUrl": queue_url, "ReceiptHandle": handles[0]}))
    deleted = ok(query(url, key, {"Action": "DeleteMessageBatch", "QueueUrl": queue_url,
                                  "DeleteMessageBatchRequestEntry.1.Id": "d1",
                                  "DeleteMessageBatchRequestEntry.1.ReceiptHandle": handles[1],
                                  "DeleteMessageBatchRequestEntry.2.Id": "d2",
                                  "DeleteMessageBatchRequestEntry.2.ReceiptHandle": "bad"}))
    assert xml_texts(deleted, "Code") == ["ReceiptHandleIsInvalid"] and "d1" in xml_texts(deleted, "Id")
    ok(query(url, key, {"Action": "PurgeQueue", "QueueUrl": queue_url}))
    assert sqs_cluster.admin.queue_stats("legacy")["depth"] == 0
    ok(query(url, key, {"Action": "DeleteQueue", "QueueUrl": queue_url}))
    status, root = query(url, key, {"Action": "GetQueueUrl", "QueueName": "legacy"})
    assert status == 400 and xml_texts(root, "Code") == ["AWS.SimpleQueueService.NonExistentQueue"]
    assert xml_texts(root, "QclusterCode") == ["E_UNKNOWN_QUEUE"] and root.tag == XMLNS + "ErrorResponse"


def test_query_protocol_errors_and_presigned_requests(sqs_cluster: SqsCluster) -> None:
    url, key = sqs_cluster.url("n1"), sqs_cluster.keys["admin"]
    status, root = query(url, key, {"Action": "ListQueues"}, secret="not the secret")
    assert status == 403 and xml_texts(root, "Code") == ["SignatureDoesNotMatch"]
    status, root = query(url, Key("x", "AKQCNOSUCHKEY0000000", "s"), {"Action": "ListQueues"})
    assert status == 403 and xml_texts(root, "Code") == ["InvalidClientTokenId"]
    unsigned = requests.post(url + "/sqs/", data={"Action": "ListQueues"}, timeout=10)
    assert unsigned.status_code == 403 and b"MissingAuthenticationToken" in unsigned.content
    status, root = query(url, key, {"Action": "TagQueue", "QueueUrl": f"{url}/sqs/000000000000/x"})
    assert status == 400 and xml_texts(root, "Code") == ["InvalidAction"]
    status, root = query(url, key, {"Action": "CreateQueue", "QueueName": "bad name!"})
    assert status == 400 and xml_texts(root, "Code") == ["InvalidParameterValue"]
    status, root = query(url, sqs_cluster.keys["reader"], {"Action": "CreateQueue", "QueueName": "rq"})
    assert status == 403 and xml_texts(root, "Code") == ["AccessDenied"] and xml_texts(root, "QclusterCode") == \
        ["E_FORBIDDEN"]
    # A presigned GET (X-Amz-* in the query, no Authorization header).
    request = AWSRequest(method="GET", url=f"{url}/sqs/?Action=ListQueues&Version=2012-11-05")
    SigV4QueryAuth(Credentials(key.key_id, key.secret), "sqs", REGION, expires=60).add_auth(request)
    presigned = requests.get(request.prepare().url, timeout=10)
    assert presigned.status_code == 200 and b"ListQueuesResponse" in presigned.content
    # The JSON protocol's error: SQS's __type and x-amzn-query-error, and our code beside them.
    body = json.dumps({"QueueName": "nowhere"}).encode()
    signed = AWSRequest(method="POST", url=f"{url}/sqs/", data=body, headers={
        "Content-Type": "application/x-amz-json-1.0", "X-Amz-Target": "AmazonSQS.GetQueueUrl"})
    SigV4Auth(Credentials(key.key_id, key.secret), "sqs", REGION).add_auth(signed)
    prepared = signed.prepare()
    answer = requests.post(prepared.url, data=body, headers=dict(prepared.headers), timeout=10)
    assert answer.status_code == 400 and answer.headers["x-amzn-query-error"] == \
        "AWS.SimpleQueueService.NonExistentQueue;Sender"
    assert answer.json()["__type"] == "com.amazonaws.sqs#QueueDoesNotExist"
    assert answer.json()["qclusterCode"] == "E_UNKNOWN_QUEUE"
    # A request captured at one node is refused at another (its signed Host names the first),
    # as the node's own signatures are (docs/SECURITY.md): SQS's signature binds the Host header.
    captured = {**prepared.headers, "Host": url.split("://", 1)[1]}       # exactly as it was sent to n1
    replayed = requests.post(sqs_cluster.url("n2") + "/sqs/", data=body, headers=captured, timeout=10)
    assert replayed.status_code == 403 and replayed.json()["__type"] == "com.amazonaws.sqs#SignatureDoesNotMatch"
    assert "not for this node" in replayed.json()["message"]
    # A body over the bound is refused before it is read whole.
    big = requests.post(url + "/sqs/", data=b"x" * (1 << 20 + 1), timeout=10,
                        headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert big.status_code == 413 and b"RequestEntityTooLarge" in big.content


def test_the_aws_cli(sqs_cluster: SqsCluster, tmp_path: Path) -> None:
    aws = Path(sys.executable).parent / "aws"
    if not aws.exists():
        pytest.skip("the AWS CLI (awscli, a dev extra) is not installed in this environment")
    key = sqs_cluster.keys["worker"]
    environment = {**isolated_aws_environment(tmp_path), "AWS_ACCESS_KEY_ID": key.key_id,
                   "AWS_SECRET_ACCESS_KEY": key.secret}
    endpoint = ["--endpoint-url", f"{sqs_cluster.url('n2')}/sqs", "--output", "json"]

    def run(*args: str) -> Any:
        done = subprocess.run([str(aws), "sqs", *args, *endpoint], env=environment, capture_output=True,
                              timeout=30, text=True)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout) if done.stdout.strip() else None
    sqs_cluster.sqs("n1").create_queue(QueueName="cli")       # the worker may not create queues (admin)
    queue_url = run("get-queue-url", "--queue-name", "cli")["QueueUrl"]
    sent = run("send-message", "--queue-url", queue_url, "--message-body", "from the cli")
    got = run("receive-message", "--queue-url", queue_url, "--wait-time-seconds", "5")["Messages"][0]
    assert got["Body"] == "from the cli" and got["MessageId"] == sent["MessageId"]
    run("delete-message", "--queue-url", queue_url, "--receipt-handle", got["ReceiptHandle"])
    assert sqs_cluster.admin.queue_stats("cli")["depth"] == 0
    refused = subprocess.run([str(aws), "sqs", "purge-queue", "--queue-url", queue_url, *endpoint],
                             env=environment, capture_output=True, timeout=30, text=True)
    assert refused.returncode != 0 and "AccessDenied" in refused.stderr


def test_the_javascript_sdk(sqs_cluster: SqsCluster, tmp_path: Path) -> None:
    node = shutil.which("node")
    if node is None:
        pytest.skip("Node.js is not installed here: the JavaScript SDK test needs `node` (and npm to install "
                    "@aws-sdk/client-sqs; scripts/test does)")
    if not (JS_MODULES / "node_modules" / "@aws-sdk" / "client-sqs").exists():
        pytest.skip(f"@aws-sdk/client-sqs is not installed in {JS_MODULES} (scripts/test installs it with npm)")
    key = sqs_cluster.keys["admin"]
    environment = {**isolated_aws_environment(tmp_path), "AWS_ACCESS_KEY_ID": key.key_id,
                   "AWS_SECRET_ACCESS_KEY": key.secret, "AWS_REGION": REGION, "SQS_JS_MODULES": str(JS_MODULES)}
    done = subprocess.run([node, str(REPOSITORY / "tests" / "sqs_js" / "sqs_roundtrip.mjs"),
                           f"{sqs_cluster.url('n3')}/sqs", "from-js"], env=environment, capture_output=True,
                          timeout=45, text=True)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["queueUrl"].endswith("/sqs/000000000000/from-js")
    assert out["received"] == [{"id": out["messageId"], "body": "from javascript ✓", "lang": "js"}]
    assert out["listed"] == [out["queueUrl"]]
    assert out["missing"]["name"] in ("QueueDoesNotExist", "AWS.SimpleQueueService.NonExistentQueue")
    assert sqs_cluster.admin.queue_stats("from-js")["depth"] == 0


def test_a_node_alone_serves_sqs_too(qnode: Any) -> None:
    """Outside a cluster: no map (receipt handles name no node), the node's own delegation secret."""
    with Client(qnode.url, qnode.credentials_path) as admin:
        client_id = admin.register_client("alone", EVERYTHING)["id"]
        made = admin.create_access_key(client_id)
    sqs = boto_client(qnode.url, made["access_key_id"], made["secret_access_key"])
    url = sqs.create_queue(QueueName="solo")["QueueUrl"]
    assert url == f"{qnode.url}/sqs/000000000000/solo"
    sqs.send_message(QueueUrl=url, MessageBody="alone")
    message = sqs.receive_message(QueueUrl=url, WaitTimeSeconds=5)["Messages"][0]
    assert message["Body"] == "alone"
    sqs.delete_message(QueueUrl=url, ReceiptHandle=message["ReceiptHandle"])
    assert "Messages" not in sqs.receive_message(QueueUrl=url)
