"""The one exception family. Only the CLI turns these into messages and exit codes.

Every error carries a ``hint``: the next thing the user should do.
"""

from __future__ import annotations

from typing import Any

#: How to upgrade this project, for every hint that says to. The PyPI package called
#: ``rootstock`` is an unrelated project: ``pip install -U rootstock`` would fetch it.
UPGRADE_HINT = (
    "upgrade rootstock from a newer checkout or wheel of this project (the PyPI package "
    "called rootstock is another project): `uv tool install --reinstall PATH`, "
    "`pipx install --force PATH`, or `pip install --force-reinstall PATH` in its venv"
)


class RootstockError(Exception):
    """Base of every error rootstock raises on purpose."""

    exit_code = 1
    #: The hint in command-line terms (``--root``), where ``hint`` says it in Python
    #: terms (``root=``); the CLI shows it instead. None: ``hint`` serves both.
    cli_hint: str | None = None

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        if self.hint:
            return f"{self.message}\n  hint: {self.hint}"
        return self.message

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle every field: an error raised in a Parsl or Dask worker reaches the
        client whole (hint, traceback, partial results), whatever the subclass's
        constructor takes."""
        return (_rebuild_error, (type(self), self.args, self.__dict__.copy()))


def _rebuild_error(
    cls: type[RootstockError], args: tuple[Any, ...], state: dict[str, Any]
) -> RootstockError:
    error = cls.__new__(cls)
    Exception.__init__(error, *args)
    error.__dict__.update(state)
    return error


class UsageError(RootstockError):
    """The command line itself is wrong (exit code 2)."""

    exit_code = 2


class RootNotFound(RootstockError):
    """No install root could be determined, or it does not exist.

    Raised alike for the CLI and for a user's script: ``hint`` names the keywords
    (``root=``, ``cluster=``), ``cli_hint`` the options (``--root``, ``--cluster``).
    """

    def __init__(self, message: str, hint: str | None = None, cli_hint: str | None = None):
        super().__init__(message, hint)
        self.cli_hint = cli_hint


class LayoutError(RootstockError):
    """``layout.json`` is unreadable or written by a newer rootstock."""


class ConfigError(RootstockError):
    """``config.toml`` or the cluster registry file is malformed."""


class UnknownCluster(RootstockError):
    """A cluster name that is not in the registry."""


class EnvFileError(RootstockError):
    """An environment file failed to parse or lint."""

    def __init__(self, message: str, problems: list | None = None, hint: str | None = None):
        super().__init__(message, hint)
        self.problems = problems or []

    def __str__(self) -> str:
        lines = [self.message, *(f"  {p}" for p in self.problems)]
        if self.hint:
            lines.append(f"  hint: {self.hint}")
        return "\n".join(lines)


class EnvBroken(EnvFileError):
    """A built env whose ``env_source.py`` no longer parses (a bad hotfix).

    Exit code 1: the command line is right, the install is not.
    """


class SourceError(RootstockError):
    """A ``sync``/``prune`` SOURCE cannot be read or fetched, or declares nothing."""


class EnvNotFound(RootstockError):
    """An env name that is not registered or built in this root."""


class UnknownEnvName(UsageError):
    """An env name typed on a command line that this root does not have (exit code 2)."""


class BuildError(RootstockError):
    """``uv`` failed while locking or building an env."""

    def __init__(self, message: str, output: str = "", hint: str | None = None) -> None:
        super().__init__(message, hint)
        self.output = output

    def __str__(self) -> str:
        text = self.message
        if self.output:
            tail = "\n".join(self.output.rstrip().splitlines()[-25:])
            text += "\n--- output (last lines) ---\n" + tail
        if self.hint:
            text += f"\n  hint: {self.hint}"
        return text


class LockTimeout(RootstockError):
    """A root-wide or per-file lock could not be taken in time."""


class CheckpointNotDeclared(UsageError):
    """A checkpoint id that no installed env declares (exit code 2: the id is wrong)."""


class AmbiguousCheckpoint(UsageError):
    """A checkpoint id that only cluster variants declare, and no cluster was given.

    Exit code 2: the command line lacks ``--cluster``.
    """


class CheckpointNotFetched(RootstockError):
    """A declared checkpoint whose weights were never fetched (``rootstock add``)."""


class ManifestError(RootstockError):
    """``manifest.json`` is corrupt, or written by a newer rootstock."""


class UnstorableValue(ManifestError):
    """A manifest write was handed a value the schema refuses (NaN, a wrong type).

    Nothing is written: the file keeps its previous content.
    """


class PushError(RootstockError):
    """A push to the dashboard failed (the local manifest is unaffected)."""


class PushNotConfigured(PushError):
    """config.toml lacks the dashboard URL or credentials a push needs."""


class WorkerError(RootstockError):
    """The model raised inside the worker; carries the worker's traceback text."""

    def __init__(self, message: str, remote_traceback: str = "", hint: str | None = None):
        super().__init__(message, hint)
        self.remote_traceback = remote_traceback

    def __str__(self) -> str:
        text = super().__str__()
        if self.remote_traceback:
            text += "\n--- worker traceback ---\n" + self.remote_traceback.rstrip()
        return text


class DeviceNotVisible(WorkerError):
    """The worker refused, before ``setup()``, a device this node does not show.

    The message is one line with the fix (``... or pass --device cpu``); no
    traceback, since nothing of the model ran.
    """


class WorkerDiedError(WorkerError):
    """The worker process exited while we were waiting on it.

    ``worker_exit_code`` is the worker's own exit status (negative: the signal that
    killed it, None: unknown); the CLI still exits with the class's ``exit_code``.
    ``partial_results`` (``calculate_batch`` only, else empty) is the list of the
    results finished before the death, in input order: ``images[:len(partial_results)]``.
    """

    def __init__(self, message: str, worker_exit_code: int | None, output_tail: str = "") -> None:
        super().__init__(message, hint="the next calculation starts a fresh worker")
        self.worker_exit_code = worker_exit_code
        self.output_tail = output_tail
        self.partial_results: list[Any] = []

    def __str__(self) -> str:
        text = f"{self.message} (exit code {self.worker_exit_code})"
        if self.output_tail:
            text += "\n--- worker output (tail) ---\n" + self.output_tail.rstrip()
        return text


class WorkerTimeout(WorkerError):
    """The worker did not answer within the calculator's timeout."""


class ProtocolError(RootstockError):
    """A malformed or unexpected frame on the worker socket."""


class MissingExtra(RootstockError):
    """An optional part of rootstock (an engine, an integration) whose extra is not
    installed; the hint names the ``pip install 'rootstock[...]'`` that brings it."""


class EngineError(RootstockError):
    """A scale-out engine (Parsl, Dask) could not run the work: its scheduler refused
    the job, no engine worker arrived in time, or workers kept dying."""
