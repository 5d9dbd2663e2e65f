"""``python -m kvstore.bench``."""

import sys

from . import main

sys.exit(main())
