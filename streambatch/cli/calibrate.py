"""``shardify calibrate``: the user's training step measured at a few lengths (`streambatch.fit.calibrate`),
the cost model written. It runs the user's code, so ``shardify`` leaves its errors alone (they keep their full
traceback): `run()` itself reports a bad option, dataset, ``--model`` spec or output in one line (exit 2),
found before the model is loaded."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any

from ..errors import OptionError, ShardifyError, StreamBatchError, os_problem
from ..fit.calibrate import CalibrationOptions, calibration_options, format_report, measure_and_fit, write_calibration
from .args import PROG, at_least_one, os_error_text

HELP = "measure the largest batch per length your training step fits, write a cost model"
DESCRIPTION = (
    "Measure the largest batch per length your training step fits in, and write the cost model "
    "(cost, quadratic_factor, budget) that StreamBatchLoader(cost=FILE) reads."
)
EPILOG = (
    "FACTORY is called as FACTORY(device) (or FACTORY()) and returns step_fn(batch) — forward, backward "
    "and optimizer step on one batch as the loader yields it (CPU tensors) — or a (step_fn, make_batch) "
    "pair. Example: shardify calibrate data/ --model mymodel.py:make_step --device cuda "
    "--out calib.json"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add the ``shardify calibrate`` options to ``p`` (read back by `run()`)."""
    p.add_argument(
        "source", help="dataset folder or index.json (probe lengths, unit and sample rate come from its index)"
    )
    p.add_argument("--model", required=True, metavar="MODULE:FACTORY", help="factory returning the step function")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument(
        "--memory-limit",
        default=None,
        help="bytes the step may use, above 0, e.g. 2G (default: --memory-fraction of the GPU's memory, or on CPU "
        "of the memory available now)",
    )
    p.add_argument(
        "--memory-fraction",
        type=float,
        default=0.9,
        help="share of the memory to fill when no --memory-limit is given, in (0, 1] (default 0.9)",
    )
    p.add_argument(
        "--lengths", default=None, help="comma-separated positive probe lengths (default: quantiles of the dataset's)"
    )
    p.add_argument(
        "--max-batch-size",
        type=at_least_one,
        default=4096,
        metavar="N",
        help="largest batch size searched at any length, at most 2**31 - 1 (default 4096); the calibration file "
        "records it and the loader caps batches there, since larger ones would be extrapolated, not measured",
    )
    p.add_argument(
        "--rel-tol",
        type=float,
        default=0.01,
        help="relative precision of each length's largest batch, in [0, 0.5); 0: to one sample (default 0.01)",
    )
    p.add_argument(
        "--margin",
        type=float,
        default=0.02,
        help="share the budget stays below what was measured to fit, in [0, 1) (default 0.02)",
    )
    p.add_argument("--out", default=None, help="write the calibration JSON here (a file; checked before anything runs)")
    p.add_argument("-v", "--verbose", action="store_true", help="log every trial (batch size, length, peak memory)")


def load_factory(spec: str) -> Callable[..., Any]:
    """``MODULE:FACTORY`` → the factory; ``MODULE`` is a dotted module name or a path to a ``.py`` file. A spec
    without both parts, a module or file that is not there, a syntax error in it, or a missing or uncallable
    ``FACTORY`` is an `OptionError` naming it; an error the module's own code raises propagates."""
    mod_name, _, attr = spec.rpartition(":")
    if not mod_name or not attr:
        raise OptionError(f"--model wants MODULE:FACTORY, got {spec!r}")
    if mod_name.endswith(".py") or os.sep in mod_name:
        module = _load_file(mod_name)
    else:
        module = _import_module(mod_name)
    factory = getattr(module, attr, None)
    if factory is None:
        raise OptionError(f"--model {spec}: {mod_name} has no {attr!r}")
    if not callable(factory):
        raise OptionError(f"--model {spec}: {attr!r} in {mod_name} is not callable")
    return factory


def _load_file(path: str) -> ModuleType:
    """The module of the ``.py`` file at ``path``, its code run (the user's: its errors propagate)."""
    try:
        with open(path, "rb") as f:
            source = f.read()
    except OSError as e:
        raise OptionError(f"--model: cannot read {path}: {os_problem(e)}") from None
    try:
        code = compile(source, path, "exec", dont_inherit=True)
    except (SyntaxError, ValueError) as e:
        raise OptionError(_syntax_error(e, path)) from None
    name = os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec) if spec else ModuleType(name)
    sys.modules[name] = module
    exec(code, module.__dict__)
    return module


