"""gs:// and az:// through obstore: gcsfs- and adlfs-style ``storage_options`` become the obstore store's settings
(the table in docs/guide/storage.md), a store is built for every object-store scheme, and options obstore is not
given leave the URL to fsspec. No request is made: no GCS or Azure emulator runs on loopback in the suite."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from streambatch.io import objstore, storage


def test_gcsfs_tokens_map_to_the_store_credentials(tmp_path):
    key = tmp_path / "sa.json"
    key.write_text("{}")
    assert objstore.gcs_config({"token": str(key)}) == ({"service_account": str(key)}, {})
    info = {"type": "service_account", "client_email": "a@b", "private_key": "k"}
    kw, _ = objstore.gcs_config({"token": info})
    assert json.loads(kw["service_account_key"]) == info
    assert objstore.gcs_config({"token": "anon"}) == ({"skip_signature": True}, {})
    for default in (None, "google_default", "cloud"):
        assert objstore.gcs_config({"token": default}) == ({}, {})


def test_gcs_endpoint_and_timeout_map_and_gcsfs_tuning_is_ignored():
    kw, client = objstore.gcs_config(
        {"endpoint_url": "http://127.0.0.1:4443/", "requests_timeout": 7, "project": "p", "block_size": 1 << 20}
    )
    assert kw == {"base_url": "http://127.0.0.1:4443"}
    assert client["allow_http"] is True
    assert client["connect_timeout"].total_seconds() == client["read_timeout"].total_seconds() == 7


@pytest.mark.parametrize(
    "options",
    [{"requester_pays": True}, {"token": {"type": "authorized_user"}}, {"token": "browser"}, {"unknown_option": 1}],
)
def test_gcs_options_obstore_is_not_given_leave_the_url_to_fsspec(options):
    assert objstore.gcs_config(options) is None
    assert not objstore.usable("gs://bucket/ds/index.json", options)
    assert objstore.store_for("gs://bucket/ds/index.json", options) is None


def test_adlfs_names_map_to_the_store_settings():
    kw, client = objstore.azure_config(
        {
            "account_name": "acct",
            "account_key": "a2V5",
            "sas_token": "?sv=1&sig=x",
            "tenant_id": "t",
            "client_id": "c",
            "client_secret": "s",
            "blocksize": 1 << 20,
        }
    )
    assert kw == {
        "account_name": "acct",
        "account_key": "a2V5",
        "sas_key": "sv=1&sig=x",
        "tenant_id": "t",
        "client_id": "c",
        "client_secret": "s",
    }
    assert client == {}
    assert objstore.azure_config({"anon": True}) == ({"skip_signature": True}, {})
    assert objstore.azure_config({"account_host": "acct.blob.example.org"})[0] == {
        "endpoint": "https://acct.blob.example.org"
    }


def test_an_azure_connection_string_and_the_account_in_the_url():
    conn = (
        "DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;AccountKey=a2V5;"
        "BlobEndpoint=http://127.0.0.1:10000/devstoreaccount1;"
    )
    kw, client = objstore.azure_config({"connection_string": conn})
    assert kw == {
        "account_name": "devstoreaccount1",
        "account_key": "a2V5",
        "endpoint": "http://127.0.0.1:10000/devstoreaccount1",
    }
    assert client == {"allow_http": True}
    assert objstore.azure_config({"connection_string": "UseDevelopmentStorage=true"}) == (
        {"use_emulator": True},
        {"allow_http": True},
    )
    assert objstore.azure_config({}, "container@acct.dfs.core.windows.net")[0] == {"account_name": "acct"}


def test_azure_options_obstore_is_not_given_leave_the_url_to_fsspec():
    options = {"account_name": "acct", "credential": object()}
    assert objstore.azure_config(options) is None
    assert objstore.store_for("az://container/ds/index.json", options) is None


@pytest.mark.parametrize(
    ("url", "options", "kind", "path"),
    [
        ("s3://bucket/ds/index.json", {"key": "k", "secret": "s"}, "S3Store", "ds/index.json"),
        ("gs://bucket/ds/index.json", {"token": "anon"}, "GCSStore", "ds/index.json"),
        ("gcs://bucket/ds/index.json", {"token": "anon"}, "GCSStore", "ds/index.json"),
        ("az://container/ds/index.json", {"account_name": "acct", "anon": True}, "AzureStore", "ds/index.json"),
        ("abfs://container@acct.dfs.core.windows.net/ds/i.json", {"anon": True}, "AzureStore", "ds/i.json"),
        ("https://example.org/ds/index.json", None, "HTTPStore", "ds/index.json"),
    ],
)
def test_a_store_is_built_for_each_object_store_scheme(url, options, kind, path):
    store, inside = objstore.store_for(url, options)
    assert type(store).__name__ == kind and inside == path
    if not url.startswith("http"):
        assert storage.store_of(url, options, writes=True) is not None


def test_a_write_to_http_is_left_to_fsspec():
    assert storage.store_of("https://example.org/ds/index.json", None, writes=True) is None


def test_a_read_starts_no_obstore_runtime():
    """A process that has made no obstore request reads through fsspec, so it can still fork workers that make them
    (a fresh interpreter: the test process may run the runtime already)."""
    code = (
        "from streambatch.io import objstore, storage\n"
        "print(storage.store_of('s3://bucket/ds/index.json', {'anon': True}) is None, objstore.runtime_running())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["True", "False"], out.stderr


@pytest.mark.parametrize(("url", "package"), [("gs://bucket/ds/index.json", "gcsfs"), ("az://c/ds/i.json", "adlfs")])
def test_gs_and_az_are_read_through_obstore_without_their_fsspec_package(url, package):
    """No gcsfs (adlfs): a read goes through obstore rather than failing for want of the package."""
    try:
        __import__(package)
        pytest.skip(f"{package} is installed: fsspec serves the first reads")
    except ImportError:
        pass
    options = {"token": "anon"} if url.startswith("gs") else {"account_name": "acct", "anon": True}
    assert storage.store_of(url, options) is not None


def test_gcs_and_azure_stores_take_their_settings(monkeypatch):
    """The mapped settings reach the store (read back through obstore's public ``config``)."""
    for name in ("GOOGLE_APPLICATION_CREDENTIALS", "AZURE_STORAGE_ACCOUNT_NAME", "AZURE_STORAGE_ACCOUNT_KEY"):
        monkeypatch.delenv(name, raising=False)
    gcs, _ = objstore.store_for("gs://bucket/x", {"token": "anon", "endpoint_url": "http://127.0.0.1:4443"})
    assert gcs.config["bucket"] == "bucket" and gcs.config["base_url"] == "http://127.0.0.1:4443"
    assert str(gcs.client_options["allow_http"]).lower() == "true"
    az, _ = objstore.store_for("az://container/x", {"account_name": "acct", "account_key": "a2V5"})
    assert az.config["container_name"] == "container" and az.config["account_name"] == "acct"
    assert az.config["account_key"] == "a2V5"
