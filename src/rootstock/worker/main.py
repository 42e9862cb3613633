"""``python -m rootstock.worker``: load the model, connect, serve.

Three modes:

* ``calculator`` (spawned by RootstockCalculator): run ``setup()``, then connect;
  a failure there is sent back in-band as an ``ERROR`` frame so the user sees the
  model's traceback as a Python exception, and a worker that dies before it
  connects is known to have died loading the model.
* ``serve`` (``rootstock serve`` for an external i-PI server): run ``setup()``
  first, then connect, retrying until the server is up; a standard server is
  never kept waiting on a model that is still loading. Errors go to the log.
* ``download`` (the fetch phase of ``rootstock add``): call the env's
  ``download()`` hook, or ``setup()`` on the CPU, so the weights land in the
  cache; then exit. No socket; the exit code says whether it worked. The paths
  the hook returned go, as a JSON list, to the file ``$ROOTSTOCK_DOWNLOAD_RESULT``
  names (when set), so ``add`` can record which files the checkpoint owns.

In ``calculator`` and ``serve`` mode the worker holds a shared lock on its env
generation's lock file for its whole life, taken before ``setup()`` runs
(:mod:`rootstock.wire.generation`), so ``install`` and ``prune`` never delete
the generation it imports from.

The worker never binds a socket and knows nothing about the system until the
server tells it (JSON INIT) or ``--structure`` names a file.

Started by rootstock, it gets ``$ROOTSTOCK_LIFELINE_FD`` (or ``--lifeline-fd N``):
the read end of a pipe whose write end only its starter holds. A watchdog thread
sees end-of-file the moment the starter is gone (however it died) and ends the
worker with ``STARTER_GONE_EXIT``, even in the middle of a model call. A worker started by
hand (or by a user's driver) has no lifeline and lives until its server says
``EXIT`` or closes the connection.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

from rootstock.errors import ProtocolError
from rootstock.wire.framing import CHECK_DEVICE_ENV, DOWNLOAD_RESULT_ENV, FrameStream
from rootstock.wire.generation import GENERATION_ENV, hold_generation
from rootstock.wire.lifeline import (
    LIFELINE_ENV,
    LIFELINE_OPTION,
    STARTER_GONE_EXIT,
    watch_lifeline,
)
from rootstock.worker.device import check_device_visible
from rootstock.worker.loop import EXIT_MODEL_ERROR, EXIT_PROTOCOL_ERROR, CapturedError, ServeLoop
from rootstock.worker.model import ModelRunner, load_env_source, make_calculator

log = logging.getLogger("rootstock.worker")

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m rootstock.worker", description=__doc__)
    parser.add_argument("--env-source", required=True, help="the env's env_source.py")
    parser.add_argument("--checkpoint", required=True, help="checkpoint id passed to setup()")
    parser.add_argument("--socket", help="Unix socket path to connect to (not for download)")
    parser.add_argument("--mode", choices=("calculator", "serve", "download"), default="calculator")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--kwargs", default="{}", help="JSON object of setup() keywords")
    parser.add_argument("--weights", help="user weights for a <family>:custom checkpoint")
    parser.add_argument("--structure", help="ASE-readable file with species and PBC")
    parser.add_argument(
        "--connect-timeout",
        type=float,
        default=None,
        help="seconds to keep retrying the connection (0: forever)",
    )
    parser.add_argument("--body-timeout", type=float, default=120.0)
    parser.add_argument("--debug", action="store_true", help="log every frame")
    parser.add_argument(
        LIFELINE_OPTION,
        dest="lifeline_fd",
        type=int,
        default=None,
        help="inherited pipe fd held open by the starter; its EOF ends the worker",
    )
    # Set from $ROOTSTOCK_CHECK_DEVICE by main(), never an option: an option would
    # make a newer client's command line unreadable to an older vendored worker.
    parser.set_defaults(check_device=False)
    return parser.parse_args(argv)


def connect(path: str, timeout: float | None) -> socket.socket:
    """Connect to the server's Unix socket, retrying until it is up or ``timeout`` passes."""
    # A starter that dies while we retry is noticed by the lifeline thread, not
    # here: os.getppid() read now may already be init's, so it proves nothing.
    deadline = None if not timeout else time.monotonic() + timeout
    delay = 0.005
    announced = False
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
            log.debug("connected to %s", path)
            return sock
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            sock.close()
            if deadline is not None and time.monotonic() >= deadline:
                raise ProtocolError(
                    f"no server at {path} after {timeout:g} s ({exc.strerror})"
                ) from None
            if not announced:
                log.info("waiting for a server at %s", path)
                announced = True
            time.sleep(delay)
            delay = min(delay * 2, 0.5)


