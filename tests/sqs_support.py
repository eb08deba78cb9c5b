"""What the SQS gateway's tests share: one real 3-node cluster per test file, clients with access
keys (qserver/features/sqs/, docs/SQS.md), boto3 clients isolated from the developer's ~/.aws,
and a signer for query-protocol requests (botocore's own SigV4Auth)."""
from __future__ import annotations

import os
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import boto3
import botocore.config
import pytest
import requests
from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

from client import Client
from qserver.dev.devcluster import LocalCluster
from tests.conftest import fail_on_unexpected_ends

REGION = "eu-west-3"
XMLNS = "{http://queue.amazonaws.com/doc/2012-11-05/}"
EVERYTHING = [{"pattern": "*", "privileges": ["post", "get", "delete", "admin"]}]
WORKER = [{"pattern": "*", "privileges": ["post", "get", "delete"]}]


@dataclass
class Key:
    client_id: str
    key_id: str
    secret: str


@dataclass
class SqsCluster:
    cluster: LocalCluster
    admin: Client
    keys: dict[str, Key] = field(default_factory=dict)

    def url(self, node: str) -> str:
        return self.cluster.urls[node]

    def sqs(self, node: str = "n1", who: str = "admin", **config: Any) -> Any:
        key = self.keys[who]
        return boto_client(self.url(node), key.key_id, key.secret, **config)


def boto_client(url: str, key_id: str, secret: str, **config: Any) -> Any:
    settings = {"retries": {"max_attempts": 3, "mode": "standard"}, "connect_timeout": 5, "read_timeout": 30,
                **config}
    session = boto3.session.Session(aws_access_key_id=key_id, aws_secret_access_key=secret, region_name=REGION)
    return session.client("sqs", endpoint_url=f"{url}/sqs", config=botocore.config.Config(**settings))


def isolated_aws_environment(home: Path) -> dict[str, str]:
    """Environment for the AWS CLI or SDKs run as processes: nothing from the user's ~/.aws."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    environment.update({"HOME": str(home), "AWS_CONFIG_FILE": str(home / "aws-config"),
                        "AWS_SHARED_CREDENTIALS_FILE": str(home / "aws-credentials"),
                        "AWS_DEFAULT_REGION": REGION, "AWS_EC2_METADATA_DISABLED": "true"})
    return environment


@pytest.fixture(scope="module")
def sqs_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SqsCluster]:
    """A 3-node cluster at feature level 3 (delay_s, receive_wait_s), a few queues placed on n1/n2,
    an `admin` key (every privilege), a `worker` key (post/get/delete) and a `reader` (get on r*)."""
    root = tmp_path_factory.mktemp("sqs")
    os.makedirs(root / "home", exist_ok=True)
    placement = {name: ["n1", "n2"] for name in ("orders", "moving", "moving-p", "basics")}
    cluster = LocalCluster(root / "cluster", 3, placement)
    try:
        cluster.start_all()
        admin = Client(cluster.urls["n1"], cluster.credentials_path)
        admin.finalize_cluster()
        found = SqsCluster(cluster, admin)
        for name, grants in (("admin", EVERYTHING), ("worker", WORKER),
                             ("reader", [{"pattern": "r*", "privileges": ["get"]}])):
            client_id = admin.register_client(f"sqs-{name}", grants)["id"]
            made = admin.create_access_key(client_id)
            found.keys[name] = Key(client_id, made["access_key_id"], made["secret_access_key"])
        yield found
        admin.close()
    finally:
        cluster.kill_all()
    fail_on_unexpected_ends(cluster.problems())


def query(url: str, key: Key, params: dict[str, str], path: str = "/sqs/", method: str = "POST",
          secret: str | None = None) -> tuple[int, ET.Element]:
    """A query-protocol request (form-encoded, as older SDKs send), signed with botocore's
    SigV4Auth; the status and the parsed XML answer."""
    body = urlencode({"Version": "2012-11-05", **params})
    target = url + path
    headers = {"Content-Type": "application/x-www-form-urlencoded; charset=utf-8"}
    if method == "GET":
        target, body = f"{target}?{body}", ""
    request = AWSRequest(method=method, url=target, data=body, headers=headers)
    SigV4Auth(Credentials(key.key_id, secret or key.secret), "sqs", REGION).add_auth(request)
    prepared = request.prepare()
    answer = requests.request(method, prepared.url, data=prepared.body, headers=dict(prepared.headers), timeout=30)
    return answer.status_code, ET.fromstring(answer.content)


def xml_texts(element: ET.Element, tag: str) -> list[str]:
    return [found.text or "" for found in element.iter(XMLNS + tag)]
