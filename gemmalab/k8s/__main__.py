"""``python -m gemmalab.k8s``: see gemmalab/k8s/cli.py."""

import sys

from gemmalab.k8s.cli import main

sys.exit(main())
