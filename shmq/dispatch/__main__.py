"""``python -m shmq.dispatch``: scale, status, stop a running dispatcher."""

import sys

from .control import main

sys.exit(main())
