"""An index reads only inside its dataset: a shard URL of ``..``, an absolute path, ``file://`` or ``http://``
elsewhere is refused before anything opens or requests it, with one line naming the URL and the option that allows
it; the user's ``shard_roots`` / ``--shard-root`` allows it, and then the dataset reads as usual. A mixture file's
datasets obey the same rule. The check itself is pure string work (object-storage prefixes tested as such)."""

from __future__ import annotations

import collections
import json
import os
import re
import shutil
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from conftest import text_dataset

from streambatch import ShardIndex, StreamBatchLoader, UntrustedURL
from streambatch.cli import main
from streambatch.format.trust import Roots, allow_line, place, roots_for

BUDGET = 1000

# ---- who opened what: every file this process opens under a watched folder, while a test watches ----------
_WATCHED: list[str] = []
_OPENED: list[str] = []


def _audit(event: str, args: tuple) -> None:
    if _WATCHED and event == "open" and isinstance(args[0], str):
        path = os.path.abspath(args[0])
        if any(path.startswith(w) for w in _WATCHED):
            _OPENED.append(path)


sys.addaudithook(_audit)  # audit hooks stay for the process's life; this one records only while a test watches


@pytest.fixture
def opened_in():
    """``opened_in(folder)`` starts recording the files opened under ``folder``; returns the list."""

    def watch(folder: Path) -> list[str]:
        _WATCHED.append(os.path.abspath(folder))
        return _OPENED

    yield watch
    _WATCHED.clear()
    _OPENED.clear()


# ---- a loopback HTTP server that counts requests -------------------------------------------------------------
class _Files(BaseHTTPRequestHandler):
    """Serves the files of ``folder`` with HEAD and ranged GET; counts every request."""

    folder: Path
    requests: list[str]

    def log_message(self, *args) -> None:  # quiet
        pass

    def _body(self) -> bytes | None:
        self.requests.append(f"{self.command} {self.path}")
        path = self.folder / self.path.lstrip("/").split("?")[0]
        if not path.is_file():
            self.send_error(404)
            return None
        return path.read_bytes()

    def do_HEAD(self) -> None:
        data = self._body()
        if data is not None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Accept-Ranges", "bytes")
            self.end_headers()

    def do_GET(self) -> None:
        data = self._body()
        if data is None:
            return
        m = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        if m:
            a, b = int(m.group(1)), int(m.group(2) or len(data) - 1)
            part = data[a : b + 1]
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {a}-{a + len(part) - 1}/{len(data)}")
        else:
            part = data
            self.send_response(200)
        self.send_header("Content-Length", str(len(part)))
        self.end_headers()
        self.wfile.write(part)


@pytest.fixture
def http_server(tmp_path) -> Iterator[tuple[str, Path, list[str]]]:
    """(base URL, the folder it serves, the requests it received) of a server on 127.0.0.1, stopped after."""
    folder = tmp_path / "served"
    folder.mkdir()
    requests: list[str] = []
    handler = type("Handler", (_Files,), {"folder": folder, "requests": requests})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/", folder, requests
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


# ---- datasets whose index points elsewhere -------------------------------------------------------------------
@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    """A small token dataset of several shards."""
    return Path(text_dataset(tmp_path_factory.mktemp("trust"), 40, seed=3, max_count=10))


def keys_of(ds: Path) -> collections.Counter:
    """Every key of the dataset (from its index's shards, read with webdataset's own tar reader)."""
    import webdataset as wds

    urls = ShardIndex.load(str(ds)).shard_urls()
    return collections.Counter(s["__key__"] for s in wds.WebDataset(urls, shardshuffle=False, empty_check=False))


def pointing(tmp_path: Path, dataset: Path, url: str, version: int = 1) -> Path:
    """A copy of ``dataset``'s index in ``tmp_path/evil`` whose first shard url is ``url`` (the rest are copied
    beside it): the index of a dataset that points elsewhere."""
    evil = tmp_path / "evil"
    evil.mkdir(parents=True)
    d = ShardIndex.load(str(dataset)).to_json()
    for s in d["shards"][1:]:
        shutil.copy(dataset / s["url"], evil / s["url"])
    d["shards"][0]["url"] = url
    if version == 1:
        (evil / "index.json").write_text(json.dumps(d))
    else:
        ShardIndex.from_json(d).save(str(evil), version=2)
    return evil


