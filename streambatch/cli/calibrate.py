"""``shardify calibrate``: the user's training step measured at a few lengths (:mod:`streambatch.fit.calibrate`),
the cost model written. It runs the user's code, so its errors keep their full traceback."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..fit.calibrate import calibrate, format_report
from .args import at_least_one

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
    """Add the ``shardify calibrate`` options to ``p`` (read back by :func:`run`)."""
    p.add_argument(
        "source", help="dataset folder or index.json (probe lengths, unit and sample rate come from its index)"
    )
    p.add_argument("--model", required=True, metavar="MODULE:FACTORY", help="factory returning the step function")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument(
        "--memory-limit",
        default=None,
        help="bytes the step may use, e.g. 2G (CPU default: a fraction of the available memory)",
    )
    p.add_argument(
        "--memory-fraction", type=float, default=0.9, help="share of the device memory to fill (default 0.9)"
    )
    p.add_argument(
        "--lengths", default=None, help="comma-separated probe lengths (default: quantiles of the dataset's)"
    )
    p.add_argument(
        "--max-batch-size",
        type=at_least_one,
        default=4096,
        metavar="N",
        help="largest batch size searched at any length (default 4096); the calibration file records "
        "it and the loader caps batches there, since larger ones would be extrapolated, not measured",
    )
    p.add_argument(
        "--rel-tol", type=float, default=0.01, help="precision of each length's largest batch (default 0.01)"
    )
    p.add_argument("--margin", type=float, default=0.02, help="budget safety margin (default 0.02)")
    p.add_argument("--out", default=None, help="write the calibration JSON here")
    p.add_argument("-v", "--verbose", action="store_true", help="log every trial (batch size, length, peak memory)")


def load_factory(spec: str) -> Callable[..., Any]:
    """``MODULE:FACTORY`` → the factory; ``MODULE`` is a dotted module name or a path to a ``.py`` file."""
    if ":" not in spec:
        raise ValueError(f"--model wants MODULE:FACTORY, got {spec!r}")
    mod_name, attr = spec.rsplit(":", 1)
    if mod_name.endswith(".py") or os.sep in mod_name:
        name = os.path.splitext(os.path.basename(mod_name))[0]
        spec_ = importlib.util.spec_from_file_location(name, mod_name)
        if spec_ is None or spec_.loader is None:
            raise ImportError(f"cannot import {mod_name}")
        module = importlib.util.module_from_spec(spec_)
        sys.modules[name] = module
        spec_.loader.exec_module(module)
    else:
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        module = importlib.import_module(mod_name)
    try:
        return getattr(module, attr)
    except AttributeError:
        raise AttributeError(f"{mod_name} has no {attr!r}") from None


def _call_factory(factory: Callable[..., Any], device: Any) -> tuple[Callable, Callable | None]:
    params: Mapping[str, Any]
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = {"device": None}
    made = factory(device) if params else factory()
    if isinstance(made, tuple):
        return made[0], made[1]
    return made, None


def run(args: argparse.Namespace) -> int:
    """``shardify calibrate`` on parsed options: build the step from the factory, calibrate, print the report."""
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(message)s")
    step_fn, make_batch = _call_factory(load_factory(args.model), args.device)
    lengths = [float(x) for x in args.lengths.split(",")] if args.lengths else None
    result = calibrate(
        step_fn,
        args.source,
        device=args.device,
        memory_fraction=args.memory_fraction,
        memory_limit=args.memory_limit,
        lengths=lengths,
        max_batch_size=args.max_batch_size,
        out=args.out,
        make_batch=make_batch,
        rel_tol=args.rel_tol,
        margin=args.margin,
    )
    print(format_report(result))
    if args.out:
        print(f"wrote {args.out}: StreamBatchLoader(source, cost={args.out!r}) uses it")
    return 0


def main(argv: Sequence[str] | None = None, prog: str = "shardify calibrate") -> int:
    """``shardify calibrate`` with its own parser: parse ``argv`` and run it."""
    p = argparse.ArgumentParser(prog=prog, description=DESCRIPTION, epilog=EPILOG)
    add_arguments(p)
    return run(p.parse_args(argv))
