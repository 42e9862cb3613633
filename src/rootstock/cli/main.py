"""``rootstock``: the entry point.

Subcommands are imported only when they run, so ``rootstock --help`` stays as
fast as a bare interpreter start (no rich, numpy or ase on that path). The short
help of each command therefore lives in the table below as well as in the
command's own docstring.
"""

from __future__ import annotations

import importlib
import sys
from typing import TextIO

import click

# name -> (module, attribute, one-line help)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "init": ("rootstock.cli.init_cmd", "init", "Create an install root and your config."),
    "install": ("rootstock.cli.install_cmd", "install", "Build env files into isolated envs."),
    "list": ("rootstock.cli.list_cmd", "list_envs", "List envs and their checkpoint ids."),
    "status": ("rootstock.cli.status_cmd", "status", "Show envs, build state and checkpoints."),
    "resolve": ("rootstock.cli.resolve_cmd", "resolve", "Show where a cluster's install lives."),
    "info": ("rootstock.cli.info_cmd", "info", "Show everything about one checkpoint."),
    "cite": ("rootstock.cli.cite_cmd", "cite", "Print BibTeX for checkpoints and Rootstock."),
    "new-env": ("rootstock.cli.new_env_cmd", "new_env", "Write a template env file."),
    "serve": ("rootstock.cli.serve_cmd", "serve", "Serve a checkpoint to an i-PI driver."),
    "lammps": (
        "rootstock.cli.lammps_cmd",
        "lammps",
        "Run a LAMMPS input with a checkpoint as its forces.",
    ),
    "add": ("rootstock.cli.add_cmd", "add", "Download and verify a checkpoint."),
    "benchmark": (
        "rootstock.cli.benchmark_cmd",
        "benchmark",
        "Time the worker boundary against the env's own Python.",
    ),
    "smoke-test": (
        "rootstock.cli.smoke_test_cmd",
        "smoke_test",
        "Re-verify every fetched checkpoint.",
    ),
    "sync": ("rootstock.cli.sync_cmd", "sync", "Build, download and verify what is declared."),
    "prune": ("rootstock.cli.prune_cmd", "prune", "Remove what is no longer declared."),
    "manifest": ("rootstock.cli.manifest_cmd", "manifest", "Show, init or push manifest.json."),
    "setup-perms": (
        "rootstock.cli.perms_cmd",
        "setup_perms",
        "Make an install world-readable, writable by its group.",
    ),
    "check-perms": (
        "rootstock.cli.perms_cmd",
        "check_perms",
        "Check that other users can use an install.",
    ),
    "usage": ("rootstock.cli.usage_cmd", "usage", "Report, compact and push usage counts."),
    "workers": ("rootstock.cli.workers_cmd", "workers", "Start, list and stop pooled workers."),
    "stage": ("rootstock.cli.stage_cmd", "stage", "Stage builds on this node's disk."),
    "dashboard": (
        "rootstock.cli.dashboard_cmd",
        "dashboard",
        "Run the coverage dashboard; manage its clusters and keys.",
    ),
}


class LazyGroup(click.Group):
    """A group whose subcommands are imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        module, attr, _ = COMMANDS[name]
        return getattr(importlib.import_module(module), attr)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, COMMANDS[name][2]) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="rootstock", message="rootstock %(version)s")
@click.option("--debug", is_flag=True, help="Show full tracebacks on errors.")
@click.option(
    "--quiet",
    "-q",
    is_flag=True,
    help="Print no 'next:' hints (for scripts; also $ROOTSTOCK_NO_HINTS=1).",
)
def cli(debug: bool, quiet: bool) -> None:
    """Run many machine-learned interatomic potentials from one ASE calculator.

    Maintainers build model environments into a shared install root
    (init, install, add); users compute with RootstockCalculator.
    """
    # ``--debug`` is declared here so click parses it and --help lists it. main()
    # reads it from argv instead: the errors it shows tracebacks for are caught
    # there, after click has returned. ``--quiet`` is read by
    # rootstock.cli.common.hints_wanted from the root context's params.


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; turn rootstock errors into messages and exit codes."""
    from rootstock.errors import RootstockError

    args = list(argv if argv is not None else sys.argv[1:])
    debug = "--debug" in args
    try:
        _show_stored_name_warnings()
        _refuse_nul_bytes(args)
        # Outside standalone mode click returns (not raises) the code of a command's
        # ``Exit``, e.g. install's ``Exit(1)`` when one env of a directory failed.
        code = cli.main(args=args, prog_name="rootstock", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("Aborted.", err=True)
        return 130
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except KeyboardInterrupt:
        click.echo("Interrupted.", err=True)
        return 130
    except RootstockError as exc:
        if debug:
            raise
        if exc.cli_hint:
            exc.hint = exc.cli_hint  # the same advice, in options rather than keywords
        click.echo(f"error: {exc}", err=True)
        return exc.exit_code
    except OSError as exc:
        # A filesystem refusal (missing parent, permission, full disk) is the user's
        # to fix, not a bug: say so plainly rather than with a traceback.
        if debug:
            raise
        click.echo(f"error: {exc}\n  hint: rerun with --debug for the traceback", err=True)
        return 1
    return code if isinstance(code, int) and not isinstance(code, bool) else 0


def _show_stored_name_warnings() -> None:
    """Print a :class:`~rootstock.names.StoredNameWarning` as one ``warning:`` line.

    Python's default format (file, line number, source line) reads like a crash to
    someone who only needs the fix; other warnings keep that format.
    """
    import warnings

    default = warnings.showwarning
    if getattr(default, "rootstock_hook", False):
        return  # main() ran before in this process (tests, embedding callers)

    def show(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> None:
        # Imported here, not at start-up: whatever warns has imported it already.
        from rootstock.names import StoredNameWarning

        if issubclass(category, StoredNameWarning):
            click.echo(f"warning: {message}", err=True)
        else:
            default(message, category, filename, lineno, file, line)

    show.rootstock_hook = True  # type: ignore[attr-defined]  # a marker on the function object
    warnings.showwarning = show


def _refuse_nul_bytes(args: list[str]) -> None:
    """No argument may hold a NUL byte: no path, name or value can.

    A shell cannot pass one, but a Python caller of :func:`main` can, and every
    file system call would then fail with ``ValueError`` rather than a message.
    """
    from rootstock.errors import UsageError

    for arg in args:
        if isinstance(arg, str) and "\0" in arg:
            raise UsageError(
                f"the argument {arg!r} contains a NUL byte",
                hint="no path, name or value on the command line can hold one",
            )


if __name__ == "__main__":
    sys.exit(main())
