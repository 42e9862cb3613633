"""MACE foundation models (Batatia et al.): MACE-MP-0, MACE-MPA-0 and MACE-OMAT-0.

The ``mace-torch`` wheel ships no weights: the foundation checkpoints are
downloaded from the MACE GitHub releases on first use, so run
``rootstock add <id> --no-verify`` on a node with network access first.
MACE-OMAT-0 is released under the Academic Software License; check it fits
your users before adding it.

``mace:custom`` loads a user's own ``.model`` file (a whole pickled model, as
``mace_run_train`` saves it) through :func:`setup_from_path`. That path is how
the family is proven here, offline: ``tests/mlip/test_family_mace.py`` builds a
small randomly initialised ``ScaleShiftMACE`` in this env, loads it through
``mace:custom`` and checks RootstockCalculator against the in-process model
(float64) and forces and stress against the energy. The foundation ids share
that code path (``mace_mp`` builds the same ``MACECalculator``) but their
weights are not exercised offline.

On a GPU node the env needs a CUDA build of torch (supplied at build time; the
block below stays a plain ``torch``). cuEquivariance kernels are optional: add
the ``mace-torch[cueq,cueq-cuda-12]`` extras (``cuequivariance-torch`` and
``cuequivariance-ops-torch-cu12``) in a cluster variant of this file and pass
``enable_cueq=True`` through ``setup_kwargs``.
"""

# /// script
# requires-python = ">=3.11"
# dependencies = [
#     "mace-torch>=0.3.10",
#     "torch",
#     "ase>=3.23",
#     "numpy",
# ]
# ///

# id -> the name mace.calculators.mace_mp() takes
CHECKPOINTS = {
    "mace-mp-0-small": "small",
    "mace-mp-0-medium": "medium",
    "mace-mp-0-large": "large",
    "mace-mpa-0-medium": "medium-mpa-0",
    "mace-omat-0-medium": "medium-omat-0",
    "mace:custom": None,
}


def _upstream(checkpoint):
    if checkpoint not in CHECKPOINTS or CHECKPOINTS[checkpoint] is None:
        choices = sorted(c for c, name in CHECKPOINTS.items() if name is not None)
        raise ValueError(f"unknown checkpoint {checkpoint!r}; choose one of {choices}")
    return CHECKPOINTS[checkpoint]


def download(checkpoint, **kw):
    """Fetch the weights into the cache without building a model; return their path."""
    from mace.calculators.foundations_models import download_mace_mp_checkpoint

    return download_mace_mp_checkpoint(_upstream(checkpoint))


def setup(checkpoint, device="cuda", default_dtype="float64", **kw):
    """Return a MACECalculator for a foundation checkpoint.

    ``default_dtype`` defaults to float64, which MACE recommends for geometry
    optimisation and phonons; pass ``float32`` for faster molecular dynamics.
    """
    from mace.calculators import mace_mp

    return mace_mp(model=_upstream(checkpoint), device=device, default_dtype=default_dtype, **kw)


def setup_from_path(path, device="cuda", default_dtype="float64", **kw):
    """Return a MACECalculator for a user's own ``.model`` file (e.g. a fine-tune).

    ``default_dtype`` defaults to float64, as for :func:`setup`; a float32 model is
    converted to it.
    """
    from mace.calculators import MACECalculator

    # A one-item list, not a str: MACECalculator globs a str, so a name holding "[" or
    # "*" would load some other file, or none.
    paths = [str(path)]
    return MACECalculator(model_paths=paths, device=device, default_dtype=default_dtype, **kw)
