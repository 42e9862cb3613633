"""The coverage dashboard: a self-hostable service that maintainers push manifests to.

An optional extra (``pip install 'rootstock[dashboard]'``): outside this package only
``rootstock dashboard`` (:mod:`rootstock.cli.dashboard_cmd`) imports it, lazily, and
it imports only the manifest schema and the error family from the rest of rootstock.

* :mod:`.models`: the SQLAlchemy tables (the schema Alembic migrates);
* :mod:`.db`: database URLs, engines and migrations;
* :mod:`.credentials`: clusters and API keys (only a hash of each secret is kept);
* :mod:`.ingest`: a pushed manifest turned into coverage rows and history;
* :mod:`.retention`: how many manifest bodies each cluster's history keeps;
* :mod:`.views`: read models shared by the JSON API and the pages;
* :mod:`.middleware`: credentials before the body, the body cap, the write slot and
  ``Server-Timing``;
* :mod:`.schemas` and :mod:`.api`: the ``/api/v1`` request models and routes;
* :mod:`.pages` (with ``templates/``): the server-rendered, autoescaped pages;
* :mod:`.app`: the ASGI application that puts them together.
"""
