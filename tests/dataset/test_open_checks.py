"""Opening what the loader reads: a mixture that names no dataset, names one by anything but a non-empty string or
points it at no path, or weighs every dataset 0 is one line of ``OptionError`` where the loader is built;
``ShardIndex.load`` of a path that is there but is no index (a file, ``/dev/null``, an ``index.json`` folder) is an
``IndexFormatError`` naming it and what is expected, of nothing at all a ``FileNotFoundError`` as the loader's own,
of an empty or non-path argument an ``OptionError``."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import text_mixture

from streambatch import DatasetNotFound, IndexFormatError, OptionError, StreamBatchError, StreamBatchLoader
from streambatch.format.index import ShardIndex

BUDGET = 2000


@pytest.fixture(scope="module")
def mix(tmp_path_factory):
    return text_mixture(tmp_path_factory.mktemp("open"), 20)


def refused(error: type[Exception], build, *words: str) -> str:
    with pytest.raises(error) as e:
        build()
    text = str(e.value)
    assert "\n" not in text, text
    for w in words:
        assert w in text, (w, text)
    return text


@pytest.mark.parametrize("source", [{}, [], ()], ids=["dict", "list", "tuple"])
def test_a_mixture_of_no_dataset_is_an_option_error(source):
    refused(OptionError, lambda: StreamBatchLoader(source, BUDGET), "source", "at least one dataset")


def test_a_mixture_of_no_dataset_with_weights_is_an_option_error():
    refused(OptionError, lambda: StreamBatchLoader([], BUDGET, weights=[]), "at least one dataset")
    refused(OptionError, lambda: StreamBatchLoader({}, BUDGET, weights={}), "at least one dataset")


@pytest.mark.parametrize("weights", [{"a": 0, "b": 0}, [0, 0], [0.0, 0]], ids=str)
def test_weights_that_are_all_zero_are_an_option_error(mix, weights):
    refused(OptionError, lambda: StreamBatchLoader(mix, BUDGET, weights=weights), "weights", "all 0")


def test_a_schedule_epoch_with_all_weights_zero_names_the_epoch(mix):
    schedule = [{"a": 1, "b": 1}, {"a": 0, "b": 0}]
    refused(OptionError, lambda: StreamBatchLoader(mix, BUDGET, weights=schedule), "epoch 1", "all 0")


@pytest.mark.parametrize("name", [1, "", None, ("a",)], ids=repr)
def test_a_dataset_name_that_is_not_a_non_empty_string_is_an_option_error(mix, name):
    source = {name: mix["a"], "b": mix["b"]}
    refused(OptionError, lambda: StreamBatchLoader(source, BUDGET), "dataset names", repr(name))


@pytest.mark.parametrize("url", [5, None, ""], ids=repr)
def test_a_dataset_that_is_not_a_path_is_an_option_error(mix, url):
    refused(OptionError, lambda: StreamBatchLoader({"a": mix["a"], "b": url}, BUDGET), "source['b']", repr(url))
    refused(OptionError, lambda: StreamBatchLoader([mix["a"], url], BUDGET, weights=[1, 1]), "source[1]", repr(url))


def test_a_good_mixture_still_reads_every_sample(mix):
    loader = StreamBatchLoader({"a": Path(mix["a"]), "b": mix["b"]}, BUDGET, weights={"a": 1, "b": 0})
    assert sum(len(b["lengths"]) for b in loader) == 20


# ---- ShardIndex.load ---------------------------------------------------------------------------------------------
def test_a_file_is_not_an_index(mix):
    shard = sorted(Path(mix["a"]).glob("*.tar"))[0]
    for path in (str(shard), "/dev/null"):
        refused(IndexFormatError, lambda p=path: ShardIndex.load(p), path, "not a folder", "shardify write")


def test_an_index_json_that_is_a_folder_is_not_an_index(tmp_path):
    (tmp_path / "index.json").mkdir()
    refused(IndexFormatError, lambda: ShardIndex.load(tmp_path), str(tmp_path / "index.json"), "folder", "shardify")
    # the folder itself is read as a dataset folder (a dataset may be named *.json), holding no index
    refused(DatasetNotFound, lambda: ShardIndex.load(tmp_path / "index.json"), str(tmp_path / "index.json"))


def test_nothing_there_is_a_dataset_not_found_error_as_for_the_loader(tmp_path):
    """A missing dataset folder (or one without an index) is the package's ``DatasetNotFound``, still a
    ``FileNotFoundError``, from the index reader and the loader alike, saying what it expected."""
    for path in (tmp_path / "nope", tmp_path):
        refused(DatasetNotFound, lambda p=path: ShardIndex.load(str(p)), str(path), "shardify write")
        with pytest.raises(DatasetNotFound) as e:
            StreamBatchLoader(str(path), BUDGET)
        assert isinstance(e.value, FileNotFoundError) and isinstance(e.value, StreamBatchError)


@pytest.mark.parametrize("url", ["", 5, None], ids=repr)
def test_an_empty_or_non_path_argument_is_an_option_error(url):
    refused(OptionError, lambda: ShardIndex.load(url), repr(url), "shardify write")
    # the loader's source too: '' read ./index.json from the working folder, 5 and None looked for "5/", "None/"
    refused(OptionError, lambda: StreamBatchLoader(url, BUDGET), "source must be a dataset folder", repr(url))


def test_an_index_still_loads_from_its_folder_its_file_or_a_path(mix):
    folder = mix["a"]
    for given in (folder, folder + "/index.json", Path(folder), "file://" + folder):
        assert ShardIndex.load(given).num_samples == 20


def test_an_index_beside_a_mixture_is_refused_not_ignored(mix):
    refused(OptionError, lambda: StreamBatchLoader(mix, BUDGET, index=mix["a"]), "index=", "mixture")
