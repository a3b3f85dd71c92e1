"""``python -m gemmalab.k8s``: render the standard manifests, or one run of your own.

    python -m gemmalab.k8s render --project my-gcp-project          # rewrite k8s/*.yaml
    python -m gemmalab.k8s render --check                           # fail if k8s/ is stale
    python -m gemmalab.k8s job --accelerator v6e --topology 2x4 --name my-run \\
        -p model gemma3-270m -p batch_size 128 --queue gemmalab > my-run.yaml
    python -m gemmalab.k8s sweep --name lr-rank --queue gemmalab \\
        -y "learning_rate: [1e-4, 2e-4]" -y "lora_rank: [8, 16]" > sweep.yaml
    python -m gemmalab.k8s sweep --local --name tiny -p model gemma3-tiny -p max_steps 20 \\
        -y "learning_rate: [1e-3, 3e-3]"                        # here, one point after another

With --submit, job and sweep create the runs on the cluster of $KUBECONFIG (or the pod's service
account) instead of printing them; then:
    python -m gemmalab.k8s watch my-run       # until it ends: Succeeded or Failed, and why
    python -m gemmalab.k8s logs my-run        # the last lines of each of its pods
    python -m gemmalab.k8s delete my-run      # the run and its pods
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from urllib3.exceptions import MaxRetryError

from gemmalab.errors import ConfigError
from gemmalab.k8s import manifests, standard
from gemmalab.k8s import sweep as sweeps
from gemmalab.k8s.config import (
    DEFAULT_PROJECT,
    DEFAULT_REGION,
    DEFAULT_SERVICE_ACCOUNT,
    DEFAULT_ZONE,
    ClusterConfig,
)
from gemmalab.k8s.notebook import REPO_ROOT, load_yaml
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
    _run_arguments(job_cmd, default_name="gemma3-train")

    sweep_cmd = commands.add_parser(
        "sweep", help="print one queued Job/JobSet per point of a grid, or run them here",
        description="One training run per point: the cartesian product of the -y entries "
                    "(each NAME: [values]), or the parameter sets of --points, or each set "
                    "crossed with the grid. Every point gets its own name (NAME-INDEX-values) "
                    "and output_dir; on GKE all share --queue. Every point is validated "
                    "before anything is printed or run. More than "
                    f"{sweeps.MAX_POINTS_WITHOUT_YES} points need --yes.")
    _run_arguments(sweep_cmd, default_name="sweep")
    sweep_cmd.add_argument("-y", "--grid", action="append", default=[], metavar="YAML",
                           help='swept parameters, e.g. -y "lora_rank: [8, 16]" (repeatable)')
    sweep_cmd.add_argument("--points", metavar="FILE.yaml",
                           help="a YAML list of parameter sets, e.g. - {learning_rate: 1e-4}")
    sweep_cmd.add_argument("--yes", action="store_true",
                           help=f"allow more than {sweeps.MAX_POINTS_WITHOUT_YES} points")
    sweep_cmd.add_argument("--local", action="store_true",
                           help="run the points here, one after another (papermill), instead")
    sweep_cmd.add_argument("--output-dir", dest="output_root", default="",
                           help="--local: where the points write (default runs/NAME)")

    for name, text in (("watch", "wait until a run ends; exit 0 if it succeeded"),
                       ("logs", "the last lines of each pod of a run"),
                       ("delete", "delete a run and its pods")):
        run_cmd = commands.add_parser(name, help=text, description=text[0].upper() + text[1:])
        run_cmd.add_argument("run", help="the run's name (--name of job or sweep)")
        run_cmd.add_argument("--namespace", default="default")
        if name == "watch":
            run_cmd.add_argument("--timeout", type=float, default=3600, help="seconds")
            run_cmd.add_argument("--poll", type=float, default=10, help="seconds")
        if name == "logs":
            run_cmd.add_argument("--tail", type=int, default=50, help="lines per pod")
    return top


def _run_arguments(parser: argparse.ArgumentParser, default_name: str) -> None:
    parser.add_argument("--name", dest="job_name", default=default_name,
                        help=f"job name (default {default_name})")
    parser.add_argument("--accelerator", default="v6e", help="v5e, v5p, v6e, h100 or h200")
    parser.add_argument("--topology", default="1x1", help="TPU topology, e.g. 2x4")
    parser.add_argument("--slices", dest="num_slices", type=int, default=1,
                        help="TPU slices (multislice)")
    parser.add_argument("--chips-per-host", dest="chips_per_host", type=int)
    parser.add_argument("--gpus-per-node", dest="gpus_per_node", type=int, default=8)
    parser.add_argument("--nodes", dest="num_nodes", type=int, default=1, help="GPU nodes")
    parser.add_argument("-p", "--param", nargs=2, action="append", default=[],
                        metavar=("NAME", "VALUE"), help="notebook parameter (repeatable)")
    parser.add_argument("--queue", default="",
                        help="Kueue LocalQueue to submit to (k8s/kueue-v6e.yaml: gemmalab); "
                             "default: none, the run starts at once")
    parser.add_argument("--profiling", action="store_true", help="open the XProf port 9002")
    parser.add_argument("--max-restarts", dest="max_restarts", type=int, default=0)
    parser.add_argument("--submit", action="store_true",
                        help="create the run(s) on the cluster instead of printing them")
    _site_arguments(parser)


def _cluster_fields(args: argparse.Namespace) -> dict[str, Any]:
    """ClusterConfig fields of the job/sweep command line (the site's only where given)."""
    fields = {k: v for k, v in _site(args).items() if v is not None}
    return dict(**fields, job_name=args.job_name, accelerator=args.accelerator,
                topology=args.topology, num_slices=args.num_slices,
                chips_per_host=args.chips_per_host, gpus_per_node=args.gpus_per_node,
                num_nodes=args.num_nodes, params=_params(args), profiling=args.profiling,
                max_restarts=args.max_restarts, queue=args.queue)


def _params(args: argparse.Namespace) -> dict[str, Any]:
    return {name: load_yaml(value) for name, value in args.param}


def _header(config: ClusterConfig) -> str:
    queued = f", queue {config.queue}" if config.queue else ""
    return (f"{config.job_name}: {config.describe()}, {config.total_hosts} pod(s) x "
            f"{config.devices_per_host} device(s){queued}")


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
    config = ClusterConfig(**_cluster_fields(args))
    if args.submit:
        return _submit([config])
    sys.stdout.write(render(manifests.build(config), header=_header(config)))
    return 0


def _submit(configs: list[ClusterConfig]) -> int:
    """Create every run, or none: all are checked by the API server's dry run first."""
    from gemmalab.k8s import client

    objects = [(config, obj) for config in configs for obj in manifests.build(config)]
    for created in client.submit([obj for _, obj in objects]):
        print(f"created {created}", file=sys.stderr)
    for config in configs:
        print(f"watch: python -m gemmalab.k8s watch {config.job_name} --namespace "
              f"{config.namespace}", file=sys.stderr)
    return 0


def _watch(args: argparse.Namespace) -> int:
    from gemmalab.k8s import launch

    outcome = launch.watch(args.run, args.namespace, timeout_s=args.timeout, poll_s=args.poll,
                           on_change=lambda phases: print(
                               ", ".join(f"{pod}: {phase}" for pod, phase in phases.items())
                               or "no pods yet", file=sys.stderr, flush=True))
    print(f"{args.run}: {outcome}")
    return 0 if outcome.state == "Succeeded" else 1


def _logs(args: argparse.Namespace) -> int:
    from gemmalab.k8s import client

    logs = client.tail_logs(args.run, args.namespace, tail_lines=args.tail)
    if not logs:
        print(f"{args.run}: no pods in namespace {args.namespace}", file=sys.stderr)
        return 1
    for pod, text in logs.items():
        print(f"--- {pod}\n{text.rstrip()}")
    return 0


def _delete(args: argparse.Namespace) -> int:
    from gemmalab.k8s import client

    deleted = client.delete(args.run, args.namespace)
    print(" ".join(deleted) if deleted else f"{args.run}: nothing to delete")
    return 0


def _sweep(args: argparse.Namespace) -> int:
    values = sweeps.sweep_values(args.grid, args.points or ())
    if args.local:
        points = sweeps.local_sweep(args.job_name, _params(args), values,
                                    output_root=args.output_root, yes=args.yes)
        statuses = sweeps.run_local(points, log=lambda line: print(line, file=sys.stderr))
        failed = [name for name, status in statuses.items() if status]
        root = str(Path(points[0].output_dir).parent)
        print(f"{len(points) - len(failed)} of {len(points)} points finished; the table: "
              f"python -m gemmalab.inspect.sweep {root}", file=sys.stderr)
        return 1 if failed else 0
    configs = sweeps.cluster_sweep(_cluster_fields(args), values, yes=args.yes)
    if args.submit:
        return _submit(configs)
    for config in configs:
        sys.stdout.write(render(manifests.build(config), header=_header(config)))
    dirs = " ".join(f"gs://{c.resolved_outputs_bucket}/{c.job_name}" for c in configs)
    print(f"{len(configs)} runs: {', '.join(c.job_name for c in configs)}\n"
          f"their table, as they finish: python -m gemmalab.inspect.sweep {dirs}",
          file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return {"render": _render, "job": _job, "sweep": _sweep, "watch": _watch, "logs": _logs,
                "delete": _delete}[args.command](args)
    except ConfigError as e:
        print(f"ConfigError: {e}", file=sys.stderr)
        return 2
    except MaxRetryError as e:  # no API server answers where KUBECONFIG says
        from gemmalab.k8s import client

        print(f"ConfigError: {client.unreachable_message(e)}", file=sys.stderr)
        return 2
