"""Why a download failed, said in one line, with the fix in the next.

The fetch phase of ``add`` (and ``sync``) runs the env's ``download()`` hook, or
``setup()`` on the CPU, in a worker. When that fails, the worker's whole output is
saved to a log file under the cache root's ``logs/`` and the error names the cause,
the fix and that file, never a 60-line traceback. The usual causes are told apart
from the worker's output and exit status:

* no network on this node (a compute node): fetch on a login node with
  ``add --no-verify``, then verify here;
* HTTP 401 or 403 from a hub: gated weights, whose licence must be accepted on the
  model's page, with ``HF_TOKEN`` set; for a checkpoint whose ``CHECKPOINT_INFO``
  names its ``gated`` URL, the one line :func:`gated_message` says, which is also
  what :func:`require_hf_token` says before a download that has no token to try;
* a full disk (``ENOSPC``): the filesystem of the cache root and its free space;
* SIGKILL with no timeout of ours: most likely the out-of-memory killer;
* our own timeout: the option that raises it.

Anything else is the env file's to fix, and the message says so.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import tempfile
import time
from pathlib import Path

from rootstock.errors import WorkerError
from rootstock.install.layout import InstallLayout
from rootstock.runtime.worker_env import find_hf_token, real_home

#: The ``add`` option that sets the download phase's time limit.
DOWNLOAD_TIMEOUT_OPTION = "--download-timeout"

_DISK_FULL = re.compile(r"\[Errno 28\]|No space left on device|\bENOSPC\b")
_GATED = re.compile(
    r"HTTP Error (40[13])|\b(40[13]) Client Error|(?:status|code)\W{0,3}(40[13])\b|"
    r"\b(401) Unauthorized|\b(403) Forbidden|GatedRepoError|Cannot access gated repo",
    re.IGNORECASE,
)
_NETWORK = re.compile(
    r"Name or service not known|Temporary failure in name resolution|nodename nor servname|"
    r"Network is unreachable|No route to host|Could not resolve host|gaierror|"
    r"Failed to establish a new connection|Max retries exceeded|Connection refused|"
    r"couldn't connect to|ConnectionError|ConnectTimeout|URLError",
    re.IGNORECASE,
)
# The last line of a traceback: ``urllib.error.URLError: <urlopen error ...>``.
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt)\b")
_URL = re.compile(r"https?://[^\s'\"<>)]+")
_LONGEST_CAUSE = 240


class DownloadFailed(WorkerError):
    """The download phase failed; ``cause`` says why (``network``, ``gated``,
    ``disk-full``, ``killed``, ``timeout`` or ``error``), ``log_path`` holds the
    worker's whole output (None when it could not be saved; then the output's tail
    is the ``remote_traceback``)."""

    def __init__(
        self,
        message: str,
        *,
        cause: str,
        hint: str | None,
        log_path: Path | None,
        output_tail: str = "",
    ) -> None:
        super().__init__(message, remote_traceback=output_tail, hint=hint)
        self.cause = cause
        self.log_path = log_path

    def __str__(self) -> str:
        text = super().__str__()
        if self.log_path is not None:
            text += f"\n  log: {self.log_path} (the worker's full output)"
        return text


def gated_message(checkpoint: str, url: str) -> str:
    """The one line for gated weights that cannot be fetched (no token, or no access)."""
    return (
        f"{checkpoint} is gated: request access at {url}, "
        "then set HF_TOKEN (or ~/.cache/huggingface/token)"
    )


def require_hf_token(
    checkpoint: str, gated_url: str, environ: dict[str, str] | None = None
) -> None:
    """Refuse, before any download starts, gated weights with no Hugging Face token.

    The token is looked for where the worker's environment finds it
    (:func:`~rootstock.runtime.worker_env.find_hf_token`); a token without access
    is only found out by the hub, which :func:`download_failure` reports the same way.
    """
    env = dict(os.environ if environ is None else environ)
    token, _source = find_hf_token(env, real_home(env))
    if not token:
        raise DownloadFailed(
            gated_message(checkpoint, gated_url), cause="gated", hint=None, log_path=None
        )


def download_failure(
    layout: InstallLayout,
    env_name: str,
    checkpoint: str,
    *,
    output: str,
    exit_code: int | None,
    timeout: float,
    timed_out: bool,
    gated_url: str | None = None,
) -> DownloadFailed:
    """The error for a failed download: its cause and fix, and the log file it saved.

    ``output`` is the worker's output, ``exit_code`` its status (negative: the signal
    that killed it), ``timed_out`` whether our own ``timeout`` stopped it.
    ``gated_url`` is the checkpoint's ``CHECKPOINT_INFO`` ``gated`` URL, if any: a
    hub's 401 or 403 is then said as :func:`gated_message`.
    """
    log_path, problem = save_download_log(layout, checkpoint, output)
    cause, message, hint = _classify(
        layout, env_name, checkpoint, output, exit_code, timeout, timed_out
    )
    if cause == "gated" and gated_url:
        message, hint = gated_message(checkpoint, gated_url), ""
    if problem is not None:
        unsaved = f"(the worker's output could not be saved: {problem}; its end is below)"
        hint = f"{hint} {unsaved}" if hint else unsaved
    tail = "" if log_path is not None else "\n".join(output.splitlines()[-40:])
    return DownloadFailed(message, cause=cause, hint=hint, log_path=log_path, output_tail=tail)


def _classify(
    layout: InstallLayout,
    env_name: str,
    checkpoint: str,
    output: str,
    exit_code: int | None,
    timeout: float,
    timed_out: bool,
) -> tuple[str, str, str]:
    """``(cause, message, hint)`` for a failed download."""
    what = f"downloading {checkpoint}"
    if timed_out:
        return (
            "timeout",
            f"{what} took longer than {timeout:g} s and was stopped",
            f"raise the limit with `rootstock add {checkpoint} {DOWNLOAD_TIMEOUT_OPTION} "
            "SECONDS`, or check the network from this node",
        )
    last = _last_exception(output)
    if exit_code is not None and exit_code < 0:
        number = -exit_code
        if number == signal.SIGKILL:
            return (
                "killed",
                f"{what} failed: the worker was killed by signal 9 (SIGKILL), most likely "
                "by the out-of-memory killer",
                "run it on a node, or in a job, with more memory",
            )
        return (
            "killed",
            f"{what} failed: the worker was killed by signal {number} ({_signal_name(number)})",
            f"re-run `rootstock add {checkpoint}`; if it happens again, the log says what "
            "the worker was doing",
        )
    if _DISK_FULL.search(output):
        mount, free = filesystem_of(layout.cache_root)
        return (
            "disk-full",
            f"{what} failed: the disk is full ({mount}, the filesystem of the cache root "
            f"{layout.cache_root}, has {free} free)",
            f"free space on {mount}, or give this root a cache root on a larger filesystem",
        )
    gated = _GATED.search(output)
    if gated:
        status = next((group for group in gated.groups() if group), "401 or 403")
        page = _model_page(output)
        where = f" ({page})" if page else ""
        return (
            "gated",
            f"{what} failed: the hub refused access (HTTP {status}); the weights are gated",
            f"accept the licence on the model's page{where} with your account, set HF_TOKEN "
            f"to a token of that account, and re-run `rootstock add {checkpoint}`",
        )
    if _NETWORK.search(output):
        because = f" ({_shortened(last)})" if last else ""
        return (
            "network",
            f"{what} failed: this node cannot reach the network{because}",
            f"run `rootstock add {checkpoint} --no-verify` on a node with network (a login "
            f"node), then `rootstock add {checkpoint}` here to verify",
        )
    status = f"exit code {exit_code}" if exit_code is not None else "no exit code"
    because = f": {_shortened(last)}" if last else ""
    return (
        "error",
        f"{what} failed in the env's download() or setup() (env {env_name!r}, {status}){because}",
        f"the traceback is in the log; a fix belongs in environments/{env_name}.py "
        f"(then `rootstock install` it and re-run `rootstock add {checkpoint}`)",
    )


def save_download_log(
    layout: InstallLayout, checkpoint: str, output: str
) -> tuple[Path | None, str | None]:
    """Write ``output`` to ``{cache root}/logs/download-<id>-<time>.log``, else to the
    temp dir: ``(path, None)``, or ``(None, why)`` when neither could be written."""
    stamp = time.strftime("%Y%m%dT%H%M%S")
    name = f"download-{re.sub(r'[^A-Za-z0-9._-]', '_', checkpoint)}-{stamp}-{os.getpid()}.log"
    problem = None
    for directory in (layout.cache_root / "logs", Path(tempfile.gettempdir())):
        path = directory / name
        try:
            directory.mkdir(parents=True, exist_ok=True)
            path.write_text(output, encoding="utf-8", errors="replace")
        except OSError as exc:
            problem = f"{path}: {exc.strerror or exc}"
            continue
        return path, None
    return None, problem


def filesystem_of(path: Path) -> tuple[str, str]:
    """The mount point holding ``path`` and its free space (``"3.2 GiB"``)."""
    current = os.path.realpath(path)
    while not os.path.exists(current) and current != os.path.dirname(current):
        current = os.path.dirname(current)
    mount = current
    while not os.path.ismount(mount):
        mount = os.path.dirname(mount)
    try:
        free = f"{shutil.disk_usage(current).free / 2**30:.1f} GiB"
    except OSError:
        free = "an unknown amount"
    return mount, free


def _last_exception(output: str) -> str:
    """The last traceback line naming an exception (``URLError: ...``), or ""."""
    for line in reversed(output.splitlines()):
        if _EXCEPTION_LINE.match(line.strip()):
            return line.strip()
    return ""


def _model_page(text: str) -> str | None:
    """The model's page on the Hugging Face hub, if a URL in ``text`` names one."""
    for url in _URL.findall(text):
        found = re.match(r"https?://huggingface\.co/(?:api/models/)?([^/\s]+/[^/\s]+)", url)
        if found:
            return f"https://huggingface.co/{found.group(1)}"
    return None


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return "unknown signal"


def _shortened(text: str) -> str:
    return text if len(text) <= _LONGEST_CAUSE else text[: _LONGEST_CAUSE - 1] + "…"
