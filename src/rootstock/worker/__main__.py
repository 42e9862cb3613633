"""Entry point: ``python -m rootstock.worker --env-source F --checkpoint ID --socket P``."""

from rootstock.worker.main import main

raise SystemExit(main())
