"""``python -m compactor_service``: run the compactor sidecar (see ``server``)."""

import sys

from compactor_service.server import main

sys.exit(main())
