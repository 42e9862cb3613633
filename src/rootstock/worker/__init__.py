"""The worker: runs *inside* a built model env as ``python -m rootstock.worker``.

It imports only the standard library, numpy, ase and ``rootstock.wire.framing``
(plus whatever the env's ``setup()`` imports), because this code is frozen into
every env at build time and must stay small and forward-compatible.
"""
