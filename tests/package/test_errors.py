"""Every exception the package raises on purpose derives from one root, keeps the builtin base users catch, and
is exported from the top level."""

import importlib
import inspect
import pkgutil

import pytest

import streambatch
from streambatch import errors


def _package_exceptions():
    """Every exception class defined in a streambatch module (private helpers included)."""
    found = {}
    for mod in pkgutil.walk_packages(streambatch.__path__, "streambatch."):
        if mod.name.endswith(("lightning", "hf", "__main__")):  # need the lightning and hf-train extras
            continue
        module = importlib.import_module(mod.name)
        for name, obj in vars(module).items():
            if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__.startswith("streambatch"):
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return found


def test_every_package_exception_derives_from_the_root():
    found = _package_exceptions()
    assert len(found) >= 15
    strays = sorted(n for n, c in found.items() if not issubclass(c, errors.StreamBatchError))
    assert not strays, f"exceptions outside StreamBatchError: {strays}"


def test_the_public_errors_are_exported_and_keep_their_builtin_bases():
    for name in ("BudgetError", "EmptyEpochError", "OptionError", "IndexFormatError", "AudioError", "ColumnError"):
        assert issubclass(getattr(streambatch, name), ValueError), name
    assert issubclass(streambatch.MissingCredentials, PermissionError)
    assert issubclass(streambatch.ShardReadError, OSError)
    assert issubclass(streambatch.TooManyBadShards, RuntimeError)
    exported = {getattr(streambatch, n) for n in streambatch.__all__}
    defined = {c for c in vars(errors).values() if inspect.isclass(c) and issubclass(c, errors.StreamBatchError)}
    assert defined <= exported


def test_the_old_index_error_name_still_catches():
    from streambatch.dataset.columnar import IndexError_

    with pytest.raises(IndexError_):
        raise streambatch.IndexFormatError("x")