def outside(tmp_path: Path, dataset: Path, folder: Path | None = None) -> Path:
    """The dataset's first shard, copied to a folder outside the hostile dataset; its path."""
    first = ShardIndex.load(str(dataset)).shards[0].url
    folder = folder or tmp_path / "outside"
    folder.mkdir(exist_ok=True)
    return Path(shutil.copy(dataset / first, folder / first))


def epoch_keys(source: str, **kw) -> collections.Counter:
    loader = StreamBatchLoader(source, budget=BUDGET, seed=1, **kw)
    return collections.Counter(k for b in loader for k in b["keys"])


def one_line(message: str, url: str, option: str) -> None:
    assert "\n" not in message.strip(), message
    assert url in message and option in message, message


LOCAL = {
    "dotdot": lambda tar: "../outside/" + tar.name,
    "absolute": lambda tar: str(tar),
    "file_url": lambda tar: "file://" + str(tar),
}


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("kind", sorted(LOCAL))
def test_a_local_url_outside_the_dataset_is_refused_unopened_and_allowed_by_the_user(
    tmp_path, dataset, opened_in, kind, version
):
    tar = outside(tmp_path, dataset)
    evil = pointing(tmp_path, dataset, LOCAL[kind](tar), version)
    seen = opened_in(tar.parent)
    with pytest.raises(UntrustedURL) as e:
        StreamBatchLoader(str(evil), budget=BUDGET)
    one_line(str(e.value), str(tar) if kind != "dotdot" else "outside/" + tar.name, "shard_roots=")
    assert f"--shard-root {tar.parent}" in str(e.value)
    assert seen == []  # refused before the file was opened
    with pytest.raises(UntrustedURL):
        ShardIndex.load(str(evil)).shard_urls()  # the index's own API refuses as well
    assert epoch_keys(str(evil), shard_roots=[str(tar.parent)]) == keys_of(dataset)
    assert seen  # allowed: read


def test_system_files_are_never_read_by_default(tmp_path, dataset, opened_in):
    for url in ("/etc/passwd", "file:///etc/shadow", "../../../../../../etc/hostname"):
        evil = pointing(tmp_path, dataset, url)
        seen = opened_in(Path("/etc"))
        with pytest.raises(UntrustedURL, match="refused before opening it"):
            StreamBatchLoader(str(evil), budget=BUDGET)
        assert seen == []
        shutil.rmtree(evil)


def test_an_http_url_is_not_requested_unless_its_host_is_allowed(tmp_path, dataset, http_server):
    base, served, requests = http_server
    tar = outside(tmp_path, dataset, served)
    url = base + tar.name
    evil = pointing(tmp_path, dataset, url)
    with pytest.raises(UntrustedURL) as e:
        StreamBatchLoader(str(evil), budget=BUDGET, retries=8)
    one_line(str(e.value), url, "shard_roots=")
    assert requests == []  # not one request
    assert epoch_keys(str(evil), shard_roots=[base]) == keys_of(dataset)
    assert requests  # allowed: fetched from the server


def test_the_cli_refuses_in_one_line_and_allows_with_shard_root(tmp_path, dataset, http_server, capsys, opened_in):
    base, served, requests = http_server
    tar = outside(tmp_path, dataset)
    evil = pointing(tmp_path, dataset, str(tar))
    seen = opened_in(tar.parent)
    for command in (["verify", str(evil)], ["stage", str(evil), str(tmp_path / "staged")]):
        capsys.readouterr()
        assert main([*command, "--no-progress"]) == 2
        err = capsys.readouterr().err
        one_line(err, str(tar), "--shard-root")
    assert seen == [] and not (tmp_path / "staged").exists()
    assert main(["verify", str(evil), "--no-progress", "--shard-root", str(tar.parent)]) == 0
    assert main(["stage", str(evil), str(tmp_path / "staged"), "--no-progress", "--shard-root", str(tar.parent)]) == 0
    assert keys_of(tmp_path / "staged") == keys_of(dataset)  # the staged copy holds every shard: no option needed

    web = pointing(tmp_path / "web", dataset, base + outside(tmp_path, dataset, served).name)
    capsys.readouterr()
    assert main(["verify", str(web), "--no-progress"]) == 2
    one_line(capsys.readouterr().err, base, "--shard-root")
    assert requests == []
    main(["verify", str(web), "--no-progress", "--shard-root", base])
    assert requests  # allowed: requested


