"""The SQS gateway's AWS Signature Version 4 check (qserver/features/sqs/sigv4.py), pure: requests
signed by botocore's own signers (the header form and the presigned query form) verify, and any
change to what was signed, a wrong secret, an old date or a missing part is refused with the
error code SQS answers."""
from __future__ import annotations

import time
from urllib.parse import urlsplit

import pytest
from botocore.auth import SigV4Auth, SigV4QueryAuth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

from qserver.features.sqs import sigv4
from qserver.features.sqs.sigv4 import Request, SigV4Error

KEY_ID, SECRET = "AKQCABCDEFGHIJKLMNOP", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
pytestmark = pytest.mark.timeout(10)


def botocore_signed(method: str, url: str, body: bytes = b"", headers: dict[str, str] | None = None,
                    region: str = "eu-west-3", presign: bool = False, secret: str = SECRET) -> Request:
    request = AWSRequest(method=method, url=url, data=body, headers=headers or {})
    credentials = Credentials(KEY_ID, secret)
    if presign:
        SigV4QueryAuth(credentials, "sqs", region, expires=300).add_auth(request)
    else:
        SigV4Auth(credentials, "sqs", region).add_auth(request)
    prepared = request.prepare()
    parts = urlsplit(prepared.url)
    headers_sent = [(k, v.decode() if isinstance(v, bytes) else v) for k, v in prepared.headers.items()]
    headers_sent.append(("Host", parts.netloc))
    sent = prepared.body or b""
    return Request.of(method, parts.path, parts.query, headers_sent, sent if isinstance(sent, bytes) else sent.encode())


def check(request: Request, secret: str = SECRET, now_s: float | None = None) -> None:
    claim = sigv4.parse(request)
    assert claim.key_id == KEY_ID
    sigv4.verify(request, claim, secret.encode(), time.time() if now_s is None else now_s)


def refused(request: Request, code: str, **kwargs: object) -> str:
    with pytest.raises(SigV4Error) as caught:
        check(request, **kwargs)  # type: ignore[arg-type]
    assert caught.value.code == code
    return caught.value.message


JSON_HEADERS = {"Content-Type": "application/x-amz-json-1.0", "X-Amz-Target": "AmazonSQS.SendMessage"}


@pytest.mark.parametrize("url", [
    "http://127.0.0.1:8080/sqs/",
    "http://127.0.0.1:8080/sqs/000000000000/orders",
    "http://127.0.0.1:8080/sqs/000000000000/with%20space%2Fslash",     # percent-escapes in the path
    "http://127.0.0.1:8080/sqs/?Action=ListQueues&QueueNamePrefix=a%2Bb&Version=2012-11-05",   # a query
    "http://node.example:9000/sqs/./000000000000/../000000000000/q",    # dot segments
])
def test_botocore_header_signatures_verify(url: str) -> None:
    body = b'{"QueueUrl": "x", "MessageBody": "h\xc3\xa9llo \\u2603"}'
    check(botocore_signed("POST", url, body, JSON_HEADERS))
    check(botocore_signed("GET", url))


def test_a_form_body_and_a_presigned_query_verify() -> None:
    form = b"Action=SendMessage&MessageBody=a+b%26c&QueueUrl=http%3A%2F%2Fh%2Fsqs%2F000000000000%2Fq"
    check(botocore_signed("POST", "http://127.0.0.1:1/sqs/", form,
                          {"Content-Type": "application/x-www-form-urlencoded; charset=utf-8"}))
    presigned = botocore_signed("GET", "http://127.0.0.1:1/sqs/000000000000/q?Action=GetQueueAttributes"
                                       "&AttributeName.1=All", presign=True)
    assert sigv4.parse(presigned).presigned and presigned.header("authorization") is None
    check(presigned)


def test_tampering_a_wrong_secret_and_a_foreign_service_are_refused() -> None:
    url = "http://127.0.0.1:8080/sqs/"
    good = botocore_signed("POST", url, b'{"a": 1}', JSON_HEADERS)
    refused(good, "SignatureDoesNotMatch", secret="not the secret")
    for changed in (Request(good.method, good.raw_path, good.raw_query, good.headers, b'{"a": 2}'),
                    Request("PUT", good.raw_path, good.raw_query, good.headers, good.body),
                    Request(good.method, "/sqs/000000000000/q", good.raw_query, good.headers, good.body),
                    Request(good.method, good.raw_path, "Action=x", good.headers, good.body),
                    Request(good.method, good.raw_path, good.raw_query,
                            tuple((k, "AmazonSQS.DeleteQueue" if k.lower() == "x-amz-target" else v)
                                  for k, v in good.headers), good.body)):
        refused(changed, "SignatureDoesNotMatch")
    # a declared payload digest that is not the body's (UNSIGNED-PAYLOAD included) is refused
    unsigned = botocore_signed("POST", url, b"{}", {**JSON_HEADERS, "X-Amz-Content-SHA256": "UNSIGNED-PAYLOAD"})
    assert "X-Amz-Content-SHA256" in refused(unsigned, "SignatureDoesNotMatch")
    # signed for another service
    request = AWSRequest(method="POST", url=url, data=b"{}", headers=dict(JSON_HEADERS))
    SigV4Auth(Credentials(KEY_ID, SECRET), "sns", "us-east-1").add_auth(request)
    prepared = request.prepare()
    other = Request.of("POST", "/sqs/", "", [*prepared.headers.items(), ("Host", "127.0.0.1:8080")], b"{}")
    assert "service" in refused(other, "SignatureDoesNotMatch")