def _import_module(name: str) -> ModuleType:
    """The module of that dotted name (the current folder on the path); one not found, or a syntax error in its
    files, is an `OptionError` — a module it imports not being found is the module's own error."""
    if name.startswith("."):
        raise OptionError(f"--model: {name!r} is a relative module name; give a dotted module name or a .py file")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name is None or not (name == e.name or name.startswith(e.name + ".")):
            raise
        raise OptionError(f"--model: no module named {e.name!r} (give a dotted module name or a .py file)") from None
    except SyntaxError as e:
        raise OptionError(_syntax_error(e, name)) from None


def _syntax_error(e: SyntaxError | ValueError, where: str) -> str:
    if isinstance(e, SyntaxError):
        return f"--model: {e.filename or where}:{e.lineno}: syntax error: {e.msg}"
    return f"--model: {where}: {e}"


def _step_of(made: Any, spec: str) -> tuple[Callable, Callable | None]:
    """``(step_fn, make_batch)`` from what the factory returned: ``step_fn`` or a ``(step_fn, make_batch)`` pair."""
    step_fn, make_batch = made if isinstance(made, tuple) and len(made) == 2 else (made, None)
    if not callable(step_fn) or not (make_batch is None or callable(make_batch)):
        what = repr(made) if len(repr(made)) <= 60 else type(made).__name__
        raise OptionError(f"--model {spec} returned {what}, not a step function or a (step_fn, make_batch) pair")
    return step_fn, make_batch


def _call_factory(factory: Callable[..., Any], device: Any) -> Any:
    """``factory(device)``, or ``factory()`` when it takes no argument: the user's code, its errors propagate."""
    params: Mapping[str, Any]
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = {"device": None}
    return factory(device) if params else factory()


def _options(args: argparse.Namespace) -> CalibrationOptions:
    """The options checked, before the model is loaded: each bad value, a missing or bad dataset index and an
    output that cannot be written is one of the package's errors (`streambatch.errors`) naming it."""
    try:
        return calibration_options(
            args.source,
            device=args.device,
            memory_fraction=args.memory_fraction,
            memory_limit=args.memory_limit,
            lengths=_lengths(args.lengths),
            max_batch_size=args.max_batch_size,
            out=args.out,
            rel_tol=args.rel_tol,
            margin=args.margin,
            flag=lambda keyword: "--" + keyword.replace("_", "-"),
        )
    except StreamBatchError:  # a bad option, a bad index (IndexFormatError), retries exhausted, ...
        raise
    except OSError as e:
        raise ShardifyError(os_error_text(e)) from None


def _lengths(text: str | None) -> list[float] | None:
    """``--lengths 100,200.5`` as numbers (their range is checked with the other options)."""
    if not text:
        return None
    lengths = []
    for item in text.split(","):
        try:
            lengths.append(float(item))
        except ValueError:
            raise OptionError(f"--lengths: cannot read {item.strip()!r} as a number in {text!r}") from None
    return lengths


def run(args: argparse.Namespace) -> int:
    """``shardify calibrate`` on parsed options: check them, build the step from the factory, calibrate, print
    the report, write the file. A bad option, dataset, model spec or output is one line on stderr and exit code
    2 (checked before the model is loaded); what the user's own code raises keeps its traceback."""
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(message)s")
    try:
        options = _options(args)
        factory = load_factory(args.model)
    except StreamBatchError as e:
        return _error(e)
    made = _call_factory(factory, args.device)
    try:
        step_fn, make_batch = _step_of(made, args.model)
    except StreamBatchError as e:
        return _error(e)
    result = measure_and_fit(step_fn, options, make_batch=make_batch)
    print(format_report(result))
    if options.out is None:
        return 0
    try:
        write_calibration(result, options.out)
    except (StreamBatchError, OSError) as e:
        return _error(e)
    print(f"wrote {options.out}: StreamBatchLoader(source, cost={options.out!r}) uses it")
    return 0


def _error(e: Exception) -> int:
    """Report a bad option or input in one line; exit code 2."""
    print(f"{PROG}: error: {os_error_text(e) if isinstance(e, OSError) else e}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None, prog: str = "shardify calibrate") -> int:
    """``shardify calibrate`` with its own parser: parse ``argv`` and run it."""
    p = argparse.ArgumentParser(prog=prog, description=DESCRIPTION, epilog=EPILOG)
    add_arguments(p)
    return run(p.parse_args(argv))
