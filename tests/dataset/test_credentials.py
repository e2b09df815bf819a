"""Missing object-store credentials: a one-line error naming the URL and where credentials come from (exit 2),
against a real S3-compatible server on loopback (moto, see conftest_s3.py) that refuses unsigned requests."""

from __future__ import annotations

import pytest
from conftest import make_audio

from streambatch import StreamBatchLoader
from streambatch.cli import main
from streambatch.errors import MissingCredentials

pytest_plugins = ["conftest_s3"]
pytestmark = pytest.mark.usefixtures("watchdog")

BUCKET = "sb-test"


@pytest.fixture
def no_credentials(moto_endpoint, monkeypatch, tmp_path):
    """No AWS credentials anywhere botocore looks (variables, files, container/instance metadata)."""
    for name in (
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_PROFILE",
        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
        "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    # a filesystem of its own: none cached by another test with credentials
    return {"client_kwargs": {"endpoint_url": moto_endpoint}, "skip_instance_cache": True}


def _cli(capsys, *argv):
    capsys.readouterr()
    code = main([str(a) for a in argv])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("command", ["inspect", "verify", "write"])
def test_cli_without_credentials_names_the_url_and_the_variables(capsys, tmp_path, no_credentials, command):
    url = f"s3://{BUCKET}/creds-{command}"
    endpoint = no_credentials["client_kwargs"]["endpoint_url"]
    argv = [command] + ([tmp_path / "audio"] if command == "write" else []) + [url]
    if command == "write":
        make_audio(tmp_path / "audio" / "a.wav")
        argv.append("--no-progress")
    code, err = _cli(
        capsys,
        *argv,
        "--storage-option",
        f"client_kwargs.endpoint_url={endpoint}",
        "--storage-option",
        "skip_instance_cache=true",
    )
    assert code == 2 and err.strip().count("\n") == 0, err
    assert url in err and "no credentials for s3 storage" in err
    assert "AWS_ACCESS_KEY_ID" in err and "--storage-option key=" in err and "unexpected" not in err


def test_loader_without_credentials_raises_a_clear_error(no_credentials):
    url = f"s3://{BUCKET}/creds-loader"
    with pytest.raises(MissingCredentials, match=f"{url}.*: no credentials for s3 storage .*AWS_ACCESS_KEY_ID") as e:
        StreamBatchLoader(url, budget="10s", storage_options=no_credentials)
    assert isinstance(e.value, PermissionError)
