"""``python -m gemmalab.k8s``: render the standard manifests, or one run of your own.

    python -m gemmalab.k8s render --project my-gcp-project          # rewrite k8s/*.yaml
    python -m gemmalab.k8s render --check                           # fail if k8s/ is stale
    python -m gemmalab.k8s job --accelerator v6e --topology 2x4 --name my-run \\
        -p model gemma3-270m -p batch_size 128 > my-run.yaml
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from gemmalab.errors import ConfigError
from gemmalab.k8s import manifests, standard
from gemmalab.k8s.config import (
    DEFAULT_PROJECT,
    DEFAULT_REGION,
    DEFAULT_SERVICE_ACCOUNT,
    DEFAULT_ZONE,
    ClusterConfig,
)
from gemmalab.k8s.notebook import REPO_ROOT
from gemmalab.k8s.render import render


def _site_arguments(parser: argparse.ArgumentParser) -> None:
    site = parser.add_argument_group("your project (defaults: the placeholders of k8s/README.md)")
    site.add_argument("--project", help=f"Google Cloud project id (default {DEFAULT_PROJECT})")
    site.add_argument("--region", help=f"region of the cluster and buckets ({DEFAULT_REGION})")
    site.add_argument("--zone", help=f"zone of the accelerator node pools ({DEFAULT_ZONE})")
    site.add_argument("--namespace", help="Kubernetes namespace (default)")
    site.add_argument("--service-account", dest="service_account",
                      help=f"Kubernetes = Google service account name ({DEFAULT_SERVICE_ACCOUNT})")
    site.add_argument("--data-bucket", dest="data_bucket",
                      help="bucket mounted read-only at /data (PROJECT-gemmalab-data)")
    site.add_argument("--outputs-bucket", dest="outputs_bucket",
                      help="bucket mounted read-write at /outputs (PROJECT-gemmalab-outputs)")
    site.add_argument("--image", help="TPU image (REGION-docker.pkg.dev/PROJECT/gemmalab/"
                      "gemmalab-tpu:VERSION)")


def _site(args: argparse.Namespace) -> dict[str, Any]:
    return {k: getattr(args, k) for k in standard.SITE_FIELDS}


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="python -m gemmalab.k8s", description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = top.add_subparsers(dest="command", required=True)

    names = ", ".join(c.filename for c in standard.CASES)
    render_cmd = commands.add_parser(
        "render", help="write the standard manifests (k8s/*.yaml)",
        description=f"Write the standard cases ({names}) into --out-dir.")
    render_cmd.add_argument("cases", nargs="*", metavar="CASE",
                            help="only these files (default: all)")
    render_cmd.add_argument("--out-dir", type=Path, default=REPO_ROOT / "k8s",
                            help="where to write (default: the repository's k8s/)")
    render_cmd.add_argument("--stdout", action="store_true", help="print instead of writing")
    render_cmd.add_argument("--check", action="store_true",
                            help="write nothing; exit 1 if a file differs from a fresh render")
    render_cmd.add_argument("--gpu-image", dest="gpu_image",
                            help="image of the GPU case (…/gemmalab-gpu:VERSION)")
    _site_arguments(render_cmd)

    job_cmd = commands.add_parser(
        "job", help="print the Job/JobSet of one run",
        description="Print the manifest of one training run (a Job on one host, a JobSet on "
                    "several). Parameter values are YAML: 128 is a number, '128' a string.")
    job_cmd.add_argument("--name", dest="job_name", default="gemma3-train", help="job name")
    job_cmd.add_argument("--accelerator", default="v6e", help="v5e, v5p, v6e, h100 or h200")
    job_cmd.add_argument("--topology", default="1x1", help="TPU topology, e.g. 2x4")
    job_cmd.add_argument("--slices", dest="num_slices", type=int, default=1,
                         help="TPU slices (multislice)")
    job_cmd.add_argument("--chips-per-host", dest="chips_per_host", type=int)
    job_cmd.add_argument("--gpus-per-node", dest="gpus_per_node", type=int, default=8)
    job_cmd.add_argument("--nodes", dest="num_nodes", type=int, default=1, help="GPU nodes")
    job_cmd.add_argument("-p", "--param", nargs=2, action="append", default=[],
                         metavar=("NAME", "VALUE"), help="notebook parameter (repeatable)")
    job_cmd.add_argument("--profiling", action="store_true", help="open the XProf port 9002")
    job_cmd.add_argument("--max-restarts", dest="max_restarts", type=int, default=0)
    _site_arguments(job_cmd)
    return top


def _render(args: argparse.Namespace) -> int:
    site = {**_site(args), "gpu_image": args.gpu_image}
    try:
        cases = [standard.find_case(name) for name in args.cases] or list(standard.CASES)
    except KeyError as e:
        print(f"unknown case {e.args[0]!r}; use one of "
              f"{', '.join(c.filename for c in standard.CASES)}", file=sys.stderr)
        return 2
    stale = []
    for case in cases:
        text = standard.render_case(case, **site)
        path = args.out_dir / case.filename
        if args.stdout:
            sys.stdout.write(text)
        elif args.check:
            if not path.is_file() or path.read_text(encoding="utf-8") != text:
                stale.append(str(path))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path}", file=sys.stderr)
    if stale:
        print("out of date (run `python -m gemmalab.k8s render`): " + ", ".join(stale),
              file=sys.stderr)
        return 1
    return 0


def _job(args: argparse.Namespace) -> int:
    params = {name: yaml.safe_load(value) for name, value in args.param}
    fields = {k: v for k, v in _site(args).items() if v is not None}
    config = ClusterConfig(
        **fields, job_name=args.job_name, accelerator=args.accelerator, topology=args.topology,
        num_slices=args.num_slices, chips_per_host=args.chips_per_host,
        gpus_per_node=args.gpus_per_node, num_nodes=args.num_nodes, params=params,
        profiling=args.profiling, max_restarts=args.max_restarts)
    sys.stdout.write(render(manifests.build(config),
                            header=f"{config.job_name}: {config.describe()}, "
                                   f"{config.total_hosts} pod(s) x {config.devices_per_host} "
                                   "device(s)"))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return _render(args) if args.command == "render" else _job(args)
    except ConfigError as e:
        print(f"ConfigError: {e}", file=sys.stderr)
        return 2
