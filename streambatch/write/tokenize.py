"""Tokenizers for ``shardify write``: ``--tokenizer`` (a text dataset's lengths in the tokenizer's tokens, its
``input_ids`` stored) and ``--output-length`` (a second length per sample: transcript characters or tokens).

A tokenizer is a Hugging Face ``tokenizers`` file (``tokenizer.json``, or a folder holding one), a
sentencepiece model (``*.model``), or a name on the Hugging Face hub (downloaded once; needs a network). Both
libraries are optional (``pip install 'streambatch[text]'``). The index records the tokenizer's name and a hash
of its serialized form (`TextTokenizer.describe()`), so ids from another tokenizer can be told apart.
"""

from __future__ import annotations

import hashlib
import itertools
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import InputProblem, ShardifyError
from .records import Record
from .spill import SpillList

TOKENIZER_FILE = "tokenizer.json"
OUTPUT_LENGTHS = ("chars", "tokens:NAME")


@dataclass
class TextTokenizer:
    """A loaded tokenizer: ``kind`` is ``tokenizers`` or ``sentencepiece``; ``sha256`` hashes its serialized
    form (the same tokenizer from another path has the same hash)."""

    name: str
    kind: str
    sha256: str
    vocab_size: int
    impl: Any

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text (special tokens as the tokenizer's own post-processing adds them)."""
        if not texts:
            return []
        if self.kind == "sentencepiece":
            return [list(ids) for ids in self.impl.encode(list(texts))]
        return [e.ids for e in self.impl.encode_batch(list(texts))]

    def describe(self) -> dict[str, Any]:
        """What the index header records about the tokenizer."""
        return {"name": self.name, "kind": self.kind, "sha256": self.sha256, "vocab_size": self.vocab_size}


def _need(module: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ShardifyError(f"--tokenizer needs the {module!r} package: pip install 'streambatch[text]'") from None


def load_tokenizer(name_or_path: str) -> TextTokenizer:
    """A tokenizer from a ``tokenizer.json`` (or a folder holding one), a sentencepiece ``.model`` file, or a
    Hugging Face hub name; a missing file, an unreadable model or an unreachable hub is a one-line error."""
    path = os.path.expanduser(str(name_or_path))
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, TOKENIZER_FILE)):
            raise ShardifyError(f"{name_or_path}: a folder without {TOKENIZER_FILE}; pass the tokenizer file")
        path = os.path.join(path, TOKENIZER_FILE)
    if os.path.isfile(path):
        with open(path, "rb") as f:
            head = f.read(64).lstrip()
        if path.endswith(".model") or not head.startswith(b"{"):
            return _sentencepiece(str(name_or_path), path)
        return _hf_tokenizer(str(name_or_path), path)
    if path.endswith((".json", ".model")) or path.startswith((".", "/")) or path.count("/") > 1:
        raise ShardifyError(f"{name_or_path}: no such tokenizer file")
    return _hf_tokenizer(str(name_or_path), _hub_file(str(name_or_path)))


def _hf_tokenizer(name: str, path: str) -> TextTokenizer:
    tokenizers = _need("tokenizers")
    try:
        tok = tokenizers.Tokenizer.from_file(path)
    except Exception as e:  # noqa: BLE001 - the Rust library raises a plain Exception for a bad file
        raise ShardifyError(f"{name}: not a Hugging Face tokenizers file ({str(e).splitlines()[0]})") from None
    sha = hashlib.sha256(tok.to_str().encode("utf-8")).hexdigest()
    return TextTokenizer(name, "tokenizers", sha, int(tok.get_vocab_size()), tok)


def _sentencepiece(name: str, path: str) -> TextTokenizer:
    spm = _need("sentencepiece")
    try:
        sp = spm.SentencePieceProcessor(model_file=path)
    except Exception as e:  # noqa: BLE001 - sentencepiece raises RuntimeError/OSError for a bad model
        raise ShardifyError(f"{name}: not a sentencepiece model ({str(e).splitlines()[0]})") from None
    sha = hashlib.sha256(sp.serialized_model_proto()).hexdigest()
    return TextTokenizer(name, "sentencepiece", sha, int(sp.vocab_size()), sp)


def _hub_file(name: str) -> str:
    """``tokenizer.json`` of the hub model ``name`` (from the local cache when there)."""
    _need("tokenizers")
    hub = _need("huggingface_hub")
    _need("huggingface_hub.utils.logging").set_verbosity_error()  # no retry chatter: one line says what is wrong
    try:
        return hub.hf_hub_download(name, TOKENIZER_FILE)
    except Exception as e:  # noqa: BLE001 - network, missing repo, missing file: all mean "cannot load it"
        msg = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ShardifyError(
            f"--tokenizer {name}: not a file here, and its {TOKENIZER_FILE} could not be fetched "
            f"from the Hugging Face hub ({type(e).__name__}: {msg}); pass a local tokenizer file"
        ) from None


