"""``python -m gemmalab.k8s.cluster {up,down,status}`` (``make cluster``, ``make cluster-down``).

    build    only build the programs (once per machine; `make test` does it before the tests)
    up       build what is missing (once per machine), start the stack or reuse the running one,
             and print the `export KUBECONFIG=...` line
    down     stop it and forget its objects (the built programs stay cached)
    status   which components run, and the KUBECONFIG line

Ports: 127.0.0.1, from $CLUSTER_PORT (16400) up. Cache: $GEMMALAB_CLUSTER_HOME
(~/.cache/gemmalab/cluster).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from gemmalab.k8s.cluster import build, stack
from gemmalab.k8s.cluster.errors import ClusterError


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gemmalab.k8s.cluster", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("build", "up", "down", "status"))
    args = parser.parse_args(argv)
    try:
        layout = stack.Layout.default()
        if args.command == "build":
            build.build_all(log=_say)
            return 0
        if args.command == "up":
            stack.up(layout, log=_say)
        elif args.command == "down":
            stopped = stack.down(layout)
            _say(f"stopped {', '.join(stopped)}" if stopped else "no cluster was running")
            return 0
        else:
            running = stack.running_components(layout)
            missing = [name for name in stack.COMPONENTS if name not in running]
            if not running:
                _say("no cluster is running: make cluster")
                return 1
            _say(f"running: {', '.join(running)}"
                 + (f"; not running: {', '.join(missing)} (make cluster restarts them)"
                    if missing else ""))
    except ClusterError as e:
        _say(f"make cluster: {e}")
        return 2
    print(f"export KUBECONFIG={layout.kubeconfig}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