def test_an_old_or_future_date_is_a_signature_expired() -> None:
    request = botocore_signed("POST", "http://127.0.0.1:8080/sqs/", b"{}", JSON_HEADERS)
    check(request, now_s=time.time() + 14 * 60)
    assert "Signature expired" in refused(request, "SignatureDoesNotMatch", now_s=time.time() + 16 * 60)
    assert "Signature expired" in refused(request, "SignatureDoesNotMatch", now_s=time.time() - 16 * 60)
    presigned = botocore_signed("GET", "http://127.0.0.1:8080/sqs/?Action=ListQueues", presign=True)
    assert "expired" in refused(presigned, "SignatureDoesNotMatch", now_s=time.time() + 301)


def test_missing_and_malformed_authorization() -> None:
    bare = Request.of("POST", "/sqs/", "", [("Host", "h")], b"{}")
    refused(bare, "MissingAuthenticationToken")
    for header in ("AWS4-HMAC-SHA1 Credential=a", "AWS4-HMAC-SHA256 Credential=x/20260101/r/sqs/aws4_request",
                   f"AWS4-HMAC-SHA256 Credential={KEY_ID}/2026/r/sqs/aws4_request, SignedHeaders=host, "
                   f"Signature={'0' * 64}"):
        request = Request.of("POST", "/sqs/", "", [("Host", "h"), ("Authorization", header),
                                                   ("X-Amz-Date", "20260101T000000Z")], b"")
        refused(request, "IncompleteSignature")
    # X-Amz-Date missing
    no_date = Request.of("POST", "/sqs/", "", [("Host", "h"), (
        "Authorization", f"AWS4-HMAC-SHA256 Credential={KEY_ID}/20260101/r/sqs/aws4_request, "
                         f"SignedHeaders=host;x-amz-date, Signature={'0' * 64}")], b"")
    refused(no_date, "IncompleteSignature")
    # a date of the right shape that is no date
    not_a_date = Request.of("POST", "/sqs/", "", [("Host", "h"), ("X-Amz-Date", "20261340T000000Z"), (
        "Authorization", f"AWS4-HMAC-SHA256 Credential={KEY_ID}/20261340/r/sqs/aws4_request, "
                         f"SignedHeaders=host;x-amz-date, Signature={'0' * 64}")], b"")
    refused(not_a_date, "IncompleteSignature")


def test_signing_key_matches_the_aws_documented_example() -> None:
    # docs.aws.amazon.com "Examples of how to derive a signing key for Signature Version 4"
    key = sigv4.signing_key(b"wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", "20120215", "us-east-1", "iam")
    assert key.hex() == "f4780e2d9f65fa895f9c67b32ce1baf0b0d8a43505a000a1a9e090d414db404d"


def test_an_action_header_left_out_of_the_signature_is_refused() -> None:
    """X-Amz-Target names the JSON protocol's action: signed only over host and the date, a
    captured DeleteQueue could be sent on as a PurgeQueue with the same body and signature."""
    body = b'{"QueueUrl": "http://127.0.0.1:8080/sqs/000000000000/orders"}'
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    headers = [("Host", "127.0.0.1:8080"), ("X-Amz-Date", stamp), ("X-Amz-Target", "AmazonSQS.PurgeQueue"),
               ("Content-Type", "application/x-amz-json-1.0")]
    unsigned = Request.of("POST", "/sqs/", "", headers, body)
    claim = sigv4.Claim(KEY_ID, stamp[:8], "us-east-1", "sqs", stamp, ("host", "x-amz-date"), "0" * 64)
    made = sigv4.signature(unsigned, claim, SECRET.encode())       # a correct signature over what it names
    authorization = (f"AWS4-HMAC-SHA256 Credential={KEY_ID}/{claim.scope}, SignedHeaders=host;x-amz-date, "
                     f"Signature={made}")
    request = Request.of("POST", "/sqs/", "", [*headers, ("Authorization", authorization)], body)
    assert "x-amz-target is sent but not signed" in refused(request, "SignatureDoesNotMatch")
    # The same request with the action signed verifies.
    claim = sigv4.Claim(KEY_ID, stamp[:8], "us-east-1", "sqs", stamp, ("host", "x-amz-date", "x-amz-target"), "0" * 64)
    made = sigv4.signature(unsigned, claim, SECRET.encode())
    authorization = (f"AWS4-HMAC-SHA256 Credential={KEY_ID}/{claim.scope}, "
                     f"SignedHeaders=host;x-amz-date;x-amz-target, Signature={made}")
    check(Request.of("POST", "/sqs/", "", [*headers, ("Authorization", authorization)], body))
