"""Container images without a registry: OCI archives written here, imported into the CPU node's
containerd with ``ctr images import`` (any OCI or ``docker save`` archive imports the same way).

The node's pause image (the pod sandboxes' first process) is one: registry.k8s.io cannot be
reached. The tests' image is another: Debian's static busybox alone.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import io
import json
import subprocess
import tarfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gemmalab.k8s.cluster.errors import ClusterError

NAMESPACE = "k8s.io"  # containerd's namespace for the kubelet's images
PAUSE_IMAGE = "gemmalab.local/pause:1"
BUSYBOX_IMAGE = "gemmalab.local/busybox:1"
# What the tests' image links to busybox: a shell, DNS look-ups, the usual tools.
BUSYBOX_APPLETS = ("sh", "cat", "echo", "env", "grep", "hostname", "ip", "ls", "nc",
                   "nslookup", "ping", "sleep", "ssl_client", "true", "false", "wget")
MEDIA = "application/vnd.oci.image"


@dataclasses.dataclass(frozen=True)
class File:
    """One file of an image's single layer: ``data`` at ``path``, or a symlink to ``link``."""

    path: str
    data: bytes = b""
    mode: int = 0o755
    link: str | None = None


def _layer(files: Sequence[File]) -> bytes:
    """An uncompressed tar of the files and their parent folders, byte for byte reproducible."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        folders = sorted({str(Path(f.path.lstrip("/")).parents[i])
                          for f in files for i in range(len(Path(f.path.lstrip("/")).parents) - 1)})
        for folder in folders:
            info = tarfile.TarInfo(folder)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        for f in sorted(files, key=lambda f: f.path):
            info = tarfile.TarInfo(f.path.lstrip("/"))
            info.mode = f.mode
            if f.link is not None:
                info.type, info.linkname = tarfile.SYMTYPE, f.link
                tar.addfile(info)
            else:
                info.size = len(f.data)
                tar.addfile(info, io.BytesIO(f.data))
    return out.getvalue()


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), 0o644
    tar.addfile(info, io.BytesIO(data))


def write_oci_archive(archive: Path, name: str, files: Sequence[File],
                      entrypoint: Sequence[str], cmd: Sequence[str] = ()) -> Path:
    """An OCI image layout as a tar at ``archive``: one layer of ``files``, named ``name``
    (``registry/repository:tag``) for ``ctr images import``. The same files make the same
    archive, byte for byte."""
    blobs: dict[str, bytes] = {}

    def blob(data: bytes) -> dict[str, Any]:
        digest = hashlib.sha256(data).hexdigest()
        blobs[digest] = data
        return {"digest": f"sha256:{digest}", "size": len(data)}

    layer = _layer(files)
    config = {
        "architecture": "amd64", "os": "linux",
        "config": {"Entrypoint": list(entrypoint), "Cmd": list(cmd) or None,
                   "Env": ["PATH=/bin:/usr/bin:/sbin:/usr/sbin"], "WorkingDir": "/"},
        "rootfs": {"type": "layers",
                   "diff_ids": [f"sha256:{hashlib.sha256(layer).hexdigest()}"]},
    }
    manifest = {
        "schemaVersion": 2, "mediaType": f"{MEDIA}.manifest.v1+json",
        "config": {"mediaType": f"{MEDIA}.config.v1+json",
                   **blob(json.dumps(config, sort_keys=True).encode())},
        "layers": [{"mediaType": f"{MEDIA}.layer.v1.tar+gzip",
                    **blob(gzip.compress(layer, mtime=0))}],
    }
    index = {
        "schemaVersion": 2, "mediaType": f"{MEDIA}.index.v1+json",
        "manifests": [{
            "mediaType": f"{MEDIA}.manifest.v1+json",
            **blob(json.dumps(manifest, sort_keys=True).encode()),
            "platform": {"architecture": "amd64", "os": "linux"},
            "annotations": {"io.containerd.image.name": name,
                            "org.opencontainers.image.ref.name": name.rsplit(":", 1)[-1]},
        }],
    }
    archive.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "w") as tar:
        _add(tar, "oci-layout", json.dumps({"imageLayoutVersion": "1.0.0"}).encode())
        _add(tar, "index.json", json.dumps(index, sort_keys=True).encode())
        for digest, data in sorted(blobs.items()):
            _add(tar, f"blobs/sha256/{digest}", data)
    return archive


def pause_archive(archive: Path, pause_binary: Path) -> Path:
    """The pod sandboxes' image: the static pause built from cluster/pause."""
    return write_oci_archive(archive, PAUSE_IMAGE, [File("/pause", pause_binary.read_bytes())],
                             ["/pause"])


