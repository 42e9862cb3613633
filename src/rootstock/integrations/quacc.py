"""quacc: its MLIP recipes already take ``"rootstock"``; nothing here to call.

quacc (``pip install 'rootstock[quacc]'``, plain ``quacc``, never ``quacc[mlip]``,
which pulls ``rootstock`` from PyPI over this package) builds the calculator itself::

    from quacc.recipes.mlip.core import static_job
    static_job(atoms, "rootstock", checkpoint="emt", device="cpu")

``quacc.recipes.mlip._base.pick_calculator`` calls ``RootstockCalculator(**calc_kwargs)``,
enters it once, and keeps it in an ``lru_cache`` keyed by those kwargs, so a process
holds one warm worker per distinct set of kwargs until
``pick_calculator.__wrapped__.cache_clear()`` drops the calculators (each then lets go
of its worker when garbage-collected) or Python exits. Its NEB runner deep-copies the
calculator once per image; a copy holds no worker and joins the same shared one.

Importing this module only checks that quacc is installed: without it, it raises
:class:`rootstock.errors.MissingExtra` naming ``pip install 'rootstock[quacc]'``.
See docs/integrations.md.
"""

from __future__ import annotations

from rootstock.parallel import require_extra

require_extra("quacc", ("quacc",))
