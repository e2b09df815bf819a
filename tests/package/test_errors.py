"""Every exception the package raises on purpose derives from one root, keeps the builtin base users catch, and
is exported from the top level."""

import ast
import importlib
import inspect
import pathlib
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


# Where the package still raises a builtin exception itself, and why: anything a user's input, data or options can
# reach is one of the package's errors (the root above); these are Python's own conventions, internal invariants,
# or low-level errors their callers translate. (module, function) -> (exception, why)
_BUILTIN_RAISES = {
    ("plan.config", "BatchingConfig.make"): ("TypeError", "an unknown keyword, as Python reports one"),
    ("plan.slot", "apply_adjust"): ("ValueError", "an internal invariant: the epoch planner always passes both"),
    ("format.shards", "ShardInfo.__init__"): ("TypeError", "a constructor called without a required field"),
    ("loader.core", "StreamBatchLoader.plan"): ("TypeError", "planning without an index: no such method"),
    ("loader.core", "StreamBatchLoader.schedule"): ("TypeError", "planning without an index: no such method"),
    ("loader.core", "StreamBatchLoader.__len__"): ("TypeError", "len() of an unsized stream, as Python's convention"),
    ("loader.core", "StreamBatchLoader.__iter__"): ("RuntimeError", "an internal invariant: steps as planned"),
    ("loader.steps", "step_samples"): ("TypeError", "planning without an index, as len() is"),
    ("read.transforms", "as_payload"): ("TypeError", "a user callable's result of the wrong type, named"),
    ("read.transforms", "SampleOps._transform"): ("TypeError", "a user callable's result of the wrong type, named"),
    ("read.ring", "_placed"): ("RuntimeError", "a batch used after its loader was garbage-collected"),
    ("io.retry", "call_with_retry"): ("AssertionError", "unreachable: the loop returns or raises"),
    ("lightning", "LightningLoader.close"): (
        "RuntimeError",
        "an internal invariant: the loader yields what it planned",
    ),
    ("write.parts", "parse_part"): ("ValueError", "caught a few lines below and re-raised as a ShardifyError"),
    ("write.tarwrite", "_write_tar"): ("ValueError", "an internal invariant: members always carry data"),
    ("io.storage", "_http_range"): ("FileNotFoundError", "a missing object; callers name it as a bad shard"),
    ("io.storage", "object_size"): ("OSError", "storage without sizes; callers name the shard"),
    ("io.s3_direct", "PresignedReader.read"): ("FileNotFoundError", "as _http_range"),
    ("io.s3_direct", "_read_into"): ("ConnectionResetError", "a cut answer: retried as a transient error"),
    ("io.s3_direct", "_receive_waiting"): ("ConnectionResetError", "as _read_into"),
    ("io.s3_direct", "_recv_all"): ("TimeoutError", "a stalled answer: retried, as urllib3's read timeout is"),
}
#: raised by protocol, wherever they are: a missing attribute or item, an abstract method, a missing optional extra
_PROTOCOL = {"AttributeError", "IndexError", "NotImplementedError", "ImportError"}


def _builtin_raises():
    """(module, function, exception) for every ``raise`` of a builtin exception class in the package."""
    import builtins

    names = {n for n, c in vars(builtins).items() if inspect.isclass(c) and issubclass(c, BaseException)}
    found = set()
    root = pathlib.Path(streambatch.__file__).parent
    for path in root.rglob("*.py"):
        module = ".".join(path.relative_to(root).with_suffix("").parts)
        for func, node in _raises(ast.parse(path.read_text())):
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(exc, ast.Name) and exc.id in names and exc.id not in _PROTOCOL:
                found.add((module, func, exc.id))
    return found


def _raises(tree, scope=""):
    """(enclosing qualname, Raise node) pairs, the qualname of classes and functions joined by dots."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield from _raises(node, f"{scope}.{node.name}" if scope else node.name)
        elif isinstance(node, ast.Raise) and node.exc is not None:
            yield scope, node
            yield from _raises(node, scope)
        else:
            yield from _raises(node, scope)


def test_builtin_exceptions_are_raised_only_where_listed():
    found = _builtin_raises()
    listed = {(m, f, e) for (m, f), (e, _why) in _BUILTIN_RAISES.items()}
    assert not found - listed, (
        f"raise one of the package's errors (streambatch.errors) instead: {sorted(found - listed)}"
    )
    assert not listed - found, f"no longer raised; drop from _BUILTIN_RAISES: {sorted(listed - found)}"