def busybox_archive(archive: Path, busybox: Path = Path("/bin/busybox"),
                    name: str = BUSYBOX_IMAGE) -> Path:
    """A minimal image for tests: Debian's static busybox (busybox-static) and its applets."""
    if not busybox.is_file():
        raise ClusterError(f"{busybox} is missing",
                           "install Debian's busybox-static (scripts/install-node-packages)")
    files = [File("/bin/busybox", busybox.read_bytes())]
    files += [File(f"/bin/{applet}", link="busybox") for applet in BUSYBOX_APPLETS]
    return write_oci_archive(archive, name, files, ["/bin/sh"])


def archive_names(archive: Path) -> list[str]:
    """The image names an OCI or ``docker save`` archive carries."""
    with tarfile.open(archive) as tar:
        members = set(tar.getnames())
        if "index.json" in members:
            index = json.load(tar.extractfile("index.json"))
            return [m["annotations"]["io.containerd.image.name"]
                    for m in index.get("manifests", [])
                    if "io.containerd.image.name" in m.get("annotations", {})]
        if "manifest.json" in members:
            return [tag for image in json.load(tar.extractfile("manifest.json"))
                    for tag in image.get("RepoTags") or []]
    return []


def _ctr(ctr: Path, address: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(ctr), f"--address={address}", f"--namespace={NAMESPACE}", *args],
                          capture_output=True, text=True)


def import_archive(ctr: Path, address: Path, archive: Path, base_name: str | None = None
                   ) -> list[str]:
    """Import ``archive`` into containerd at ``address`` (namespace k8s.io) and unpack it for
    the kubelet; the names of the images it brought. ``base_name`` names the images of an
    archive that carries only tags (``buildah push IMAGE oci-archive:PATH``):
    ``registry/repository``."""
    if not archive.is_file():
        raise ClusterError(f"no image archive at {archive}",
                           "give the path of an OCI or docker-archive tar")
    before = set(_ctr(ctr, address, "images", "ls", "-q").stdout.split())
    extra = [f"--base-name={base_name}"] if base_name else []
    # The kubelet runs containers from the unpacked snapshots: the layer tars in the content
    # store would only double the disk an image takes (4 GB more for the cpu image); ctr
    # discards them only when it imports itself (--local), not through the transfer service.
    done = _ctr(ctr, address, "images", "import", "--local", "--discard-unpacked-layers", *extra,
                str(archive))
    if done.returncode != 0:
        raise ClusterError(f"importing {archive} failed: "
                           f"{(done.stderr.strip().splitlines() or ['?'])[-1][:300]}",
                           "check that the archive is an OCI or docker-archive tar and that "
                           "the cluster's CPU node runs (make cluster)")
    prune_superseded(ctr, address)
    after = set(_ctr(ctr, address, "images", "ls", "-q").stdout.split())
    named = {name for name in archive_names(archive) if name in after}
    # The CRI plugin adds a reference by digest to each image: not a name.
    return sorted(named | {n for n in after - before if not n.startswith("sha256:")})


def prune_superseded(ctr: Path, address: Path) -> list[str]:
    """Remove the references by digest (``sha256:...``, the CRI plugin's) to images that no name
    points at any more: after a name is imported again, the image it named before is kept alive
    by that reference alone, with its ~4 GB of snapshots. Containers still running keep their
    own snapshots. The references removed."""
    listed = _ctr(ctr, address, "images", "ls")
    lines = listed.stdout.splitlines()[1:] if listed.returncode == 0 else []
    rows = [line.split() for line in lines]
    named = {row[2] for row in rows if len(row) > 2 and not row[0].startswith("sha256:")}
    stale = [row[0] for row in rows
             if len(row) > 2 and row[0].startswith("sha256:") and row[2] not in named]
    if stale:
        _ctr(ctr, address, "images", "rm", "--sync", *stale)
    return stale


def labels(ctr: Path, address: Path, name: str) -> dict[str, str]:
    """The containerd labels of image ``name`` ({} when containerd has no such image)."""
    done = _ctr(ctr, address, "images", "ls", f"name=={name}")
    rows = done.stdout.splitlines()[1:] if done.returncode == 0 else []
    if not rows:
        return {}
    found = rows[0].split()[-1]
    return dict(part.split("=", 1) for part in found.split(",") if "=" in part)


def set_label(ctr: Path, address: Path, name: str, key: str, value: str) -> None:
    done = _ctr(ctr, address, "images", "label", name, f"{key}={value}")
    if done.returncode != 0:
        raise ClusterError(f"labelling {name} in the node's containerd failed: "
                           f"{done.stderr.strip()[:300]}", "make cluster-down && make cluster")
