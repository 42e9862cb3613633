"""The install root: layout, env files, builds, manifest, clusters and config."""

from collections.abc import Callable

#: A progress callback: operations call it with one short line per step.
Reporter = Callable[[str], None]
