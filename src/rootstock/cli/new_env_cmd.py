"""``rootstock new-env``: a template env file that passes the lint."""

from __future__ import annotations

from pathlib import Path

import click

TEMPLATE = '''"""{name}: <one line on the model family>.

A rootstock environment file. `rootstock install {name}.py` builds it; see
docs/environments.md for every field.
"""

# /// script
# requires-python = ">=3.11"
# dependencies = [
#     "ase>=3.23",
#     "numpy",
#     # "torch",             # the model's own stack goes here
#     # "{name}-package>=1.0",
# ]
# ///

# checkpoint id -> upstream name or path (what setup() is given).
CHECKPOINTS = {{
    "{name}-small": "small",
    # "{name}:custom": None,   # user weights via setup_from_path()
}}

# Keyword arguments verification uses when none are given (e.g. a required task).
VERIFY_KWARGS = {{}}


def setup(checkpoint, device="cuda", **kw):
    """Return an ASE calculator for CHECKPOINTS[checkpoint] on `device`."""
    from ase.calculators.emt import EMT  # replace with the model's calculator

    return EMT()


# def setup_from_path(path, device="cuda", **kw):
#     """Return an ASE calculator for user-supplied weights at `path`."""
'''


@click.command("new-env")
@click.argument("name")
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False),
    help="Where to write it (default: ./NAME.py).",
)
@click.option("--force", is_flag=True, help="Overwrite an existing file.")
def new_env(name: str, output: str | None, force: bool) -> None:
    """Write a template env file for a new model family NAME."""
    from rootstock.errors import RootstockError, UsageError
    from rootstock.install.envfile import ENV_NAME_RE, read_env_file

    if not ENV_NAME_RE.match(name):
        raise UsageError(
            f"{name!r} is not a valid env name", hint="use letters, digits, '.', '_' and '-'"
        )
    path = Path(output or f"{name}.py")
    if path.exists() and not force:
        raise RootstockError(f"{path} already exists", hint="pass --force to overwrite it")
    path.write_text(TEMPLATE.format(name=name))
    read_env_file(path, name)  # the template must always pass the lint
    click.echo(f"wrote {path}; edit it, then: rootstock install {path}")
