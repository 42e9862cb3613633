"""A stand-in for PBS Pro's ``qsub`` and ``qselect``: no server, a JSON file of jobs.

Debian packages no PBS server, so the ``.pbs`` recipe's scheduler calls are tested
against this fake. It records every call and answers the way PBS Pro does where the
recipe depends on it:

* ``qsub [-N name] [-a time] [-v list] [other options] script`` records the job and
  prints ``<n>.standin-pbs``. ``-N`` falls back to the script's ``#PBS -N`` directive,
  then to the script's file name. ``-a [[[[CC]YY]MM]DD]hhmm[.SS]`` is parsed as PBS
  does (a partial date rolls forward to its next occurrence); a job whose start time
  is in the future is in state **W**, otherwise **Q**. ``-v`` passes exactly the
  variables it names (``VAR=value`` or ``VAR`` taken from the caller), split on
  commas outside quotes. The script is copied, as PBS spools it.
* ``qselect [-u user] [-N name] [-s states]`` prints the ids of matching jobs; names
  match exactly, and a W job whose start time has come counts as Q.

Used as ``python pbs_standin.py STATE_DIR qsub|qselect ARGS...`` (the tests write
``qsub`` and ``qselect`` wrappers onto PATH). Calls are appended to
``STATE_DIR/events.log``, which the rootstock stand-in also writes, so the tests can
check what ran first.
"""

from __future__ import annotations

import fcntl
import getpass
import json
import os
import re
import shutil
import sys
import time
from datetime import datetime, timedelta
from pathlib import Path

SERVER = "standin-pbs"


def parse_exec_time(value: str, now: datetime) -> datetime:
    """PBS Pro's ``-a [[[[CC]YY]MM]DD]hhmm[.SS]`` as a local time."""
    match = re.fullmatch(r"(\d{4,12})(?:\.(\d{2}))?", value)
    if not match or len(match.group(1)) % 2:
        raise ValueError(f"illegal -a value: {value}")
    digits, seconds = match.group(1), int(match.group(2) or 0)
    hour, minute = int(digits[-4:-2]), int(digits[-2:])
    rest = digits[:-4]
    fields = {"hour": hour, "minute": minute, "second": seconds, "microsecond": 0}
    if len(rest) >= 2:
        fields["day"] = int(rest[-2:])
    if len(rest) >= 4:
        fields["month"] = int(rest[-4:-2])
    if len(rest) == 6:
        fields["year"] = 2000 + int(rest[:2])
    if len(rest) == 8:
        fields["year"] = int(rest[:4])
    when = now.replace(**fields)
    if when <= now:  # a partial date means its next occurrence
        if "year" in fields:
            pass
        elif "month" in fields:
            when = when.replace(year=when.year + 1)
        elif "day" in fields:
            month = when.month % 12 + 1
            when = when.replace(year=when.year + (month == 1), month=month)
        else:
            when += timedelta(days=1)
    return when


def split_variable_list(text: str) -> list[str]:
    """``-v`` items: split on commas outside single or double quotes."""
    items, current, quote = [], "", None
    for char in text:
        if quote:
            if char == quote:
                quote = None
            else:
                current += char
        elif char in "'\"":
            quote = char
        elif char == ",":
            items.append(current)
            current = ""
        else:
            current += char
    items.append(current)
    return [item for item in items if item]


def directive_name(script: Path) -> str | None:
    """The script's ``#PBS -N`` directive, if any."""
    for line in script.read_text().splitlines():
        found = re.match(r"#PBS\s+-N\s+(\S+)", line)
        if found:
            return found.group(1)
    return None


class Server:
    """The job table in ``STATE_DIR/jobs.json``, locked for each call."""

    def __init__(self, state_dir: Path) -> None:
        self.dir = state_dir
        self.path = state_dir / "jobs.json"
        self.lock = open(state_dir / "jobs.lock", "a")  # noqa: SIM115 - held for the call
        fcntl.flock(self.lock, fcntl.LOCK_EX)
        self.jobs: list[dict] = json.loads(self.path.read_text()) if self.path.exists() else []

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.jobs, indent=1))
        os.replace(tmp, self.path)

    def event(self, line: str) -> None:
        with open(self.dir / "events.log", "a") as fh:
            fh.write(line + "\n")


def qsub(server: Server, args: list[str]) -> int:
    """Record a job; print its id."""
    server.event("qsub " + " ".join(args))
    name = exec_at = None
    variables: dict[str, str] = {}
    options: list[str] = []
    i = 0
    while i < len(args) - 1:
        flag, value = args[i], args[i + 1]
        if flag == "-N":
            name = value
        elif flag == "-a":
            exec_at = value
        elif flag == "-v":
            for item in split_variable_list(value):
                key, eq, val = item.partition("=")
                variables[key] = val if eq else os.environ.get(key, "")
        elif flag.startswith("-"):
            options += [flag, value]
        else:
            break
        i += 2
    if i != len(args) - 1:
        print("qsub: usage: qsub [options] script", file=sys.stderr)
        return 2
    script = Path(args[-1])
    if not script.is_file():
        print(f"qsub: script file cannot be loaded - {script}", file=sys.stderr)
        return 2
    now = datetime.now()
    start = now
    if exec_at is not None:
        try:
            start = parse_exec_time(exec_at, now)
        except ValueError as exc:
            print(f"qsub: {exc}", file=sys.stderr)
            return 2
    job_id = f"{len(server.jobs) + 1}.{SERVER}"
    spooled = server.dir / "spool" / f"{job_id}.SC"
    spooled.parent.mkdir(exist_ok=True)
    shutil.copyfile(script, spooled)
    server.jobs.append(
        {
            "id": job_id,
            "name": name or directive_name(script) or script.name,
            "owner": getpass.getuser(),
            "state": "W" if start > now else "Q",
            "execution_time": start.timestamp(),
            "a": exec_at,
            "variables": variables,
            "options": options,
            "script": str(spooled),
            "submitted_from": str(script.resolve()),
            "workdir": os.getcwd(),
            "argv": args,
        }
    )
    server.save()
    print(job_id)
    return 0


def current_state(job: dict) -> str:
    """W turns into Q once the job's start time has come."""
    if job["state"] == "W" and job["execution_time"] <= time.time():
        return "Q"
    return job["state"]


def qselect(server: Server, args: list[str]) -> int:
    """Print the ids of the jobs matching ``-u``, ``-N`` and ``-s``."""
    server.event("qselect " + " ".join(args))
    want = dict(zip(args[::2], args[1::2], strict=False))
    for job in server.jobs:
        if "-u" in want and job["owner"] not in want["-u"].split(","):
            continue
        if "-N" in want and job["name"] != want["-N"]:
            continue
        if "-s" in want and current_state(job) not in want["-s"]:
            continue
        print(job["id"])
    return 0


def main(argv: list[str]) -> int:
    state_dir, command, args = Path(argv[0]), argv[1], argv[2:]
    server = Server(state_dir)
    return {"qsub": qsub, "qselect": qselect}[command](server, args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
