"""``python -m kvfleet`` is ``kvfleet``."""

from kvfleet.cli import main

raise SystemExit(main())
