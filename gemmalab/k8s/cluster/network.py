"""The CPU node's network: a bridge of the cluster's own, its nftables table, the CNI config.

The pods' addresses live only in their network namespaces and on the bridge ``gemmalab0``
(``10.245.0.0/24``; kwok's fake pods take ``10.244.0.0/16``). The bridge's address
``10.245.0.1`` is the node's: the kubelet and CoreDNS listen there, nothing listens on another
host interface. The pods get no default route, only their subnet and the service range through
the bridge, and the CNI bridge plugin is no gateway (which would turn on the host's
``ip_forward``) and masquerades nothing. One nftables table (``ip gemmalab``) holds every rule:

- the ``kubernetes`` Service's address 10.96.0.1:443 is the API server on 127.0.0.1 (DNAT; the
  bridge's ``route_localnet`` lets a packet from a pod reach loopback, and only such a one);
- nothing is forwarded to or from the bridge but pod to pod;
- this machine never sends to kwok's fake pod addresses nor to a service address (nothing
  would answer there; without the rule they would leave by the default route).

Deleting the bridge and the table (``teardown``) leaves the host as it was.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

from gemmalab.k8s.cluster.errors import ClusterError

BRIDGE = "gemmalab0"
POD_SUBNET = ipaddress.ip_network("10.245.0.0/24")
NODE_IP = "10.245.0.1"  # the bridge's address: the kubelet's and CoreDNS's
FIRST_POD_IP = "10.245.0.10"
KWOK_POD_CIDR = "10.244.0.0/16"  # kwok's fake pod addresses (never dialled)
SERVICE_CIDR = "10.96.0.0/16"  # the API server's --service-cluster-ip-range
API_SERVICE_IP = "10.96.0.1"  # the `kubernetes` Service (pki.SERVING_IPS names it)
NFT_TABLE = "gemmalab"
CNI_NETWORK = "gemmalab"
# libcni keeps each attachment's result here (containerd gives it no other folder); the CNI
# DEL of a pod removes its file, teardown() what a killed node left.
CNI_CACHE = Path("/var/lib/cni")
INSTALL_FIX = "run scripts/install-node-packages (or make cluster, which runs it)"


def find_tool(name: str) -> Path | None:
    """A program on PATH or in the system's folders (a caller's PATH may lack sbin)."""
    if found := shutil.which(name):
        return Path(found)
    for folder in ("/usr/sbin", "/usr/bin", "/sbin", "/bin"):
        if (path := Path(folder) / name).is_file():
            return path
    return None


def _tool(name: str) -> str:
    if (found := find_tool(name)) is None:
        raise ClusterError(f"the CPU node needs `{name}`, which is not installed", INSTALL_FIX)
    return str(found)


def _run(*argv: str, stdin: str | None = None) -> str:
    done = subprocess.run([_tool(argv[0]), *argv[1:]], input=stdin, capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise ClusterError(f"`{' '.join(argv)}` failed: "
                           f"{(done.stderr.strip() or done.stdout.strip())[:300]}",
                           "the CPU node needs root (CAP_NET_ADMIN); or run with "
                           "CLUSTER_CPU_NODE=0")
    return done.stdout


def _links(*selector: str) -> list[dict[str, Any]]:
    return json.loads(_run("ip", "-j", "link", "show", *selector) or "[]")


def bridge_owner() -> str | None:
    """The cluster folder that made the bridge (its alias), or None without a bridge."""
    try:
        return Path(f"/sys/class/net/{BRIDGE}/ifalias").read_text().strip()
    except OSError:
        return None


def check_free(owner: str) -> None:
    """Refuse before anything starts when the pods' subnet is routed elsewhere on this host."""
    for route in json.loads(_run("ip", "-j", "-4", "route", "show") or "[]"):
        dst = route.get("dst", "default")
        if dst == "default" or route.get("dev") == BRIDGE:
            continue
        if ipaddress.ip_network(dst, strict=False).overlaps(POD_SUBNET):
            raise ClusterError(
                f"the CPU node's pod subnet {POD_SUBNET} overlaps {dst} (dev "
                f"{route.get('dev')}) on this machine",
                "free that range, or run without the CPU node: CLUSTER_CPU_NODE=0")


