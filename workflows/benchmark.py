"""Measure ways of loading the same data in one run, against ceilings and MONAI/DALI peers.

\b
    python -m workflows.benchmark all --data demo --batchsize 4 --batches 4 --cold --out bench_out
    python -m workflows.benchmark prepared --cache demo/cache --backend direct
    python -m workflows.benchmark --batchsize 64 --batches 1000 dali --datadir /data
    python -m workflows.benchmark loaders --count 32 --size 128 --warm

Global options (`--batchsize --batches --cold/--warm --device --workers --out`) go before or after the
subcommand. Every subcommand prints one table (items/s, GB/s, the ratio to the ceiling measured on the
same data in the same run and to the reference peer) and writes bench.csv, bench.json and bench.png under
`--out`. A way that cannot run here (no GPU, no libxnvme) prints one line saying why. The subcommands
are the scenarios of `workflows/bench/` (its docstring says how to add one).
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from loaders.errors import PrepError
from workflows.bench import Scenario, load_scenarios
from workflows.bench.core import Options, Unavailable
from workflows.bench.report import finish

# global option -> takes a value; these may also follow the subcommand (the research code's lines put
# them before it, blockprep's after: both parse)
GLOBAL_OPTIONS = {"--batchsize": True, "--batches": True, "--cold": False, "--warm": False, "--device": True,
                  "--workers": True, "--out": True}  # fmt: skip

EPILOG = "Global options (--batchsize --batches --cold/--warm --device --workers --out) go before or after it."
app = typer.Typer(
    name="python -m workflows.benchmark",
    help=__doc__,
    add_completion=False,
    no_args_is_help=True,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
)


@app.callback()
def _global_options(
    ctx: typer.Context,
    batchsize: Annotated[int, typer.Option(min=1, help="items per batch")] = 4,
    batches: Annotated[int, typer.Option(min=1, help="timed batches per way (wraps around small data)")] = 4,
    cold: Annotated[bool, typer.Option("--cold/--warm", help="evict the page cache before timing, or not")] = True,
    device: Annotated[str, typer.Option(help="cpu or cuda:N")] = "cpu",
    workers: Annotated[int, typer.Option(min=0, help="parallel workers (0: the scenario's default)")] = 0,
    out: Annotated[Path, typer.Option(help="folder for bench.csv/json/png")] = Path("bench_out"),
) -> None:
    ctx.obj = Options(batchsize, batches, cold, device, workers, out, out / "work")


def hoist_global_options(argv: list[str], commands: set[str]) -> list[str]:
    """Move the global options that follow the subcommand in front of it (where typer reads them)."""
    at = next((i for i, a in enumerate(argv) if a in commands), None)
    if at is None:
        return list(argv)
    before, after, rest = list(argv[: at + 1]), [], argv[at + 1 :]
    i = 0
    while i < len(rest):
        flag = rest[i].split("=", 1)[0]
        if flag in GLOBAL_OPTIONS:
            takes_value = GLOBAL_OPTIONS[flag] and "=" not in rest[i]
            before[at:at] = rest[i : i + 1 + takes_value]
            at += 1 + takes_value
            i += 1 + takes_value
        else:
            after.append(rest[i])
            i += 1
    return before + after


def mps_pipe() -> Path | None:
    """The pipe folder of a CUDA MPS control daemon this process's CUDA calls would go through (the one
    `CUDA_MPS_PIPE_DIRECTORY` names, else the driver's default), or None: figures taken under MPS say so."""
    folder = Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps")
    return folder if (folder / "control").exists() else None


def _command(entry: Scenario) -> Any:
    """A typer command for a scenario: its own options from its signature, the global Options from ctx."""
    fn = entry.run
    signature = inspect.signature(fn, eval_str=True)
    params = list(signature.parameters.values())[1:]  # the first one receives the global Options

    @functools.wraps(fn)
    def command(ctx: typer.Context, **options: Any) -> None:
        opts: Options = ctx.obj
        mode = "cold" if opts.cold else "warm"
        mps = mps_pipe() if opts.device.startswith("cuda") else None
        device = f"{opts.device}, under CUDA MPS (pipe {mps})" if mps else opts.device
        print(f"benchmark {entry.name}: {mode}, {opts.batches} batches of {opts.batchsize}, device {device}")
        try:
            results = fn(opts, **options)
        except (Unavailable, PrepError) as exc:  # the scenario's own data is unusable: say so in one line
            print(f"benchmark {entry.name}: {exc}", file=sys.stderr)
            raise typer.Exit(2) from None
        raise typer.Exit(finish(results, opts))

    ctx_param = inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context)
    command.__signature__ = signature.replace(parameters=[ctx_param, *params])  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in params} | {"ctx": typer.Context}
    del command.__wrapped__  # typer must see the new signature, not fn's
    return command


def _register() -> None:
    for entry in load_scenarios().values():
        if entry.name not in {c.name for c in app.registered_commands}:
            app.command(entry.name, help=entry.help, epilog=EPILOG)(_command(entry))


def main(argv: list[str] | None = None) -> int:
    """Command-line entry; returns the exit status (1 when nothing but ceilings could be measured)."""
    _register()
    args = hoist_global_options(sys.argv[1:] if argv is None else argv, set(load_scenarios()))
    try:
        app(args, prog_name="python -m workflows.benchmark")  # standalone: usage errors print and exit 2
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