# ---- using a tokenizer on records ----------------------------------------------------------------------
def tokenize_records(records: Iterable[Record], tok: TextTokenizer) -> tuple[SpillList[Record], list[InputProblem]]:
    """Text records with ``input_ids`` from ``tok`` (their length becomes the ids' count). A record given both
    text and other ``input_ids`` is a problem (ids of another tokenizer); one with ids only keeps them. Encoded
    `BATCH` records at a time (a long source's texts are never all in memory)."""
    kept: SpillList[Record] = SpillList()
    problems: list[InputProblem] = []
    for batch in _batches(records):
        encoded = iter(tok.encode([r.text for r in batch if r.text is not None]))
        for r in batch:
            ids = next(encoded) if r.text is not None else None
            if ids is not None:
                if r.input_ids is not None and list(r.input_ids) != ids:
                    problems.append(r.problem(f"its input_ids are not what --tokenizer {tok.name} makes of its text"))
                    continue
                r.input_ids = ids
            r.length = None  # the true count of the stored ids
            kept.append(r)
    return kept, problems


#: records a tokenizer encodes in one call
BATCH = 4096


def _batches(records: Iterable[Record]) -> Iterator[list[Record]]:
    it = iter(records)
    while batch := list(itertools.islice(it, BATCH)):
        yield batch


@dataclass
class OutputLength:
    """How ``--output-length`` gives a sample its second length: ``chars`` (transcript characters), ``tokens``
    of ``tokenizer``, or (``shardify index`` only) ``column``: the integer ``field`` of the sample's manifest
    entry or ``.json``, as it is."""

    unit: str
    tokenizer: TextTokenizer | None = None
    field: str | None = None

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"unit": self.unit}
        if self.tokenizer is not None:
            out["tokenizer"] = self.tokenizer.describe()
        if self.field is not None:
            out["field"] = self.field
        return out

    def count(self, texts: Sequence[str]) -> list[int]:
        """The length of each transcript: its characters, or its tokens (one batched encode)."""
        if self.tokenizer is None:
            return [len(t) for t in texts]
        return [len(ids) for ids in self.tokenizer.encode(list(texts))]


def parse_output_length(spec: str | None, column: bool = False) -> OutputLength | None:
    """``chars`` or ``tokens:NAME_OR_PATH`` (the tokenizer loaded), and with ``column`` also ``column:FIELD``;
    None stays None."""
    if spec is None:
        return None
    if spec == "chars":
        return OutputLength("chars")
    kind, sep, name = str(spec).partition(":")
    if kind == "tokens" and sep and name:
        return OutputLength("tokens", load_tokenizer(name))
    if column and kind == "column" and sep and name:
        return OutputLength("column", field=name)
    forms = "'chars', 'tokens:TOKENIZER' or 'column:FIELD'" if column else "'chars' or 'tokens:TOKENIZER'"
    raise ShardifyError(f"--output-length must be {forms}, not {spec!r}")


def output_lengths(records: Iterable[Record], how: OutputLength) -> tuple[SpillList[Record], list[InputProblem]]:
    """Each record's transcript length (``Record.output_length``); one without a transcript is a problem."""
    kept: SpillList[Record] = SpillList()
    problems: list[InputProblem] = []
    for batch in _batches(records):
        have = [r for r in batch if r.text is not None]
        problems += (
            r.problem(f"no transcript ('text') to count for --output-length {how.unit}")
            for r in batch
            if r.text is None
        )
        for r, n in zip(have, how.count([r.text or "" for r in have])):
            r.output_length = n
            kept.append(r)
    return kept, problems


@dataclass
class TextOptions:
    """``shardify write``'s text options, checked against the source's samples (``text`` or ``audio``)."""

    tokenizer: TextTokenizer | None = None
    output: OutputLength | None = None

    @classmethod
    def load(cls, tokenizer: str | None, output_length: str | None, medium: str) -> TextOptions:
        """Check the options fit the source, then load the tokenizers they name."""
        if tokenizer is not None and medium != "text":
            raise ShardifyError(
                "--tokenizer measures text sources; for the transcripts of an audio source "
                "pass --output-length tokens:TOKENIZER"
            )
        if output_length is not None and medium == "text":
            raise ShardifyError(
                "--output-length counts the transcripts of an audio source; a text source's "
                "length is its tokens (--tokenizer)"
            )
        return cls(load_tokenizer(tokenizer) if tokenizer else None, parse_output_length(output_length))

    def apply(self, records: Sequence[Record]) -> tuple[Sequence[Record], list[InputProblem]]:
        """The records tokenized and/or given their output length; the ones that cannot be, as problems."""
        problems: list[InputProblem] = []
        if self.tokenizer is not None:
            records, problems = tokenize_records(records, self.tokenizer)
        if self.output is not None:
            records, more = output_lengths(records, self.output)
            problems += more
        return records, problems

    def meta(self) -> dict[str, Any]:
        """What the index header's meta records: ``tokenizer`` and/or ``output_length``."""
        out: dict[str, Any] = {}
        if self.tokenizer is not None:
            out["tokenizer"] = self.tokenizer.describe()
        if self.output is not None:
            out["output_length"] = self.output.describe()
        return out
