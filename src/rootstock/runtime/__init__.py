"""The client side of a worker: protocol, socket server, spawn, session, calculator.

Nothing is imported here on purpose: the worker imports ``runtime.protocol`` inside
every model env and must not pull in the calculator (or ase) as a side effect.
"""
