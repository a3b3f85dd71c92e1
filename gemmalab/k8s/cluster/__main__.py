"""``python -m gemmalab.k8s.cluster {build,up,down,status,image,load-image}`` (``make cluster``,
``make cluster-down``).

    build    only build the programs (once per machine; `make test` does it before the tests)
    up       build what is missing (once per machine), start the stack or reuse the running one,
             and print the `export KUBECONFIG=...` line
    down     stop it, take away what its CPU node made on this machine (containers, mounts,
             cgroups, the bridge gemmalab0, its nftables table), and forget its objects and the
             node's images (the built programs stay cached)
    status   which components run, and the KUBECONFIG line
    image    build the Dockerfile's image (--target cpu|tpu|gpu) with buildah on a local stand-in
             for python:3.12-slim-bookworm (once per machine), no registry needed; print its
             name. --run: then run its command (or the ARGS after --) with runc as its user
    load-image ARCHIVE [--base-name REGISTRY/REPOSITORY]
             import an OCI or docker-archive tar into the CPU node's containerd (no registry);
             print the names of its images

Ports: 127.0.0.1, from $CLUSTER_PORT (16400) up; the CPU node's kubelet and CoreDNS on its
bridge's 10.245.0.1. Cache: $GEMMALAB_CLUSTER_HOME (~/.cache/gemmalab/cluster).
CLUSTER_CPU_NODE=0: no CPU node (without root there is none).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from gemmalab.k8s.cluster import build, image, node, stack
from gemmalab.k8s.cluster.errors import ClusterError


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gemmalab.k8s.cluster", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command",
                        choices=("build", "up", "down", "status", "image", "load-image"))
    parser.add_argument("--target", choices=image.TARGETS, default="cpu",
                        help="image: the Dockerfile's target (default cpu)")
    parser.add_argument("--tag", help="image: its name (default localhost/gemmalab-TARGET:VERSION)")
    parser.add_argument("--run", action="store_true",
                        help="image: run it after building (its command, or ARGS)")
    parser.add_argument("--base-name", help="load-image: REGISTRY/REPOSITORY for an archive "
                        "whose images carry only a tag")
    parser.add_argument("args", nargs="*", metavar="ARGS",
                        help="image --run: the arguments after the image's entry point; "
                        "load-image: the archive")
    argv = list(sys.argv[1:] if argv is None else argv)
    # `image --run -- COMMAND ...`: what follows `--` is the command to run, options included
    # (argparse would have taken ARGS as empty at the first positional).
    split = argv.index("--") if "--" in argv else len(argv)
    argv, command = argv[:split], argv[split + 1:]
    args = parser.parse_args(argv)
    args.args += command
    if args.command != "image" and (args.run or args.tag or args.target != "cpu"
                                    or (args.args and args.command != "load-image")):
        parser.error("--target, --tag, --run and ARGS go with the image command")
    if ((args.command == "load-image" and len(args.args) != 1)
            or (args.command != "load-image" and args.base_name is not None)):
        parser.error("load-image takes one archive (and --base-name only goes with it)")
    if args.command == "image":
        return _image(args.target, args.tag, args.run, args.args)
    try:
        layout = stack.Layout.default()
        if args.command == "build":
            build.build_all(log=_say, node=node.disabled_reason(layout) is None)
            return 0
        if args.command == "load-image":
            for name in node.load_image(Path(args.args[0]).resolve(), layout, args.base_name):
                print(name)
            return 0
        if args.command == "up":
            stack.up(layout, log=_say)
            _load_cpu_image(layout)
        elif args.command == "down":
            stopped = stack.down(layout, log=_say)
            _say(f"stopped {', '.join(stopped)}" if stopped else "no cluster was running")
            return 0
        else:
            running = stack.running_components(layout)
            missing = [name for name in stack.expected_components(layout)
                       if name not in running]
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


def _load_cpu_image(layout: stack.Layout) -> None:
    """The cpu image, when this machine built it (make image-cpu), into the CPU node: the name
    the CPU profile's manifests use. Already there (the node keeps its images): nothing to do."""
    if "kubelet" not in stack.running_components(layout) or shutil.which("buildah") is None:
        return
    name = image.image_name("cpu")
    if image.built(name):
        image.load_into_node(name, layout, log=_say)
        _say(f"the CPU node holds {name}")
    else:
        _say(f"no {name} built here: `make image-cpu`, then `make cluster` again, loads it")


def _image(target: str, tag: str | None, run: bool, run_args: list[str]) -> int:
    try:
        name = image.build_image(target, tag, log=_say)
        print(name, flush=True)
        if run:
            return image.run(name, run_args or None).returncode
    except ClusterError as e:
        _say(f"make image: {e}")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
