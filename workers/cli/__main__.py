"""`python -m workers.cli ...` is `streamer ...`."""

import sys

from workers.cli.main import main

sys.exit(main())