def _build_runner(
    args: argparse.Namespace, kwargs: dict[str, Any]
) -> tuple[ModelRunner, Callable[..., Any] | None]:
    """The model (``setup()`` run) and the env's ``evaluate_batch`` hook, if it has one.

    When the client asked (verification), a device that this node does not show is
    refused first: nothing of the env is imported, and ``setup()`` never runs.
    """
    if args.check_device:
        check_device_visible(args.device)
    module = load_env_source(args.env_source)
    calc = make_calculator(module, args.checkpoint, args.device, kwargs, args.weights)
    return ModelRunner(calc), batch_hook_of(module)


def batch_hook_of(module: ModuleType) -> Callable[..., Any] | None:
    """The env module's ``evaluate_batch``, or None when it has none (or it is not callable)."""
    hook = getattr(module, "evaluate_batch", None)
    if hook is None:
        return None
    if not callable(hook):
        # The install lint refuses this; an env hotfixed since still has to run.
        log.warning(
            "evaluate_batch in the env file is a %s, not a function; batches are "
            "evaluated one structure at a time",
            type(hook).__name__,
        )
        return None
    return hook


def _read_structure(path: str) -> Any:
    from ase.io import read

    return read(path)


def _starter_gone() -> None:
    """The lifeline reached EOF: say so in one line, end what the model started, exit."""
    # Not the logging module: the main thread may hold its lock mid-record.
    with contextlib.suppress(OSError):
        os.write(
            2,
            f"rootstock-worker[{os.getpid()}] ERROR rootstock.worker: the process that "
            "started this worker is gone; exiting\n".encode(),
        )
    _end_own_group()
    os._exit(STARTER_GONE_EXIT)


def _end_own_group() -> None:
    """SIGKILL the other members of our process group (compile workers the model
    started), which would otherwise outlive us; the worker leads its own group."""
    me = os.getpid()
    if os.getpgid(0) != me:
        return  # started by hand inside someone else's group: not ours to end
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == me:
                continue
            with contextlib.suppress(OSError):
                if os.getpgid(int(entry)) == me:
                    os.kill(int(entry), signal.SIGKILL)


def _fd_number(text: str) -> int | None:
    return int(text) if text.isdigit() else None


