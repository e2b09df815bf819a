"""``shardify write``'s text arguments (``--tokenizer``, ``--output-length``), kept here so ``cli.py`` stays a
table of commands."""

from __future__ import annotations

import argparse

SOURCE_HELP = (
    "Hugging Face datasets: hf:NAME[:SPLIT] or hf:NAME:CONFIG:SPLIT (from the hub, needs a network), or "
    "a folder written by Dataset.save_to_disk (hf:DIR:SPLIT picks a split of a DatasetDict; default "
    "train, or the only one)"
)


def add_arguments(w: argparse.ArgumentParser) -> None:
    """Add ``--tokenizer`` and ``--output-length`` to the ``write`` parser."""
    w.add_argument(
        "--tokenizer",
        metavar="NAME_OR_PATH",
        help="text sources: store each text's input_ids from this tokenizer and count lengths in its "
        "tokens (the true count of the stored ids). A Hugging Face tokenizers file (tokenizer.json, or "
        "a folder holding one), a sentencepiece .model file, or a hub name (needs a network). Its "
        "name and sha256 go into the index's meta. Needs pip install 'streambatch[text]'",
    )
    w.add_argument(
        "--output-length",
        metavar="chars|tokens:NAME_OR_PATH",
        help="audio sources: give each sample a second length, its transcript's characters (chars) "
        "or tokens of a tokenizer (tokens:NAME_OR_PATH, as --tokenizer); stored as output_length in "
        "each .json and in the index's sample table. A sample without a transcript is bad input",
    )
