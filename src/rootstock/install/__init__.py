"""The install root: layout, env files, builds, manifest, clusters and config."""
