"""The SQS gateway's pure parts (qserver/features/sqs/): the MD5 of message attributes as SQS
computes it, attributes and our headers both ways, the query protocol read into the JSON
protocol's shape and answered in XML, receipt handles, queue URLs and queue attributes."""
from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

from qserver.features.sqs import codec
from qserver.features.sqs import mapping as m
from qserver.features.sqs.errors import SqsError

pytestmark = pytest.mark.timeout(10)


def refused(call: object, code: str, *args: object) -> str:
    with pytest.raises(SqsError) as caught:
        call(*args)  # type: ignore[operator]
    assert caught.value.kind.code == code
    return caught.value.message


def test_the_attributes_digest_is_sqs_own() -> None:
    # The value SQS (and moto, which checks against it) gives for this attribute.
    headers, digest = m.attributes_to_headers({"timestamp": {"StringValue": "1493147359900", "DataType": "Number"}})
    assert digest == "235c5c510d26fb653d073faed50ae77c"
    assert headers == {"timestamp": "1493147359900", m.TYPES_HEADER: '{"timestamp":"Number"}'}
    assert m.md5_text("") == "d41d8cd98f00b204e9800998ecf8427e"


def test_attributes_round_trip_through_headers_with_the_same_digest() -> None:
    attributes = {"b": {"DataType": "Binary", "BinaryValue": "AP9i"}, "s": {"DataType": "String", "StringValue": "é"},
                  "n": {"DataType": "Number.int", "StringValue": "-3.5"}, "c": {"DataType": "String.x",
                                                                              "StringValue": "v"}}
    headers, digest = m.attributes_to_headers(attributes)
    assert headers["s"] == "é" and "s" not in json.loads(headers[m.TYPES_HEADER])
    shown, again = m.headers_to_attributes({**headers, m.SENT_HEADER: "1"}, ["All"])
    assert again == digest and shown == {
        "b": {"DataType": "Binary", "BinaryValue": "AP9i"}, "c": {"DataType": "String.x", "StringValue": "v"},
        "n": {"DataType": "Number.int", "StringValue": "-3.5"}, "s": {"DataType": "String", "StringValue": "é"}}
    assert m.headers_to_attributes(headers, [])[0] == {}
    assert set(m.headers_to_attributes(headers, ["s", "b.*"])[0]) == {"s"}
    # A header of our own producers is a String attribute; reserved ones never show.
    assert m.headers_to_attributes({"trace": "t", m.SENDER_HEADER: "c"}, [".*"])[0] == {
        "trace": {"DataType": "String", "StringValue": "t"}}


@pytest.mark.parametrize("attributes", [
    {f"a{i}": {"DataType": "String", "StringValue": "v"} for i in range(11)},       # more than 10
    {"x": {"DataType": "Strange", "StringValue": "v"}},                             # unknown type
    {"x": {"DataType": "Number", "StringValue": "one"}},                            # not a number
    {"x": {"DataType": "String", "StringValue": "line\nbreak"}},                    # not printable (our headers)
    {"x": {"DataType": "Binary", "BinaryValue": "***"}},                            # not base64
    {"x": {"DataType": "String", "StringValue": ""}},                               # empty
    {"AWS.x": {"DataType": "String", "StringValue": "v"}},                          # SQS's reserved prefix
    {"sqs.types": {"DataType": "String", "StringValue": "v"}},                      # ours
    {"a" * 65: {"DataType": "String", "StringValue": "v"}},                         # over our header name limit
    {"bad name": {"DataType": "String", "StringValue": "v"}},
])
def test_attributes_sqs_or_our_headers_refuse(attributes: dict[str, object]) -> None:
    refused(m.attributes_to_headers, "InvalidParameterValue", attributes)


def test_the_query_protocol_reads_into_the_json_shape() -> None:
    action, params = codec.query_request([
        ("Action", "SendMessageBatch"), ("Version", "2012-11-05"), ("QueueUrl", "u"),
        ("SendMessageBatchRequestEntry.2.Id", "b"), ("SendMessageBatchRequestEntry.2.MessageBody", "two"),
        ("SendMessageBatchRequestEntry.1.Id", "a"), ("SendMessageBatchRequestEntry.1.MessageBody", "one"),
        ("SendMessageBatchRequestEntry.1.MessageAttribute.1.Name", "k"),
        ("SendMessageBatchRequestEntry.1.MessageAttribute.1.Value.DataType", "String"),
        ("SendMessageBatchRequestEntry.1.MessageAttribute.1.Value.StringValue", "v"),
        ("SendMessageBatchRequestEntry.1.DelaySeconds", "3")])
    assert action == "SendMessageBatch"
    assert params == {"QueueUrl": "u", "Entries": [
        {"Id": "a", "MessageBody": "one", "DelaySeconds": "3",
         "MessageAttributes": {"k": {"DataType": "String", "StringValue": "v"}}},
        {"Id": "b", "MessageBody": "two"}]}
    _, params = codec.query_request([("Action", "CreateQueue"), ("QueueName", "q"), ("Attribute.1.Name", "A"),
                                     ("Attribute.1.Value", "1"), ("AttributeName.1", "All")])
    assert params == {"QueueName": "q", "Attributes": {"A": "1"}, "AttributeNames": ["All"]}
    for bad in ([("Entry.0.Id", "x")], [("A..B", "x")], [("A", "x"), ("A.1", "y")], [("Attribute.Name", "x")]):
        with pytest.raises(SqsError):
            codec.query_request(bad)


