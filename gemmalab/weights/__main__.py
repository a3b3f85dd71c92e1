"""``python -m gemmalab.weights``: export a finished run (``gemmalab.weights.export``)."""

import sys

from gemmalab.weights.export import main

sys.exit(main())