def _sysctl(path: str, value: str) -> None:
    Path("/proc/sys", path).write_text(value)


def ruleset(api_port: int) -> str:
    """The node's nftables table (see the module's docstring)."""
    return f"""
table ip {NFT_TABLE} {{
  chain services {{
    type nat hook prerouting priority dstnat; policy accept;
    iifname "{BRIDGE}" ip daddr {API_SERVICE_IP} tcp dport 443 dnat to 127.0.0.1:{api_port}
  }}
  chain input {{
    type filter hook input priority filter; policy accept;
    iifname "{BRIDGE}" ip daddr 127.0.0.0/8 ct status dnat accept
    iifname "{BRIDGE}" ip daddr 127.0.0.0/8 drop
  }}
  chain forward {{
    type filter hook forward priority filter; policy accept;
    iifname "{BRIDGE}" oifname "{BRIDGE}" accept
    iifname "{BRIDGE}" drop
    oifname "{BRIDGE}" drop
  }}
  chain output {{
    type filter hook output priority filter; policy accept;
    ip daddr {{ {KWOK_POD_CIDR}, {SERVICE_CIDR} }} reject
  }}
}}
"""


def setup(owner: str, api_port: int) -> None:
    """The bridge with the node's address, and the table; ``owner`` is the cluster's folder."""
    if bridge_owner() is None:
        _run("ip", "link", "add", BRIDGE, "type", "bridge")
    _run("ip", "link", "set", BRIDGE, "alias", owner)
    _sysctl(f"net/ipv6/conf/{BRIDGE}/disable_ipv6", "1")
    _sysctl(f"net/ipv4/conf/{BRIDGE}/route_localnet", "1")  # gone with the bridge
    _run("ip", "addr", "replace", f"{NODE_IP}/{POD_SUBNET.prefixlen}", "dev", BRIDGE)
    _run("ip", "link", "set", BRIDGE, "up")
    # `add` first: the delete never fails, and the table is replaced in one transaction.
    _run("nft", "-f", "-", stdin=f"add table ip {NFT_TABLE}\ndelete table ip {NFT_TABLE}\n"
                               + ruleset(api_port))


def teardown() -> list[str]:
    """Remove the bridge (and any port a killed pod left on it), the table and the CNI cache
    entries of this network; what was removed, for the log."""
    removed = []
    if bridge_owner() is not None:
        for port in _links("master", BRIDGE):
            with contextlib.suppress(ClusterError):  # gone with its namespace meanwhile
                _run("ip", "link", "del", port["ifname"])
        _run("ip", "link", "del", BRIDGE)
        removed.append(f"bridge {BRIDGE}")
    if find_tool("nft") is not None:
        tables = _run("nft", "list", "tables")
        if f"table ip {NFT_TABLE}" in tables.splitlines():
            _run("nft", "delete", "table", "ip", NFT_TABLE)
            removed.append(f"nftables table ip {NFT_TABLE}")
    results = CNI_CACHE / "results"
    for entry in results.glob(f"{CNI_NETWORK}-*-eth0"):
        # containerd's loopback attachment of the same sandbox ("cni-loopback-<id>-lo") too
        sandbox = entry.name[len(CNI_NETWORK) + 1:-len("-eth0")]
        (results / f"cni-loopback-{sandbox}-lo").unlink(missing_ok=True)
        entry.unlink()
    for folder in (results, CNI_CACHE):  # only if nothing else keeps anything there
        with contextlib.suppress(OSError):
            folder.rmdir()
    return removed


def cni_config(ipam_dir: Path) -> dict[str, Any]:
    """The bridge plugin with host-local addresses (containerd adds the loopback plugin)."""
    return {
        "cniVersion": "1.0.0", "name": CNI_NETWORK,
        "plugins": [{
            "type": "bridge", "bridge": BRIDGE,
            "isGateway": False, "isDefaultGateway": False, "ipMasq": False,
            "ipam": {
                "type": "host-local", "dataDir": str(ipam_dir),
                "ranges": [[{"subnet": str(POD_SUBNET), "rangeStart": FIRST_POD_IP,
                             "gateway": NODE_IP}]],
                # Only the services through the bridge: no default route out of a pod.
                "routes": [{"dst": SERVICE_CIDR}],
            },
        }],
    }