def test_xml_answers_and_errors() -> None:
    answer = ET.fromstring(codec.xml_answer("ReceiveMessage", {"Messages": [{
        "MessageId": "1", "Body": "<&>", "Attributes": {"SenderId": "c"},
        "MessageAttributes": {"k": {"DataType": "String", "StringValue": "v"}}}]}, "rid"))
    ns = codec.XMLNS
    message = answer.find(f"{{{ns}}}ReceiveMessageResult/{{{ns}}}Message")
    assert message is not None and message.findtext(f"{{{ns}}}Body") == "<&>"
    assert message.findtext(f"{{{ns}}}Attribute/{{{ns}}}Name") == "SenderId"
    assert message.findtext(f"{{{ns}}}MessageAttribute/{{{ns}}}Value/{{{ns}}}StringValue") == "v"
    batch = ET.fromstring(codec.xml_answer("DeleteMessageBatch", {"Successful": [{"Id": "a"}], "Failed": [
        {"Id": "b", "SenderFault": True, "Code": "C", "Message": "M"}]}, "rid"))
    assert [e.tag.split("}")[1] for e in batch.iter() if e.tag.endswith("Entry")] == \
        ["DeleteMessageBatchResultEntry", "BatchResultErrorEntry"]
    assert batch.findtext(f".//{{{ns}}}SenderFault") == "true"
    error = SqsError(m.INVALID_PARAMETER_VALUE, "bad <x>", "E_INVALID_OPTION")
    parsed = ET.fromstring(codec.xml_error(error, "rid"))
    assert parsed.findtext(f"{{{ns}}}Error/{{{ns}}}QclusterCode") == "E_INVALID_OPTION"
    body, headers = codec.json_error(error)
    assert body["__type"] == "com.amazonaws.sqs#InvalidParameterValue" and \
        headers["x-amzn-query-error"] == "InvalidParameterValue;Sender"


def test_receipt_handles_queue_urls_and_arns() -> None:
    handle = m.receipt_handle("orders", 42, "r3c", "n2")
    assert handle.startswith("qc1.") and all(c.isalnum() or c in "-_." for c in handle)
    assert m.parse_receipt_handle(handle, "orders") == (42, "r3c", "n2")
    refused(m.parse_receipt_handle, "ReceiptHandleIsInvalid", handle, "other")
    for bad in ("", "qc1.!!!", "AQEB-real-sqs", "qc1." + "A" * 3000, None):
        refused(m.parse_receipt_handle, "ReceiptHandleIsInvalid", bad, "orders")
    assert m.queue_from_url("https://h:1/sqs/123456789012/a.b:c") == "a.b:c"
    assert m.queue_from_url("/sqs/000000000000/q") == "q"
    for bad in ("http://h/sqs/1/q", "http://h/q", "http://h/sqs/000000000000/", "", None):
        refused(m.queue_from_url, "InvalidParameterValue", bad)
    assert m.queue_from_arn("arn:aws:sqs:eu-west-1:000000000000:q.dlq") == "q.dlq"


def test_queue_attributes_and_our_options() -> None:
    policy = json.dumps({"deadLetterTargetArn": "arn:aws:sqs:r:000000000000:q.dlq", "maxReceiveCount": 4})
    assert m.attributes_to_options({"VisibilityTimeout": "12", "MessageRetentionPeriod": "600", "DelaySeconds": 5,
                                    "ReceiveMessageWaitTimeSeconds": "20", "RedrivePolicy": policy,
                                    "MaximumMessageSize": "262144", "FifoQueue": "false"}, "q") == {
        "visibility_timeout_s": 12.0, "message_ttl_s": 600.0, "delay_s": 5.0, "receive_wait_s": 20.0,
        "dead_letter": True, "max_deliveries": 4}
    assert m.attributes_to_options({"RedrivePolicy": ""}, "q") == {"dead_letter": False}
    assert "q.dlq" in refused(m.attributes_to_options, "InvalidAttributeValue", {"RedrivePolicy": json.dumps(
        {"deadLetterTargetArn": "arn:aws:sqs:r:000000000000:other", "maxReceiveCount": 4})}, "q")
    refused(m.attributes_to_options, "InvalidAttributeValue", {"VisibilityTimeout": "43201"}, "q")
    refused(m.attributes_to_options, "InvalidAttributeValue", {"MaximumMessageSize": "2048"}, "q")
    refused(m.attributes_to_options, "InvalidAttributeName", {"Policy": "{}"}, "q")
    refused(m.attributes_to_options, "InvalidAttributeName", {"QueueArn": "x"}, "q")
    assert "FIFO" in refused(m.attributes_to_options, "InvalidParameterValue", {"FifoQueue": "true"}, "q")
    shown = m.options_to_attributes({"visibility_timeout_s": 30.0, "message_ttl_s": 0.0, "dead_letter": False},
                                    {"ready": 3, "in_flight": 1, "delayed": 2}, "q", "eu-west-3")
    assert shown["MessageRetentionPeriod"] == "1209600" and "RedrivePolicy" not in shown
    assert (shown["ApproximateNumberOfMessages"], shown["ApproximateNumberOfMessagesNotVisible"],
            shown["ApproximateNumberOfMessagesDelayed"]) == ("3", "1", "2")
    assert shown["QueueArn"] == "arn:aws:sqs:eu-west-3:000000000000:q"