def test_a_mixture_file_names_datasets_beside_it_unless_the_user_allows_more(tmp_path, dataset, capsys):
    mixdir = tmp_path / "mix"
    mixdir.mkdir()
    shutil.copytree(dataset, mixdir / "inside")
    spec = {"datasets": [{"name": "in", "path": "inside"}, {"name": "out", "path": str(dataset)}]}
    (mixdir / "mix.json").write_text(json.dumps(spec))
    mix = str(mixdir / "mix.json")
    with pytest.raises(UntrustedURL) as e:
        StreamBatchLoader(mix, budget=BUDGET)
    one_line(str(e.value), str(dataset), f"shard_roots=[{str(dataset)!r}]")
    assert sum(epoch_keys(mix, shard_roots=[str(dataset)]).values()) == 2 * sum(keys_of(dataset).values())
    capsys.readouterr()
    assert main(["inspect", mix]) == 2
    one_line(capsys.readouterr().err, str(dataset), "--shard-root")
    assert main(["inspect", mix, "--shard-root", str(dataset)]) == 0


def test_an_index_object_given_to_the_loader_takes_the_users_roots(tmp_path, dataset):
    tar = outside(tmp_path, dataset)
    evil = pointing(tmp_path, dataset, str(tar))
    with pytest.raises(UntrustedURL):
        StreamBatchLoader(str(evil), index=ShardIndex.load(str(evil)), budget=BUDGET)
    ix = ShardIndex.load(str(evil))
    assert epoch_keys(str(evil), index=ix, shard_roots=[str(tar.parent)]) == keys_of(dataset)


def test_shard_roots_must_be_folders_or_urls():
    from streambatch import OptionError

    for bad in (3, [""], [None]):
        with pytest.raises(OptionError, match="shard_roots"):
            StreamBatchLoader("nowhere", budget=BUDGET, shard_roots=bad)


# ---- the check itself ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "url,ok",
    [
        ("s3://bucket/prefix/a.tar", True),
        ("s3://bucket/prefix/sub/a.tar", True),
        ("s3://bucket/other/x.tar", False),
        ("s3://bucket/prefix-2/x.tar", False),  # a sibling sharing the prefix's first letters
        ("s3://bucket/prefix/../other/x.tar", False),
        ("s3://bucket/prefix/%2e%2e/other/x.tar", False),  # percent-encoded ..
        ("s3://bucket/prefix//../other/x.tar", False),
        ("s3://bucket/prefix/..\\..\\other/x.tar", False),  # backslashes, as some URL parsers read them
        ("s3://bucket2/prefix/a.tar", False),
        ("gs://bucket/prefix/a.tar", False),
        ("http://bucket/prefix/a.tar", False),
        ("simplecache::s3://bucket/prefix/a.tar", False),  # another chain: another filesystem
        ("/bucket/prefix/a.tar", False),
        ("s3://BUCKET/prefix/a.tar", True),  # host names are case-insensitive
    ],
)
def test_object_storage_urls_stay_under_the_bucket_prefix(url, ok):
    roots = Roots("s3://bucket/prefix")
    assert roots.contains(url) is ok
    if not ok:
        with pytest.raises(UntrustedURL, match=re.escape(url)):
            roots.check(url)


def test_local_roots_normalise_before_comparing(tmp_path):
    roots = Roots(str(tmp_path / "ds"), [str(tmp_path / "tars")])
    assert roots.contains(str(tmp_path / "ds" / "a" / ".." / "b.tar"))
    assert roots.contains("file://" + str(tmp_path / "tars" / "x.tar"))
    assert not roots.contains(str(tmp_path / "ds" / ".." / "x.tar"))
    assert not roots.contains(str(tmp_path / "dsx" / "a.tar"))
    assert place("http://h:8/a/./b/../c") == ("http", "h:8", "/a/c")


def test_the_roots_a_command_reports_cover_exactly_what_lies_outside(tmp_path):
    own = str(tmp_path / "idx")
    urls = [
        str(tmp_path / "idx" / "a.tar"),
        str(tmp_path / "ro" / "x" / "1.tar"),
        str(tmp_path / "ro" / "y" / "2.tar"),
        "s3://b/raw/1.tar",
        "s3://b/raw/more/2.tar",
    ]
    found = roots_for(urls, own)
    assert found == [str(tmp_path / "ro"), "s3://b/raw/"]
    roots = Roots(own, found)
    assert all(roots.contains(u) for u in urls)
    assert roots_for(urls[:1], own) == []
    assert allow_line(found, own).startswith(f"shards live outside {own}: load with shard_roots=[")
