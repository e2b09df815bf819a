"""The loader's door: a dozen everyday keywords and four typed groups, each option's default written once in its
group's field (with its docstring) and shown by ``help()``. A group passed as an object gives the same loader as
its options flat by name; an unknown name, or an option given both ways, is one line of ``OptionError``."""

from __future__ import annotations

import inspect
import pydoc
import re

import pytest
from conftest import REPO, text_dataset

from streambatch import BatchingOptions, OptionError, ReadOptions, RunOptions, SampleOptions, StreamBatchLoader
from streambatch.loader.options import GROUP_OF, GROUPS, PLAIN, field_default, init_fields

ROOT = REPO
PARAMS = inspect.signature(StreamBatchLoader).parameters


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return text_dataset(tmp_path_factory.mktemp("surface"), 120, 0, max_count=10)


def keys(loader: StreamBatchLoader, epochs: int = 2) -> list[list[str]]:
    return [list(b["keys"]) for _ in range(epochs) for b in loader]


def test_help_shows_a_dozen_keywords_and_the_groups_with_their_defaults():
    named = [p for p in PARAMS.values() if p.kind is not p.VAR_KEYWORD]
    assert 10 <= len(named) <= 18, [p.name for p in named]
    assert {"batching", "reading", "per_sample", "run"} <= set(PARAMS)
    text = pydoc.render_doc(StreamBatchLoader, renderer=pydoc.plaintext)
    for p in named:
        if p.name in GROUP_OF:  # an everyday keyword of a group: help() shows its field's default
            default = field_default(GROUPS[GROUP_OF[p.name]], p.name)
            assert re.search(rf"{p.name}: '[^']+' = {re.escape(repr(default))}[,)]", text), p.name
        assert f":param {p.name}:" in inspect.getdoc(StreamBatchLoader), p.name  # and documents it
    for group in GROUPS.values():
        assert group.__name__ in text


def test_every_field_of_a_group_has_a_docstring():
    """Each option is documented where it is declared (the API reference is generated from these)."""
    for group in GROUPS.values():
        source = inspect.getsource(group)
        for name in init_fields(group):
            assert re.search(rf"\n    {name}: [^\n]*\n    \"\"\"", source), f"{group.__name__}.{name}"


@pytest.mark.parametrize(
    "options",
    [
        dict(num_buckets=4, drop_last=True, batch_order="descending", max_batch_size=6, seed=3, interleave=2),
        dict(shuffle=False, batch_size_multiple_of=2, min_length=5, buffer_size=40, refill=10),
    ],
)
def test_a_batching_group_gives_the_same_batches_as_its_options_flat(dataset, options):
    flat = StreamBatchLoader(dataset, 400, **options)
    grouped = StreamBatchLoader(dataset, 400, batching=BatchingOptions(**options))
    assert grouped.batching_options == flat.batching_options
    got, want = keys(grouped), keys(flat)
    assert got == want and len(want) > 4


def test_every_group_may_be_passed_as_an_object_and_updated_flat(dataset):
    flat = StreamBatchLoader(dataset, 400, seed=5, shuffle=False, retries=2, decode="text", rank=1, world_size=2)
    grouped = StreamBatchLoader(
        dataset,
        400,
        batching=BatchingOptions(seed=5),
        reading=ReadOptions(retries=2),
        per_sample=SampleOptions(decode="text"),
        run=RunOptions(rank=1, world_size=2),
        shuffle=False,  # flat beside its group: the group updated
    )
    assert (grouped.read_options, grouped.sample_options, grouped.run) == (
        flat.read_options,
        flat.sample_options,
        flat.run,
    )
    assert keys(grouped, 1) == keys(flat, 1)


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        (dict(seed=4, batching=BatchingOptions(seed=3)), "seed is given twice, as seed=4 and in batching="),
        (dict(num_workers=0, run=RunOptions(num_workers=1)), "num_workers is given twice"),
        (dict(retries=1, reading=ReadOptions(retries=2)), "retries is given twice"),
        (dict(num_worker=2), "unknown loader option 'num_worker': did you mean 'num_workers'?"),
        (dict(batching=ReadOptions()), "batching must be a BatchingOptions, got a ReadOptions"),
    ],
)
def test_an_unknown_or_doubled_option_is_one_line_naming_it(dataset, kwargs, says):
    with pytest.raises(OptionError, match=re.escape(says)) as got:
        StreamBatchLoader(dataset, 400, **kwargs)
    assert "\n" not in str(got.value)


def test_every_option_the_manual_names_is_an_option():
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
    known = set(GROUP_OF) | set(PLAIN) | set(PARAMS)
    assert named <= known, sorted(named - known)
