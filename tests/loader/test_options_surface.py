"""The loader's surface is declared once: every option is a named keyword of ``StreamBatchLoader`` with the default
its group (a typed dataclass) has, every option the manual's tables name is there, and a bad value is an
``OptionError`` naming the option."""

from __future__ import annotations

import dataclasses
import inspect
import re

import pytest
from conftest import REPO, text_dataset

from streambatch import OptionError, StreamBatchLoader
from streambatch.loader.options import RunOptions, SampleOptions, init_fields
from streambatch.plan.config import FIELDS, BatchingConfig
from streambatch.read.reader import ReadOptions

ROOT = REPO
PARAMS = inspect.signature(StreamBatchLoader).parameters
#: what BatchingConfig.make takes that is not an option: figures the loader reads from the index
MAKE_INTERNAL = {"cls", "budget", "lengths", "mean_length", "sample_bytes", "options"}


def make_options() -> dict[str, inspect.Parameter]:
    params = inspect.signature(BatchingConfig.make).parameters
    return {k: p for k, p in params.items() if k not in MAKE_INTERNAL}


def defaults(names) -> dict:
    return {k: PARAMS[k].default for k in names}


def test_every_option_is_a_named_keyword_with_no_catch_all():
    assert not [p for p in PARAMS.values() if p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    groups = [init_fields(ReadOptions), init_fields(SampleOptions), init_fields(RunOptions)]
    batching = [f.name for f in dataclasses.fields(BatchingConfig)] + list(make_options())
    wanted = set(batching).union(*groups) | {"source", "weights", "index", "where", "storage_options"}
    assert wanted <= set(PARAMS), sorted(wanted - set(PARAMS))
    assert set(PARAMS) <= wanted, sorted(set(PARAMS) - wanted)  # nothing in the signature outside a group
    assert len(PARAMS) == 62  # the source and 61 options


def test_the_signature_defaults_are_the_groups_defaults():
    for group in (ReadOptions, SampleOptions, RunOptions):
        built = group(**defaults(init_fields(group)))
        assert built == group(), group.__name__
    fields = {f.name: f for f in dataclasses.fields(BatchingConfig)}
    for name in FIELDS:
        assert PARAMS[name].default == fields[name].default, name
    for name, p in make_options().items():
        assert PARAMS[name].default == p.default, name


def test_every_field_of_a_group_has_a_docstring():
    """Each option is documented where it is declared (the API reference is generated from these)."""
    for group in (BatchingConfig, ReadOptions, SampleOptions, RunOptions):
        source = inspect.getsource(group)
        for name in init_fields(group):
            assert re.search(rf"\n    {name}: [^\n]*\n    \"\"\"", source), f"{group.__name__}.{name}"


def test_every_option_the_manual_names_is_in_the_signature():
    """Rows of the manual's option tables (``| option | default | meaning |``) that name Python options."""
    named: set[str] = set()
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        in_table = False
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.startswith("| option"):
                in_table = True
            elif not line.startswith("|"):
                in_table = False
            elif in_table:
                first = line.split("|")[1]
                named.update(n for n in re.findall(r"`([^`]+)`", first) if re.fullmatch(r"[a-z_]+", n))
    assert len(named) >= 40, sorted(named)  # the tables were found
    assert named <= set(PARAMS), sorted(named - set(PARAMS))


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return text_dataset(tmp_path_factory.mktemp("surface"), 30, 0, max_count=10)


@pytest.mark.parametrize(
    "option, value",
    [
        ("num_workers", 1.5),
        ("num_workers", "2"),
        ("num_workers", -1),
        ("even_batches", "even"),
        ("hardest_first", "yes"),
        ("planning", "none"),
        ("micro_batches", 0),
        ("loss_weight_by", "tokens"),
        ("buffer_size", 0),
        ("max_batch_size", 2.5),
        ("shuffle", "no"),
        ("batch_order", "sorted"),
        ("chunk_size", "lots"),
        ("read_concurrency", 0),
        ("verify", "md5"),
        ("retries", -1),
        ("timeout", 0),
        ("decode", "video"),
        ("transform", 3),
        ("world_size", 0),
        ("dp_size", 0),
    ],
)
def test_a_bad_value_is_an_option_error_naming_it(dataset, option, value):
    with pytest.raises(OptionError, match=option):
        StreamBatchLoader(dataset, 400, **{option: value})