def main(argv: list[str] | None = None) -> int:
    """Run the worker; returns its exit code."""
    args = parse_args(argv)
    # Popped, so nothing the model starts mistakes some other fd for a lifeline.
    inherited = os.environ.pop(LIFELINE_ENV, "")
    result_file = os.environ.pop(DOWNLOAD_RESULT_ENV, "")
    args.check_device = os.environ.pop(CHECK_DEVICE_ENV, "") == "1"
    lifeline_fd = args.lifeline_fd if args.lifeline_fd is not None else _fd_number(inherited)
    if lifeline_fd is not None:
        # First, before any slow import or setup(): a starter that is already gone
        # must not wait for the model to load to be noticed.
        watch_lifeline(lifeline_fd, _starter_gone)
    logging.basicConfig(
        level=logging.DEBUG if args.debug else logging.INFO,
        format="rootstock-worker[%(process)d] %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        kwargs = json.loads(args.kwargs)
    except ValueError as exc:
        log.error("--kwargs is not JSON: %s", exc)
        return EXIT_USAGE
    if not isinstance(kwargs, dict):
        log.error("--kwargs must be a JSON object")
        return EXIT_USAGE
    if args.mode != "download" and not args.socket:
        log.error("--socket is required in %s mode", args.mode)
        return EXIT_USAGE
    if args.mode != "download":
        # Before setup(): a model imports lazily from the generation's files for as
        # long as it runs, so the hold must cover all of it.
        # A staged worker is told its shared generation (its prefix is the stage).
        staged_from = os.environ.get(GENERATION_ENV)
        if staged_from:
            held = hold_generation(staged_from, resolved=True)
        else:
            held = hold_generation(_loaded_generation())
        log.debug("holding env generation %s", held or "(none: no lock file)")
    try:
        if args.mode == "download":
            return _download(args, kwargs, result_file or None)
        if args.mode == "serve":
            return _serve(args, kwargs)
        return _calculator(args, kwargs)
    except ProtocolError as exc:
        log.error("%s", exc)
        return EXIT_PROTOCOL_ERROR
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


def _loaded_generation() -> str:
    """The generation directory this process loaded its packages from.

    ``sys.prefix`` runs through ``envs/<name>``, a symlink that a rebuild may have
    swapped since this interpreter started: the kernel's map of the extension
    modules already loaded (numpy's, imported above) names where they really came
    from. ``sys.prefix`` when the map says nothing.
    """
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as fh:
            maps = fh.read()
    except OSError:
        return sys.prefix
    return generation_in_maps(os.path.realpath(sys.prefix), maps) or sys.prefix


def generation_in_maps(prefix: str, maps: str) -> str | None:
    """The generation of ``prefix``'s env (``envs/.<name>.<build-id>``) that a mapped
    file of ``maps`` (``/proc/<pid>/maps`` text) lies in, if any."""
    envs, base = os.path.split(prefix)
    if not base.startswith(".") or base.count(".") < 2:
        return None  # not a generation directory: a plain venv, a legacy env
    stem = os.path.join(envs, base[: base.rindex(".") + 1])  # envs/.<name>.
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or not fields[5].startswith(stem):
            continue
        build_id, sep, _inside = fields[5][len(stem) :].partition(os.sep)
        if build_id and sep and "." not in build_id:  # another env's name has a dot
            return stem + build_id
    return None


def _download(args: argparse.Namespace, kwargs: dict[str, Any], result_file: str | None) -> int:
    returned: Any = None
    try:
        module = load_env_source(args.env_source)
        hook = getattr(module, "download", None)
        if callable(hook):
            log.info("fetching %s with the env's download() hook", args.checkpoint)
            returned = hook(args.checkpoint, **kwargs)
        else:
            log.info("fetching %s by running setup() once on the CPU", args.checkpoint)
            make_calculator(module, args.checkpoint, "cpu", kwargs, None)
    except Exception as exc:
        log.exception("download of %s failed", args.checkpoint)
        # urllib's and requests' HTTP errors keep the URL out of their message; the
        # client names the model's page from it (gated weights).
        url = getattr(exc, "url", None) or getattr(getattr(exc, "response", None), "url", None)
        if isinstance(url, str) and url:
            log.error("the request that failed: %s", url)
        return EXIT_MODEL_ERROR
    log.info("fetched %s", args.checkpoint)
    if result_file is not None:
        _write_download_result(result_file, returned_paths(returned))
    return 0


def returned_paths(value: Any) -> list[str]:
    """The absolute paths in what ``download()`` returned: a path, a list or tuple
    of paths, or None. Anything else is logged and ignored: the download worked,
    and ``add`` still records the files its cache scan saw."""
    if value is None:
        return []
    items = value if isinstance(value, list | tuple) else [value]
    paths = []
    for item in items:
        if isinstance(item, str | bytes | os.PathLike):
            path = os.fsdecode(os.fspath(item))
            if path and "\0" not in path:
                paths.append(os.path.abspath(path))
                continue
        log.warning(
            "download() returned %s, which is not a path; ignored (return a path, a list "
            "of paths or None)",
            _short_repr(item),
        )
    return paths


def _short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:79] + "…"


def _write_download_result(path: str, paths: list[str]) -> None:
    """Write ``paths`` as JSON to ``path`` (the spawner's private run dir), atomically."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(paths, fh)
        os.replace(tmp, path)
    except OSError as exc:
        # The weights are in the cache: a lost list costs attribution, not the fetch.
        log.warning("could not write the download result to %s: %s", path, exc)
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def _calculator(args: argparse.Namespace, kwargs: dict[str, Any]) -> int:
    # setup() runs before the connection: a worker that dies while still unconnected
    # died loading the model, so the client can say so (a segfault in setup() is
    # not "during a calculation"). A setup() exception still comes back in-band.
    runner, hook, setup_error = None, None, None
    try:
        runner, hook = _build_runner(args, kwargs)
    except Exception as exc:
        setup_error = CapturedError.current(exc, "setup")
        log.error("setup failed:\n%s", setup_error.traceback)
    timeout = 60.0 if args.connect_timeout is None else args.connect_timeout
    stream = FrameStream(connect(args.socket, timeout), peer="calculator")
    loop = ServeLoop(
        stream,
        runner,
        inband_errors=True,
        setup_error=setup_error,
        body_timeout=args.body_timeout,
        batch_hook=hook,
    )
    try:
        return loop.run()
    finally:
        stream.close()


def _serve(args: argparse.Namespace, kwargs: dict[str, Any]) -> int:
    try:
        runner, hook = _build_runner(args, kwargs)
        if args.structure:
            runner.use_template(_read_structure(args.structure))
    except Exception:
        log.exception("setup failed")
        return EXIT_MODEL_ERROR
    log.info("model ready (%s on %s, %s)", args.checkpoint, args.device, runner.model_dtype)
    timeout = 600.0 if args.connect_timeout is None else args.connect_timeout
    stream = FrameStream(connect(args.socket, timeout), peer="server")
    loop = ServeLoop(
        stream, runner, inband_errors=False, body_timeout=args.body_timeout, batch_hook=hook
    )
    try:
        code = loop.run()
    finally:
        stream.close()
    log.info("server finished; worker exits with code %d", code)
    return code
