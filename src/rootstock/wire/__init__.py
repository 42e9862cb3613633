"""The contract frozen into every built env: what a client and a worker say to each other.

Every env holds a copy of this package as it was when the env was built, so a worker
may be older than the client that starts it. ``framing`` (i-PI frames and the
dialect's words), ``batch`` (the ``BATCH``/``BATCHREADY`` bodies), ``lifeline`` and
``generation`` may therefore only grow: a new word, a new optional field, a new
function. Nothing here is renamed, removed or given a new meaning (docs/protocol.md).

It imports only the standard library, numpy and :mod:`rootstock.errors`, and sits
below every layer.
"""
