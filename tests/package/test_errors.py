"""Every exception the package raises on purpose derives from one root, is of one of its four kinds (options, data,
storage, state), keeps the builtin base users catch, and is exported from the top level; `shardify` exits 2 for
each kind and 1 for anything else."""

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


def test_every_package_exception_is_of_one_kind():
    """options, data, storage or state: ``except`` a kind handles all of it."""
    assert len(errors.KINDS) == 4 and all(issubclass(k, errors.StreamBatchError) for k in errors.KINDS)
    found = {n: c for n, c in _package_exceptions().items() if c not in (errors.StreamBatchError, *errors.KINDS)}
    kinds = {n: [k.__name__ for k in errors.KINDS if issubclass(c, k)] for n, c in found.items()}
    assert not {n: k for n, k in kinds.items() if len(k) != 1}, "each error is of exactly one kind"


#: what users catch today: each public error keeps its builtin base (``except ValueError`` still works)
_BUILTIN_BASES = {
    "OptionError": ValueError,
    "BudgetError": ValueError,
    "EmptyEpochError": ValueError,
    "UnknownStorage": ValueError,
    "CalibrationError": RuntimeError,
    "IndexFormatError": ValueError,
    "IndexMismatch": RuntimeError,
    "SampleError": ValueError,
    "ColumnError": ValueError,
    "AudioError": ValueError,
    "TruncatedAudio": ValueError,
    "SampleTooLongError": ValueError,
    "UntrustedURL": ValueError,
    "ShardReadError": OSError,
    "ChecksumMismatch": OSError,
    "TooManyBadShards": RuntimeError,
    "StorageError": OSError,
    "MissingCredentials": PermissionError,
    "DatasetNotFound": FileNotFoundError,
    "RetriesExhausted": OSError,
    "StateError": ValueError,
}


def test_the_public_errors_are_exported_and_keep_their_builtin_bases():
    for name, base in _BUILTIN_BASES.items():
        assert issubclass(getattr(streambatch, name), base), name
        assert issubclass(getattr(errors, name), errors.KINDS), name
    exported = {getattr(streambatch, n) for n in streambatch.__all__}
    defined = {c for c in vars(errors).values() if inspect.isclass(c) and issubclass(c, errors.StreamBatchError)}
    assert defined <= exported


def test_a_loader_error_is_not_a_shardify_error(tmp_path):
    """The loader's option errors are of the options kind, ``ValueError``s, and no error of the ``shardify``
    command; the command's own are of the options kind too."""
    from conftest import text_dataset

    from streambatch import StreamBatchLoader

    ds = text_dataset(tmp_path, 20, seed=1)
    for options, error in (({"budget": -1}, streambatch.BudgetError), ({"num_workers": -1}, streambatch.OptionError)):
        with pytest.raises(error) as e:
            StreamBatchLoader(ds, **{"budget": 500, **options})
        assert isinstance(e.value, (streambatch.UsageError, ValueError))
        assert not isinstance(e.value, streambatch.ShardifyError)
    assert issubclass(streambatch.ShardifyError, streambatch.UsageError)


def test_the_cli_exits_2_for_bad_options_data_and_storage(tmp_path, capsys):
    """Real commands meeting an error of each kind it can meet: one line naming the value or file, exit 2."""
    from conftest import text_dataset

    from streambatch.cli import main

    ds = text_dataset(tmp_path, 20, seed=1)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "index.json").write_text('{"format": ')
    cases = [
        (["inspect", ds, "--budget", "-5"], "-5"),  # options
        (["inspect", str(bad)], str(bad / "index.json")),  # data
        (["inspect", str(tmp_path / "none")], str(tmp_path / "none")),  # storage: nothing there
    ]
    for argv, named in cases:
        capsys.readouterr()
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert named in err and "Traceback" not in err, err


@pytest.mark.parametrize(
    "error, code",
    [
        (streambatch.OptionError("num_workers must be at least 0, got -1"), 2),
        (streambatch.ShardifyError("part 9/2: I must be between 0 and N-1"), 2),
        (streambatch.IndexFormatError("x/index.json: not valid JSON"), 2),
        (streambatch.DatasetNotFound("no dataset index at x/index.json"), 2),
        (streambatch.StateError("the state was saved by another loader"), 2),
        (RuntimeError("a bug"), 1),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else str(v),
)
def test_the_cli_exit_code_follows_the_kind(monkeypatch, tmp_path, capsys, error, code):
    """Every kind of the package's errors is one line and exit 2; anything unexpected is one line and exit 1."""
    from streambatch.cli import inspect as inspect_command
    from streambatch.cli import main

    def run(args):
        raise error

    monkeypatch.setattr(inspect_command, "run", run)
    monkeypatch.delenv("STREAMBATCH_DEBUG", raising=False)
    assert main(["inspect", str(tmp_path)]) == code
    err = capsys.readouterr().err.strip()
    assert str(error) in err and len(err.splitlines()) == 1, err


def test_the_old_index_error_name_still_catches():
    from streambatch.format.columnar import IndexError_

    with pytest.raises(IndexError_):
        raise streambatch.IndexFormatError("x")
