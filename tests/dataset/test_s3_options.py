"""``storage_options`` and the AWS environment keep working as users set them, now that obstore reads the shards
(the mapping is in docs/guide/storage.md): a named profile's credentials sign every shard request, a proxy in the
environment carries them, and options obstore is not given (requester pays) still read the dataset. Against the
real S3-compatible server on loopback, through the fault proxy, which logs each request's client and access key."""

from __future__ import annotations

import pytest

from streambatch import StreamBatchLoader

pytest_plugins = ["conftest_s3"]
pytestmark = pytest.mark.usefixtures("watchdog")

BUDGET = 12 * 8000


def keys(loader) -> list[list[str]]:
    return [list(b["keys"]) for b in loader]


def shard_requests(proxy) -> list[tuple[str, str, str]]:
    return [c for c in proxy.clients if ".tar" in c[0]]


@pytest.fixture
def local(s3_data):
    return keys(StreamBatchLoader(s3_data.local, budget=BUDGET, seed=2))


def test_a_named_profile_signs_every_shard_request(s3_data, proxy, local, tmp_path, monkeypatch):
    creds = tmp_path / "credentials"
    creds.write_text("[sb]\naws_access_key_id = fromprofile\naws_secret_access_key = s\n")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    options = {"profile": "sb", "client_kwargs": {"endpoint_url": s3_data.proxy_url}}
    assert keys(StreamBatchLoader(s3_data.url, storage_options=options, budget=BUDGET, seed=2)) == local
    got = shard_requests(proxy)
    assert got and all(agent.startswith("object_store") and key == "fromprofile" for _, agent, key in got), got[:3]


def test_a_proxy_in_the_environment_carries_the_shard_requests(s3_data, proxy, local, monkeypatch):
    """The endpoint is the server itself; ``HTTP_PROXY`` names the fault proxy, which then sees every shard request
    (in absolute form, as a proxy does)."""
    monkeypatch.setenv("HTTP_PROXY", s3_data.proxy_url)
    monkeypatch.setenv("NO_PROXY", "")
    assert keys(StreamBatchLoader(s3_data.url, storage_options=s3_data.options, budget=BUDGET, seed=2)) == local
    got = shard_requests(proxy)
    assert got and all(agent.startswith("object_store") for _, agent, _ in got), got[:3]


def test_options_obstore_is_not_given_still_read_the_dataset(s3_data, proxy, local):
    """``requester_pays`` has no obstore counterpart here: such a dataset is read through s3fs, whole ranges at a
    time, and gives the same batches."""
    options = dict(s3_data.proxied, requester_pays=True)
    assert keys(StreamBatchLoader(s3_data.url, storage_options=options, budget=BUDGET, seed=2)) == local
    got = shard_requests(proxy)
    assert got and not any(agent.startswith("object_store") for _, agent, _ in got), got[:3]


def test_the_shared_credentials_file_alone_signs_the_shard_requests(s3_data, proxy, local, tmp_path, monkeypatch):
    """No keys in the options or the environment: the ``[default]`` profile of the shared credentials file, as
    botocore finds it for the index, signs the shard requests too."""
    creds = tmp_path / "credentials"
    creds.write_text("[default]\naws_access_key_id = fromfile\naws_secret_access_key = s\n")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    options = {"client_kwargs": {"endpoint_url": s3_data.proxy_url}}
    assert keys(StreamBatchLoader(s3_data.url, storage_options=options, budget=BUDGET, seed=2)) == local
    got = shard_requests(proxy)
    assert got and all(agent.startswith("object_store") and key == "fromfile" for _, agent, key in got), got[:3]
