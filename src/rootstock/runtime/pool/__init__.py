"""The user's pool of warm workers: one daemon per worker key, shared by processes.

``directory`` is the pool's private directory, ``daemon`` the process that holds a
worker and serves clients, ``relay`` the whole frames it passes on, and ``client``
attaching to a daemon (starting one if none is up).
"""
