"""The coverage dashboard: a self-hostable service that maintainers push manifests to.

An optional extra (``pip install 'rootstock[dashboard]'``): nothing outside this
package imports it, and it imports only the manifest schema from the rest of
rootstock (:mod:`rootstock.install.manifest`).

* :mod:`.models`: the SQLAlchemy tables (the schema Alembic migrates);
* :mod:`.db`: database URLs, engines and migrations;
* :mod:`.credentials`: clusters and API keys (only a hash of each secret is kept);
* :mod:`.ingest`: a pushed manifest turned into coverage rows and history;
* :mod:`.views`: read models shared by the JSON API and the pages;
* :mod:`.app`: the ASGI application (API, authentication, pages).
"""
