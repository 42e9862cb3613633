"""Building one env: lock with uv, create the venv, install, swap into place.

The env is assembled in ``{root}/.build/`` and becomes visible only by an atomic
rename of the ``envs/<name>`` symlink, so users keep spawning workers from the old
env for the whole build and a failed build leaves the old env untouched. The
previous build is kept one generation, because workers already running from it
may still import lazily from its files; an older one is deleted only once no
worker holds its generation lock (:mod:`rootstock.install.generations`).

Each build in ``.build/`` has an owner record naming its host and pid, so the
next install can sweep the staging of builds that were killed (see
:func:`claim_stale_staging`) without touching one that is still running.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from rootstock.errors import BuildError
from rootstock.install import Reporter
from rootstock.install.atomic import atomic_write_json
from rootstock.install.envfile import EnvFile, source_hash
from rootstock.install.envs import ENV_METADATA
from rootstock.install.generations import make_generation_lock, remove_old_generations
from rootstock.install.images import ImageInfo, make_image, mksquashfs
from rootstock.install.interpreters import Interpreter
from rootstock.install.layout import InstallLayout, images_enabled
from rootstock.install.locking import FileLock
from rootstock.install.parsing import loads_json
from rootstock.install.supervise import process_alive, process_start_time, run_supervised
from rootstock.install.uv import run_uv, uv_environment, uv_version
from rootstock.install.vendor import vendor_wheel

_PEP723_BLOCK = re.compile(r"(?m)^# /// script$\s(?P<content>(^#(| .*)$\s)+)^# ///$")
_VERSIONS_PROBE = (
    "import json, sys\n"
    "from importlib import metadata\n"
    "def v(name):\n"
    "    try:\n"
    "        return metadata.version(name)\n"
    "    except metadata.PackageNotFoundError:\n"
    "        return None\n"
    "import numpy, ase, rootstock\n"
    "print(json.dumps({'python': '%d.%d.%d' % sys.version_info[:3], 'torch': v('torch'),"
    " 'ase': v('ase'), 'numpy': v('numpy'), 'rootstock': v('rootstock')}))\n"
)
# uv will not combine these with a pylock.toml; the lock already holds the constraints.
_REFUSED_WITH_PYLOCK: tuple[str, ...] = ("UV_CONSTRAINT", "UV_OVERRIDE")
#: ``.build/<env>.<build-id>`` is the staging venv; these name its companions.
OWNER_SUFFIX = ".owner.json"
WORK_SUFFIX = ".work"
#: Entries an interrupted sweep had claimed but not yet deleted.
SWEPT_PREFIX = ".swept-"
#: Another host's build (its pid cannot be checked from here), or one with no owner
#: record, is taken as dead once its owner record or files are this old.
FOREIGN_BUILD_STALE_S = 24 * 3600


@dataclass
class BuildOptions:
    """What the maintainer asked for on the command line."""

    upgrade: bool = False
    find_links: list[str] = field(default_factory=list)
    constraints: list[str] = field(default_factory=list)
    verbose: bool = False
    #: Pack an image of the build: None follows the root (``images`` in layout.json).
    image: bool | None = None


@dataclass
class BuildResult:
    """What a finished build produced (before it is registered)."""

    name: str
    staging: Path
    lock_text: str | None
    metadata: dict
    warnings: list[str]
    owner: Path | None = None


def root_lock(layout: InstallLayout, timeout: float = 120.0) -> FileLock:
    """The root-wide lock: registration, the staging sweep, each build's owner record.

    Held for seconds, never for a build.
    """
    return FileLock(
        layout.locks_dir / "root.lock", timeout=timeout, what="install-root lock", private=True
    )


def env_build_lock(layout: InstallLayout, name: str) -> FileLock:
    """The lock one install of env ``name`` holds for its whole build (never waits)."""
    return FileLock(
        layout.locks_dir / f"env-{name}.lock", timeout=0, what=f"{name} build lock", private=True
    )


def collect_constraints(options: BuildOptions) -> list[str]:
    """Constraint lines from ``--constraint`` files and ``$UV_CONSTRAINT``.

    ``uv lock`` ignores ``UV_CONSTRAINT``, so the build copies them into the
    script's ``[tool.uv] constraint-dependencies`` where the resolver sees them.
    """
    files = list(options.constraints)
    files += os.environ.get("UV_CONSTRAINT", "").split()
    lines: list[str] = []
    for name in files:
        try:
            text = Path(name).expanduser().read_text()
        except OSError as exc:
            raise BuildError(f"cannot read constraint file {name}: {exc}") from None
        for raw in text.splitlines():
            line = raw.split("#", 1)[0].strip()
            if line and not line.startswith("-"):
                lines.append(line)
    return lines


def render_build_script(env: EnvFile, constraints: list[str], find_links: list[str]) -> str:
    """The env file with build-time uv settings merged into its PEP 723 block."""
    if not constraints and not find_links:
        return env.source
    meta = json.loads(json.dumps(env.script_metadata))  # deep copy
    tool_uv = meta.setdefault("tool", {}).setdefault("uv", {})
    if constraints:
        tool_uv["constraint-dependencies"] = [
            *tool_uv.get("constraint-dependencies", []),
            *constraints,
        ]
    if find_links:
        tool_uv["find-links"] = [
            *tool_uv.get("find-links", []),
            *(str(Path(f).expanduser().absolute()) for f in find_links),
        ]
    block = (
        "# /// script\n"
        + "".join(f"# {line}\n" if line else "#\n" for line in _dump_toml(meta).splitlines())
        + "# ///"
    )
    match = _PEP723_BLOCK.search(env.source)
    assert match is not None  # the env file passed lint, which requires the block
    return env.source[: match.start()] + block + env.source[match.end() :]


def render_unlocked_project(env: EnvFile) -> str:
    """A ``pyproject.toml`` that installs ``env``'s dependencies when it cannot be locked.

    ``uv pip install -r script.py`` reads a script's dependencies but not its
    ``[tool.uv]`` sources and indexes, which it does read from a ``pyproject.toml``;
    so this project carries both, and a package pinned to an explicit index still
    comes from there.
    """
    tool_uv = env.script_metadata.get("tool", {}).get("uv", {})
    meta: dict = {
        "project": {
            "name": "rootstock-env-dependencies",
            "version": "0",
            "dependencies": list(env.dependencies),
        }
    }
    routing = {key: tool_uv[key] for key in ("sources", "index") if key in tool_uv}
    if routing:
        meta["tool"] = {"uv": routing}
    return _dump_toml(meta) + "\n"


def _dump_toml(meta: dict) -> str:
    plain = {k: v for k, v in meta.items() if not isinstance(v, dict)}
    lines = [f"{k} = {_toml_value(v)}" for k, v in plain.items()]
    for key, value in meta.items():
        if isinstance(value, dict):
            lines += _dump_table([key], value)
    return "\n".join(lines)


def _dump_table(path: list[str], table: dict) -> list[str]:
    lines = ["", f"[{'.'.join(path)}]"]
    lines += [f"{k} = {_toml_value(v)}" for k, v in table.items() if not isinstance(v, dict)]
    for key, value in table.items():
        if isinstance(value, dict):
            lines += _dump_table([*path, key], value)
    return lines


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + "}"
    return json.dumps(str(value))  # a JSON string is a valid TOML basic string


def build_env(
    layout: InstallLayout,
    env: EnvFile,
    interpreter: Interpreter,
    options: BuildOptions,
    previous_lock: str | None,
    step: Reporter,
) -> BuildResult:
    """Build ``env`` into a fresh staging directory under ``{root}/.build/``.

    The result's staging directory and owner record stay until :func:`activate`
    moves it into ``envs/`` or :func:`discard_build` drops it.
    """
    owner = write_build_owner(layout, env.name)
    staging = owner.with_name(owner.name.removesuffix(OWNER_SUFFIX))
    build_id = staging.name.removeprefix(f"{env.name}.")
    work = layout.build_dir / f"{staging.name}{WORK_SUFFIX}"

    def beat(message: str) -> None:
        # Each step refreshes the record, which is how another host tells a slow
        # build from a dead one.
        with contextlib.suppress(OSError):
            os.utime(owner)
        step(message)

    try:
        work.mkdir()
        result = _build_into(
            layout, env, interpreter, options, previous_lock, beat, staging, work, build_id
        )
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        owner.unlink(missing_ok=True)
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result.owner = owner
    return result


def write_build_owner(layout: InstallLayout, name: str) -> Path:
    """Start a build of ``name``: write its owner record, ``.build/<name>.<id>.owner.json``.

    The staging venv is that path without the suffix. The record comes before any
    staging, so no moment has staging that looks abandoned, and it is written under
    the root lock the sweep holds, so no sweep sees one half written.
    """
    layout.build_dir.mkdir(parents=True, exist_ok=True)
    build_id = f"{int(time.time())}-{secrets.token_hex(3)}"
    owner = layout.build_dir / f"{name}.{build_id}{OWNER_SUFFIX}"
    with root_lock(layout):
        atomic_write_json(owner, _owner_record(name))
    return owner


def building_envs(layout: InstallLayout) -> set[str]:
    """The envs a live build is staging now, from the owner records in ``.build/``.

    Lock-free and read-only, for a user who may not open the install's lock files:
    a record is live while its owner runs (this host) or was refreshed within
    :data:`FOREIGN_BUILD_STALE_S` (another host's build).
    """
    try:
        owners = [
            entry
            for entry in layout.build_dir.iterdir()
            if entry.name.endswith(OWNER_SUFFIX) and not entry.name.startswith(SWEPT_PREFIX)
        ]
    except OSError:
        return set()
    names = set()
    for owner in owners:
        base = owner.name.removesuffix(OWNER_SUFFIX)
        if _build_is_live(layout.build_dir, base, [owner]):
            try:
                record = loads_json(owner.read_bytes())
            except (OSError, ValueError):
                continue
            if isinstance(record, dict) and isinstance(record.get("env"), str):
                names.add(record["env"])
    return names


def _build_into(
    layout: InstallLayout,
    env: EnvFile,
    interpreter: Interpreter,
    options: BuildOptions,
    previous_lock: str | None,
    step: Reporter,
    staging: Path,
    work: Path,
    build_id: str,
) -> BuildResult:
    warnings: list[str] = []
    constraints = collect_constraints(options)
    script = work / f"{env.name}.py"
    script.write_text(render_build_script(env, constraints, options.find_links))
    lock_path = work / f"{env.name}.py.lock"
    if previous_lock and not options.upgrade:
        lock_path.write_text(previous_lock)
    find_links = [a for f in options.find_links for a in ("--find-links", f)]
    py = ["--python", str(interpreter.path)]

    step("resolving dependencies" + (" (upgrade)" if options.upgrade else ""))
    lock_text: str | None = None
    try:
        run_uv(
            layout,
            ["lock", "--script", script, *py, *(["--upgrade"] if options.upgrade else [])],
            what=f"locking {env.name}",
            verbose=options.verbose,
        )
        # A requirements.txt export keeps names and versions only, so a package the
        # script routes to an explicit index would be looked up on the default index;
        # pylock.toml records each package's index and file URL. uv insists on the name.
        pylock = work / "pylock.toml"
        run_uv(
            layout,
            [
                "export",
                "--script",
                script,
                "--frozen",
                "--format",
                "pylock.toml",
                *py,
                "-o",
                pylock,
            ],
            what=f"exporting the lock of {env.name}",
            verbose=options.verbose,
        )
        lock_text = lock_path.read_text()
        install_args: list[str | Path] = ["--no-deps", "-r", pylock]
        # uv refuses constraints or overrides next to a pylock.toml; the constraints
        # are already in the lock (see collect_constraints).
        unset_env = _REFUSED_WITH_PYLOCK
    except BuildError as exc:
        warnings.append(
            f"warning: {env.name} could not be locked ({exc.message}); building "
            "without a lockfile, so rebuilds may resolve differently"
        )
        project = work / "unlocked" / "pyproject.toml"
        project.parent.mkdir()
        project.write_text(render_unlocked_project(env))
        constraint_file = work / "constraints.txt"
        constraint_file.write_text("\n".join(constraints) + "\n")
        install_args = ["-r", project, "-c", constraint_file]
        unset_env = ()

    step(f"creating the venv on Python {interpreter.version}")
    run_uv(
        layout,
        ["venv", "--relocatable", "--no-project", *py, staging],
        what=f"creating the venv for {env.name}",
        verbose=options.verbose,
    )
    # Every worker of this generation takes a shared lock on it for life.
    make_generation_lock(staging)
    wheel = vendor_wheel(layout.wheels_dir)
    env_python: list[str | Path] = ["--python", staging / "bin" / "python"]
    step("installing packages and compiling bytecode")
    # uv takes no other requirement next to a pylock.toml, so the vendored wheel
    # goes in first on its own; the second call's --compile-bytecode compiles the
    # whole site-packages, rootstock included.
    run_uv(
        layout,
        ["pip", "install", *env_python, "--no-deps", wheel],
        what=f"installing rootstock into {env.name}",
        verbose=options.verbose,
    )
    run_uv(
        layout,
        ["pip", "install", *env_python, "--compile-bytecode", *find_links, *install_args],
        what=f"installing {env.name}'s packages",
        verbose=options.verbose,
        unset_env=unset_env,
    )

    step("checking the env")
    _close_world_writable_locks(staging)
    (staging / "env_source.py").write_text(env.source)
    if lock_text is not None:
        (staging / "env_source.py.lock").write_text(lock_text)
    versions = _probe_versions(layout, staging, env.name)
    image = _pack_image(layout, env.name, options, staging, work, step, warnings)
    metadata = {
        "name": env.name,
        "built_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "build_id": build_id,
        "source_hash": source_hash(env.source),
        "lock_hash": source_hash(lock_text) if lock_text is not None else None,
        "interpreter": interpreter.to_dict(),
        "versions": versions,
        "uv": uv_version(layout),
        "locked": lock_text is not None,
        "image": image.to_record() if image is not None else None,
    }
    atomic_write_json(staging / ENV_METADATA, metadata)
    return BuildResult(env.name, staging, lock_text, metadata, warnings)


def _pack_image(
    layout: InstallLayout,
    name: str,
    options: BuildOptions,
    staging: Path,
    work: Path,
    step: Reporter,
    warnings: list[str],
) -> ImageInfo | None:
    """Pack the image into the staging build, or None (off, or it could not be made)."""
    wanted = options.image if options.image is not None else images_enabled(layout)
    if not wanted:
        return None
    if mksquashfs() is None:
        warnings.append(
            f"warning: no image of {name} was made: mksquashfs is not installed (install "
            "squashfs-tools, or pass --no-image; `rootstock init --no-images` turns images "
            "off for the root)"
        )
        return None
    step("packing the image (mksquashfs)")
    try:
        image = make_image(layout, staging, work)
    except BuildError as exc:
        warnings.append(f"warning: no image of {name} was made: {exc.message}")
        return None
    # Into the generation before it is renamed into place: never a finished-looking
    # image without its build, nor one left behind by a build that died.
    os.replace(work / image.file, staging / image.file)
    step(f"packed a {image.size / 1e6:.0f} MB image in {image.seconds:.1f} s")
    return image


def _close_world_writable_locks(env_dir: Path) -> None:
    # uv leaves empty ``.lock`` files with mode 0666 in the venv; a shared install
    # must have nothing that every user can write.
    for lock in env_dir.rglob(".lock"):
        mode = lock.lstat().st_mode
        if lock.is_file() and mode & 0o002:
            lock.chmod(mode & 0o775)


def _probe_versions(layout: InstallLayout, staging: Path, name: str) -> dict:
    python, source = staging / "bin" / "python", staging / "env_source.py"
    cmd = [str(python), "-I", "-c", _VERSIONS_PROBE, str(source)]
    try:
        proc = run_supervised(cmd, env=uv_environment(layout), timeout=120)
        if proc.returncode != 0:
            raise subprocess.CalledProcessError(proc.returncode, cmd, proc.stdout, proc.stderr)
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError, OSError) as exc:
        output = getattr(exc, "stderr", "") or ""
        raise BuildError(
            f"the built env {name!r} cannot import numpy, ase and rootstock",
            output,
            hint="the env must provide numpy and ase (add them to the env file's dependencies)",
        ) from None


def _owner_record(name: str) -> dict:
    return {
        "env": name,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "pid_start": process_start_time(os.getpid()),
        "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def _build_is_live(build_dir: Path, base: str, members: list[Path]) -> bool:
    owner_file = build_dir / f"{base}{OWNER_SUFFIX}"
    try:
        owner = loads_json(owner_file.read_bytes())
        age = time.time() - owner_file.stat().st_mtime
        if not isinstance(owner, dict):
            raise ValueError(owner_file)
    except (OSError, ValueError):
        if all(_is_temp_file(m.name) for m in members):
            return False  # a record's write cut short (see build_env): nothing else exists
        # No record: an older client's build, judged by age.
        ages = []
        for member in members:
            with contextlib.suppress(OSError):
                ages.append(time.time() - member.lstat().st_mtime)
        return bool(ages) and min(ages) < FOREIGN_BUILD_STALE_S
    if owner.get("host") == socket.gethostname():
        pid = owner.get("pid")
        return isinstance(pid, int) and process_alive(pid, owner.get("pid_start"))
    return age < FOREIGN_BUILD_STALE_S


def _is_temp_file(entry: str) -> bool:
    return entry.startswith(".") and ".tmp-" in entry  # named by atomic_write_bytes


def _build_base(entry: str) -> str:
    """The staging name an entry of ``.build/`` belongs to."""
    if _is_temp_file(entry):
        entry = entry[1 : entry.rindex(".tmp-")]
    for suffix in (OWNER_SUFFIX, WORK_SUFFIX):
        entry = entry.removesuffix(suffix)
    return entry


def stale_staging_groups(layout: InstallLayout) -> dict[str, list[Path]]:
    """The ``.build/`` entries of builds that are over, by staging name (read-only).

    A build is over when its owner record names this host and a pid that is gone (or
    reused), or another host and has not been refreshed for :data:`FOREIGN_BUILD_STALE_S`.
    Entries an interrupted sweep had claimed are not included.
    """
    try:
        entries = list(layout.build_dir.iterdir())
    except OSError:
        return {}
    groups: dict[str, list[Path]] = {}
    for entry in entries:
        if not entry.name.startswith(SWEPT_PREFIX):
            groups.setdefault(_build_base(entry.name), []).append(entry)
    return {
        base: members
        for base, members in groups.items()
        if not _build_is_live(layout.build_dir, base, members)
    }


def claim_stale_staging(layout: InstallLayout, only: set[str] | None = None) -> list[Path]:
    """Move the ``.build/`` entries of builds that are over out of the way.

    Call it under the root lock; it only renames (quick), and returns the claimed
    paths for :func:`remove_claimed` to delete after the lock is released. ``only``
    limits it to those staging names (``prune`` claims what its plan listed).
    """
    try:
        claimed = [e for e in layout.build_dir.iterdir() if e.name.startswith(SWEPT_PREFIX)]
    except OSError:
        return []
    for base, members in stale_staging_groups(layout).items():
        if only is not None and base not in only:
            continue
        # The owner record goes last, so a sweep cut short still finds the rest dead.
        for member in sorted(members, key=lambda m: m.name.endswith(OWNER_SUFFIX)):
            target = member.with_name(f"{SWEPT_PREFIX}{secrets.token_hex(4)}-{member.name}")
            with contextlib.suppress(FileNotFoundError):
                os.replace(member, target)
                claimed.append(target)
    return claimed


def remove_claimed(paths: list[Path]) -> None:
    """Delete what :func:`claim_stale_staging` claimed (outside the root lock)."""
    for path in paths:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def discard_build(result: BuildResult) -> None:
    """Drop a build's owner record, and its staging if :func:`activate` never moved it."""
    shutil.rmtree(result.staging, ignore_errors=True)
    if result.owner is not None:
        result.owner.unlink(missing_ok=True)


def activate(layout: InstallLayout, result: BuildResult) -> Path:
    """Make ``result`` the live ``envs/<name>`` by an atomic symlink swap.

    Returns the final directory. Builds older than the one being replaced are
    removed; the replaced one stays for workers that are still running from it.
    """
    layout.envs_dir.mkdir(parents=True, exist_ok=True)
    final = layout.envs_dir / f".{result.name}.{result.metadata['build_id']}"
    os.replace(result.staging, final)
    link = layout.env_dir(result.name)
    previous = Path(os.path.realpath(link)) if link.is_symlink() else None
    if link.exists() and not link.is_symlink():
        # An env from a layout without symlinks: move it aside, once.
        os.replace(link, layout.envs_dir / f".{result.name}.legacy-{int(time.time())}")
    tmp_link = layout.envs_dir / f".{result.name}.link-{secrets.token_hex(4)}"
    os.symlink(final.name, tmp_link)
    os.replace(tmp_link, link)
    result.warnings += _prune_old_builds(layout, result.name, keep={final, previous})
    return final


def _prune_old_builds(layout: InstallLayout, name: str, keep: set[Path | None]) -> list[str]:
    """Delete ``name``'s generations outside ``keep`` that no worker holds; the warnings
    (see :func:`~rootstock.install.generations.remove_old_generations`)."""
    generations: list[Path] = []
    for candidate in layout.envs_dir.glob(f".{name}.*"):
        if candidate.is_symlink():
            # A temp link of an activate() killed between symlink and replace; we
            # hold this env's lock, so no live activate() owns it.
            if candidate.name.startswith(f".{name}.link-"):
                candidate.unlink(missing_ok=True)
        elif candidate.is_dir():
            generations.append(candidate)
    return remove_old_generations(generations, keep)
