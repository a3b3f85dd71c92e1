"""The Dockerfile's images built on this machine with buildah, with no registry's base image.

The Dockerfile's base, ``python:3.12-slim-bookworm`` (its ``PYTHON_IMAGE``), cannot be pulled
where no container registry is reachable, so a stand-in is made once per machine from what is
reachable, in the official image's two steps:

* Debian bookworm, ``debootstrap --variant=minbase`` from Debian's mirror, slimmed as Docker's
  ``debian:bookworm-slim`` is (no docs but copyrights, no man pages, info or locales; its apt
  and dpkg settings), then brought up to date from bookworm-updates and bookworm-security.
  Added: what the official image's Dockerfile installs (ca-certificates, netbase, tzdata) and
  the shared libraries its CPython links (libssl3, libsqlite3-0, libffi8, ...).
* CPython 3.12 under ``/usr/local``: this machine's own build (pyenv's: ``--enable-shared``,
  bookworm's GCC 12 against bookworm's libraries, as the official build is), relocated: its
  rpath set to ``$ORIGIN/../lib`` (the official build links that), its prefix rewritten in
  sysconfig, pkg-config and scripts, stripped, without tests, ``.pyc`` files, the static
  library or anything installed into its site-packages; pip from its own ``ensurepip``, and the
  official image's symlinks (python, pip, pydoc, idle, python-config), PATH, LANG and CMD.

Differences from the official image: the CPython patch release (this machine's, e.g. 3.12.1,
not the newest 3.12) and so the pip its ensurepip bundles (23.2.1); the modules the local build
lacks (pyenv's 3.12.1 here: ``_dbm``, ``_gdbm``); its build options (pyenv's: no PGO or LTO, so
a slower interpreter than the official ``--enable-optimizations --with-lto``); one layer, not
Debian's and Python's; no GPG_KEY or PYTHON_SHA256 variables. ``tkinter`` is there without Tk,
as in the official image.

The base is named by a hash of all its inputs (the recipe here and every file taken from the
interpreter), ``localhost/gemmalab-python:3.12-slim-bookworm-<key>``; the Debian root file system
(debootstrap, the slow part) is cached as a tar under ``$GEMMALAB_CLUSTER_HOME/image``. Then
``buildah bud --layers --target cpu|tpu|gpu --build-arg PYTHON_IMAGE=<base>`` builds the
Dockerfile as on GKE. The build host's CA bundle is bind-mounted into its RUN steps (a builder
behind a TLS-inspecting proxy reaches PyPI through it), never copied into a layer, and proxy
variables pass through buildah's own ``--http-proxy`` default, never into the image either.
``run`` starts an image's command with Debian's runc on buildah's mount of it, as its user.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

from gemmalab.k8s.cluster import node
from gemmalab.k8s.cluster.build import REPO_ROOT, cluster_home
from gemmalab.k8s.cluster.errors import ClusterError
from gemmalab.k8s.cluster.layout import Layout

TARGETS = ("cpu", "tpu", "gpu")
# Part of the base's key: bump it when what is done to the files below changes (_slim, _relocate).
BASE_RECIPE = 1
SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"
BASE_REPOSITORY = "localhost/gemmalab-python"
# What the official image's Dockerfile installs, and the run-time libraries of its CPython (its
# build keeps, by `ldd`, those the interpreter and its extension modules link).
PACKAGES = ("ca-certificates", "netbase", "tzdata", "libbz2-1.0", "libexpat1", "libffi8",
            "liblzma5", "libncursesw6", "libreadline8", "libsqlite3-0", "libssl3", "libtirpc3",
            "libuuid1", "zlib1g", "libnsl2")
# debian:bookworm-slim's dpkg excludes (debuerreotype's slimify) and Docker's apt settings.
SLIM_EXCLUDES = ("/usr/share/doc/*", "/usr/share/groff/*", "/usr/share/info/*",
                 "/usr/share/linda/*", "/usr/share/lintian/overrides/*", "/usr/share/locale/*",
                 "/usr/share/man/*")
ROOTFS_FILES = {
    "etc/dpkg/dpkg.cfg.d/docker": "".join(f"path-exclude {p}\n" for p in SLIM_EXCLUDES)
    + "path-include /usr/share/doc/*/copyright\n",
    "etc/dpkg/dpkg.cfg.d/docker-apt-speedup": "force-unsafe-io\n",
    "etc/apt/apt.conf.d/docker-clean": (
        'DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb '
        '/var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };\n'
        'APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb '
        '/var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };\n'
        'Dir::Cache::pkgcache "";\nDir::Cache::srcpkgcache "";\n'),
    "etc/apt/apt.conf.d/docker-autoremove-suggests":
        'Apt::AutoRemove::SuggestsImportant "false";\n',
    "etc/apt/apt.conf.d/docker-gzip-indexes": 'Acquire::GzipIndexes "true";\n',
    "etc/apt/apt.conf.d/docker-no-languages": 'Acquire::Languages "none";\n',
    "etc/apt/sources.list.d/debian.sources": (
        f"Types: deb\nURIs: {MIRROR}\nSuites: {SUITE} {SUITE}-updates\nComponents: main\n"
        "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n\n"
        f"Types: deb\nURIs: {MIRROR}-security\nSuites: {SUITE}-security\nComponents: main\n"
        "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n"),
    "usr/sbin/policy-rc.d": "#!/bin/sh\nexit 101\n",
}
# The rest of the official image's Dockerfile, on the two tars made here. The RUN steps end
# with its checks: no missing library but tkinter's, and the modules the project needs import
# as the image's non-root user (uid 1000), not only as root.
CONTAINERFILE = """\
FROM scratch
ADD rootfs.tar /
RUN apt-get update && apt-get upgrade -y && rm -rf /var/lib/apt/lists/*
ENV PATH=/usr/local/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \\
    LANG=C.UTF-8 \\
    PYTHON_VERSION={python_version}
ADD python.tar /usr/local/
RUN set -eux; ldconfig; python3.12 -m ensurepip; \\
    for src in idle3 pip3 pydoc3 python3 python3-config; do \\
        dst="$(echo "$src" | tr -d 3)"; \\
        [ -s "/usr/local/bin/$src" ]; [ ! -e "/usr/local/bin/$dst" ]; \\
        ln -svT "$src" "/usr/local/bin/$dst"; \\
    done; \\
    find /usr/local -depth -type d -name __pycache__ -exec rm -rf '{{}}' +; \\
    if find /usr/local -type f -executable -not -name '*tkinter*' -exec ldd '{{}}' ';' 2>&1 \\
        | grep 'not found'; then exit 1; fi; \\
    setpriv --reuid 1000 --regid 1000 --clear-groups /usr/local/bin/python -c \\
        'import ssl, sqlite3, ctypes, lzma, bz2, zlib, readline, uuid, decimal, hashlib, venv'; \\
    python3 --version; pip3 --version
LABEL dev.gemmalab.python-image="python:3.12-slim-bookworm, stand-in {key} \\
(gemmalab/k8s/cluster/image.py)"
CMD ["python3"]
"""


def image_home() -> Path:
    return cluster_home() / "image"


def buildah_command() -> str:
    """The ``buildah`` on PATH, run by root (its RUN steps chroot); else one line with the fix."""
    buildah = shutil.which("buildah")
    if buildah is None:
        raise ClusterError("no image builder: `buildah` is not on PATH",
                           "apt-get install -y buildah (Debian's 1.28 builds the Dockerfile)")
    if os.geteuid() != 0:
        raise ClusterError("buildah runs the Dockerfile's RUN steps in a chroot, which needs root",
                           "run as root (sudo -E make image)")
    return buildah


def _tool(name: str, package: str) -> str:
    found = shutil.which(name)
    if found is None:
        raise ClusterError(f"`{name}` is not on PATH", f"apt-get install -y {package}")
    return found


def source_python() -> Path:
    """The prefix of the CPython 3.12 copied into the base: ``$GEMMALAB_BASE_PYTHON`` (a prefix)
    or the one this process runs on (the project venv's base interpreter)."""
    prefix = Path(os.environ.get("GEMMALAB_BASE_PYTHON") or sys.base_prefix)
    fix = ("set GEMMALAB_BASE_PYTHON to the prefix of a CPython 3.12 built with --enable-shared "
           "on Debian bookworm (pyenv install 3.12 builds one: `pyenv prefix 3.12.1`)")
    if not (prefix / "bin" / "python3.12").is_file():
        raise ClusterError(f"{prefix} holds no bin/python3.12", fix)
    if not (prefix / "lib" / "libpython3.12.so.1.0").is_file():
        raise ClusterError(f"{prefix}/bin/python3.12 is not a shared-library build "
                           "(no lib/libpython3.12.so.1.0), as the official image's is", fix)
    return prefix


def _python_version(prefix: Path) -> str:
    header = (prefix / "include" / "python3.12" / "patchlevel.h").read_text()
    return re.search(r'#define PY_VERSION\s+"([^"]+)"', header)[1]


def _excluded(relative: Path) -> bool:
    """What the official image leaves out of /usr/local (tests, bytecode, the static library),
    and all that was installed into site-packages (pip comes anew from ensurepip)."""
    parts = relative.parts
    if any(p in ("test", "tests", "idle_test", "__pycache__") for p in parts[:-1]):
        return True
    name = parts[-1]
    if name in ("test", "tests", "idle_test", "__pycache__") or name.endswith((".pyc", ".pyo")):
        return True
    if name.startswith("libpython") and name.endswith(".a"):
        return True
    if parts[:3] == ("lib", "python3.12", "site-packages") and len(parts) > 3:
        return name != "README.txt" or len(parts) > 4
    # pip's scripts, and pyenv's unversioned symlinks (the official image makes its own).
    return parts[0] == "bin" and (name.startswith("pip")
                                  or name in ("python", "idle", "pydoc", "python-config"))


def _python_files(prefix: Path) -> list[Path]:
    """The interpreter's files (and symlinks) that go into the base, relative to its prefix."""
    files = []
    for root, dirs, names in os.walk(prefix):
        here = Path(root).relative_to(prefix)
        links = [d for d in dirs if (prefix / here / d).is_symlink()]
        dirs[:] = [d for d in dirs if d not in links and not _excluded(here / d)]
        files += [here / n for n in [*names, *links] if not _excluded(here / n)]
    return sorted(files)


def _rootfs_key() -> str:
    recipe = json.dumps([BASE_RECIPE, SUITE, MIRROR, PACKAGES, ROOTFS_FILES], sort_keys=True)
    return hashlib.sha256(recipe.encode()).hexdigest()[:12]


def base_key(prefix: Path) -> str:
    """A hash of everything the base is made of: the recipe and each file of the interpreter."""
    digest = hashlib.sha256(json.dumps([BASE_RECIPE, _rootfs_key(), CONTAINERFILE]).encode())
    for relative in _python_files(prefix):
        path = prefix / relative
        digest.update(f"{relative}\0{path.lstat().st_mode:o}\0".encode())
        digest.update(os.readlink(path).encode() if path.is_symlink() else path.read_bytes())
    return digest.hexdigest()[:12]


def base_name(prefix: Path | None = None) -> str:
    return f"{BASE_REPOSITORY}:3.12-slim-{SUITE}-{base_key(prefix or source_python())}"


def _run_logged(command: Sequence[str], log_file: Path, what: str, fix: str,
                **kwargs) -> None:
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "a") as out:
        out.write(f"$ {' '.join(command)}\n")
        out.flush()
        done = subprocess.run(list(command), stdout=out, stderr=subprocess.STDOUT, **kwargs)
    if done.returncode != 0:
        raise ClusterError(f"{what} failed (exit {done.returncode}): "
                           f"{_last_line(log_file.read_text(errors='replace'))}",
                           f"read {log_file}; {fix}")


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if re.search(r"error|fail|not found|denied", line, re.I)]
    return (errors or lines or ["no output"])[-1][:300]


def _mounts_under(path: Path) -> list[str]:
    prefix = str(path.resolve()) + "/"
    with open("/proc/self/mounts") as mounts:
        points = [line.split()[1].replace("\\040", " ") for line in mounts]
    return [p for p in points if p.startswith(prefix)]


def _remove_tree(path: Path) -> None:
    """Remove a debootstrap target, never through a file system still mounted in it (its /proc
    when debootstrap was interrupted)."""
    for point in sorted(_mounts_under(path), reverse=True):
        subprocess.run(["umount", "--lazy", point], check=False)
    if _mounts_under(path):
        raise ClusterError(f"{path} still has file systems mounted in it",
                           f"umount them (grep {path} /proc/self/mounts), then retry")
    shutil.rmtree(path, ignore_errors=True)


def rootfs(log: Callable[[str], None] = print) -> Path:
    """Debian bookworm, minbase and slimmed, as a tar: made once per machine (~2 min)."""
    key = _rootfs_key()
    target = image_home() / f"rootfs-{SUITE}-{key}.tar"
    if target.is_file():
        return target
    debootstrap = _tool("debootstrap", "debootstrap")
    staging = image_home() / f"rootfs-{SUITE}-{key}.partial"
    log_file = image_home() / "log" / f"rootfs-{SUITE}-{key}.log"
    log_file.unlink(missing_ok=True)
    _remove_tree(staging)
    staging.mkdir(parents=True)
    log(f"debootstrap {SUITE} (minbase) from {MIRROR} (once per machine, ~2 min), "
        f"log: {log_file}")
    try:
        _run_logged([debootstrap, "--variant=minbase", f"--include={','.join(PACKAGES)}",
                     SUITE, str(staging), MIRROR], log_file, f"debootstrap {SUITE}",
                    f"check that {MIRROR} is reachable")
        _slim(staging)
        _run_logged(["tar", "--create", f"--file={target}.partial", "--numeric-owner",
                     "--xattrs", "--one-file-system", f"--directory={staging}",
                     "--exclude=./dev/*", "--exclude=./proc/*", "--exclude=./sys/*", "."],
                    log_file, "tar of the root file system", "check the free disk space")
        os.replace(f"{target}.partial", target)
    finally:
        _remove_tree(staging)
    return target


def _slim(root: Path) -> None:
    """What debuerreotype does to make debian:bookworm-slim of a minbase debootstrap."""
    for relative, text in ROOTFS_FILES.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        path.chmod(0o755 if relative.startswith("usr/sbin/") else 0o644)
    (root / "etc/apt/sources.list").unlink(missing_ok=True)
    for pattern in SLIM_EXCLUDES:
        directory = root / pattern.strip("/").removesuffix("/*")
        for entry in directory.glob("*") if directory.is_dir() else ():
            if pattern == "/usr/share/doc/*" and entry.is_dir() and not entry.is_symlink():
                for inner in entry.iterdir():
                    if inner.name != "copyright":
                        _unlink(inner)
            else:
                _unlink(entry)
    # The host's resolver and name (debootstrap copies them): a container runtime sets its own.
    for relative in ("etc/resolv.conf", "etc/hostname"):
        (root / relative).unlink(missing_ok=True)
    for directory in ("var/lib/apt/lists", "var/cache/apt/archives", "var/log"):
        for entry in (root / directory).rglob("*"):
            if entry.is_file() and entry.name != "lock":
                entry.unlink()
    (root / "etc/machine-id").unlink(missing_ok=True)


def _unlink(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def _relocate(prefix: Path, staging: Path, log_file: Path) -> None:
    """A copy of the interpreter's prefix made to live in /usr/local."""
    patchelf, strip = _tool("patchelf", "patchelf"), _tool("strip", "binutils")
    old = str(prefix).encode()
    for relative in _python_files(prefix):
        source, copy = prefix / relative, staging / relative
        copy.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            copy.symlink_to(os.readlink(source))
            continue
        shutil.copy2(source, copy)
        data = copy.read_bytes()
        if data[:4] == b"\x7fELF":
            # Executables and shared objects (ELF types 2 and 3; not config's python.o): the
            # official build links them with --strip-all and -rpath '$ORIGIN/../lib'.
            if int.from_bytes(data[16:18], "little") in (2, 3):
                for command in ([strip, "--strip-all", str(copy)],
                                [patchelf, "--set-rpath", "$ORIGIN/../lib", str(copy)]):
                    _run_logged(command, log_file, f"relocating {relative}",
                                "the interpreter's files must be ELF that patchelf can edit")
        elif old in data:
            copy.write_bytes(data.replace(old, b"/usr/local"))
        mode = source.stat().st_mode & 0o755 | 0o444  # readable by the image's user
        copy.chmod(mode | 0o111 if mode & 0o100 else mode)


def base(log: Callable[[str], None] = print) -> str:
    """The stand-in for python:3.12-slim-bookworm: built unless buildah's storage has it."""
    buildah = buildah_command()
    prefix = source_python()
    name = base_name(prefix)
    if _has_image(buildah, name):
        return name
    key = name.rsplit("-", 1)[1]
    context = image_home() / f"base-{key}.partial"
    shutil.rmtree(context, ignore_errors=True)
    (context / "python").mkdir(parents=True)
    tar = rootfs(log)
    os.link(tar, context / "rootfs.tar")
    log_file = image_home() / "log" / f"base-{key}.log"
    log_file.unlink(missing_ok=True)
    log(f"building {name} from {prefix} (once per machine, ~1 min), log: {log_file}")
    _relocate(prefix, context / "python", log_file)
    _run_logged(["tar", "--create", f"--file={context / 'python.tar'}", "--numeric-owner",
                 "--owner=0", "--group=0", f"--directory={context / 'python'}", "."],
                log_file, "tar of the interpreter", "check the free disk space")
    shutil.rmtree(context / "python")
    (context / "Containerfile").write_text(
        CONTAINERFILE.format(python_version=_python_version(prefix), key=key))
    _run_logged([buildah, "bud", "--isolation", "chroot", "--network", "host",
                 "--file", str(context / "Containerfile"), "--tag", name, str(context)],
                log_file, f"building {name}",
                f"the apt step needs {MIRROR}; the checks list a library the base lacks")
    shutil.rmtree(context, ignore_errors=True)
    return name


def built(name: str) -> bool:
    """Whether buildah's storage on this machine holds the image ``name``."""
    return _has_image(buildah_command(), name)


def _has_image(buildah: str, name: str) -> bool:
    return subprocess.run([buildah, "inspect", "--type", "image", name],
                          capture_output=True).returncode == 0


def host_ca_bundle() -> Path | None:
    """The CA bundle this host's own TLS clients use (``SSL_CERT_FILE``, else Debian's)."""
    for candidate in (os.environ.get("SSL_CERT_FILE"), "/etc/ssl/certs/ca-certificates.crt"):
        if candidate and Path(candidate).is_file():
            return Path(candidate).resolve()
    return None


# Where RUN steps see the host's CA bundle: the base's own bundle, bind-mounted over (so no
# mount point is ever created in a layer); the builder stages point uv and pip at it.
BUILD_CA_PATH = "/etc/ssl/certs/ca-certificates.crt"


BUILD_UV_CACHE = "/run/uv-cache"


def host_uv_cache() -> Path | None:
    """uv's cache on this host (``UV_CACHE_DIR``, else XDG's), if it exists."""
    named = os.environ.get("UV_CACHE_DIR")
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    path = Path(named) if named else Path(xdg) / "uv"
    return path.resolve() if path.is_dir() else None


def project_version() -> str:
    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["version"]


def image_name(target: str) -> str:
    return f"localhost/gemmalab-{target}:{project_version()}"


# The label naming what an image was built from (``inputs_key``).
INPUTS_LABEL = "dev.gemmalab.build-inputs"
# The build context the Dockerfile reads (.dockerignore's allow-list), and what it leaves out.
CONTEXT = ("Dockerfile", "pyproject.toml", "uv.lock", "requirements.txt", "README.md",
           "gemmalab", "notebooks")
CONTEXT_IGNORED = ("__pycache__", ".ipynb_checkpoints")


def inputs_key(command: Sequence[str], root: Path = REPO_ROOT) -> str:
    """A hash of a build's command (target, base, build arguments) and of every file of its
    context: equal keys build the same image."""
    digest = hashlib.sha256("\0".join(command).encode())
    for top in CONTEXT:
        paths = [root / top] if (root / top).is_file() else sorted((root / top).rglob("*"))
        for path in paths:
            relative = path.relative_to(root)
            if (path.is_dir() or path.suffix == ".pyc"
                    or any(part in CONTEXT_IGNORED for part in relative.parts)):
                continue
            digest.update(f"{relative}\0{path.stat().st_mode & 0o111:o}\0".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _image_labels(buildah: str, name: str) -> dict[str, str]:
    try:
        return _image_config(buildah, name).get("Labels") or {}
    except ClusterError:  # no such image yet
        return {}


def build_image(target: str = "cpu", tag: str | None = None,
                log: Callable[[str], None] = print) -> str:
    """``buildah bud --layers --target <target>`` of the Dockerfile on the local base: a rebuild
    after a change to gemmalab/ alone reuses the locked-dependency layer; none when the image
    ``tag`` names was built from the same files and arguments (its ``INPUTS_LABEL``)."""
    if target not in TARGETS:
        raise ClusterError(f"unknown target {target!r}", f"use one of {', '.join(TARGETS)}")
    buildah = buildah_command()
    python_image = base(log)
    tag = tag or image_name(target)
    command = [buildah, "bud", "--layers", "--force-rm", "--isolation", "chroot",
               "--network", "host", "--target", target,
               "--build-arg", f"PYTHON_IMAGE={python_image}",
               "--file", str(REPO_ROOT / "Dockerfile"), "--tag", tag]
    ca = host_ca_bundle()
    if ca is not None:
        command += ["--volume", f"{ca}:{BUILD_CA_PATH}:ro",
                    "--build-arg", f"SSL_CERT_FILE={BUILD_CA_PATH}"]
    uv_cache = host_uv_cache()
    if uv_cache is not None:
        # The wheels `make env` already fetched: a cold build downloads only what the host's
        # venv lacks (libtpu, jupyterhub), and no layer keeps the cache.
        command += ["--volume", f"{uv_cache}:{BUILD_UV_CACHE}",
                    "--build-arg", "UV_NO_CACHE=0", "--build-arg", f"UV_CACHE_DIR={BUILD_UV_CACHE}"]
    key = inputs_key(command)
    if _image_labels(buildah, tag).get(INPUTS_LABEL) == key:
        return tag  # built from these very files: buildah's own cache check takes ~1.5 min
    command += ["--label", f"{INPUTS_LABEL}={key}", str(REPO_ROOT)]
    prune_stale(buildah, python_image)
    log_file = image_home() / "log" / f"{target}.log"
    log_file.unlink(missing_ok=True)
    log(f"buildah bud --target {target} -t {tag} (cold: ~10 min on 2 cores with uv's cache "
        "warm; after a change to gemmalab/ ~2 min), "
        f"log: {log_file}")
    _run_logged(command, log_file, f"building the {target} image",
                "'no space left on device' needs ~12 GB free where buildah stores images; "
                "a network error means PyPI is unreachable from the build's RUN steps")
    # The image the tag named before (its /opt/venv layer alone is ~4 GB) goes with the rest.
    prune_stale(buildah, python_image)
    return tag


# What buildah prints for each step of a build: the image it made or took from its cache.
_STEP_IMAGE = re.compile(r"^--> (?:Using cache )?([0-9a-f]{11,64})$", re.M)


def prune_stale(buildah: str, python_image: str) -> list[str]:
    """Remove the untagged images built on ``python_image`` that the last build of no target
    used: the cached steps of Dockerfiles and lock files gone by (each ~4 GB of venv; three
    builds filled this 250 GB disk). The steps the last builds used stay their cache. The
    images removed."""
    kept = [match for log in (image_home() / "log").glob("*.log")
            for match in _STEP_IMAGE.findall(log.read_text(errors="replace"))]
    listed = subprocess.run([buildah, "images", "--all", "--json"], capture_output=True,
                            text=True)
    if listed.returncode != 0:
        return []
    base_layer = _first_layer(buildah, python_image)
    removed = []
    # Newest first: a step's image goes before the image it was built on.
    for image in sorted(json.loads(listed.stdout or "[]"), key=lambda i: -i["created"]):
        full_id = image["id"]
        if image.get("names") or any(full_id.startswith(k) or k.startswith(full_id)
                                     for k in kept):
            continue
        if base_layer is None or _first_layer(buildah, full_id) != base_layer:
            continue  # not built here on our base: not ours to remove
        if subprocess.run([buildah, "rmi", full_id], capture_output=True).returncode == 0:
            removed.append(full_id)
    return removed


def _first_layer(buildah: str, image: str) -> str | None:
    try:
        layers = _image_oci(buildah, image).get("rootfs", {}).get("diff_ids") or []
    except ClusterError:
        return None
    return layers[0] if layers else None


# The containerd label recording which buildah image a name was loaded from.
LOADED_FROM_LABEL = "dev.gemmalab.buildah-image-id"


def load_into_node(name: str, layout: Layout | None = None,
                   log: Callable[[str], None] = print) -> str:
    """Image ``name`` from buildah's storage into the CPU node's containerd, unless it already
    holds that build: ``buildah push`` to an uncompressed docker-archive, imported, removed."""
    buildah = buildah_command()
    image_id = _image_id(buildah, name)
    if image_id is None:
        raise ClusterError(f"no image {name} in buildah's storage",
                           "python -m gemmalab.k8s.cluster image --target cpu")
    if node.image_labels(name, layout).get(LOADED_FROM_LABEL) == image_id:
        return name
    archive = image_home() / "export" / f"{image_id[:16]}.tar"
    archive.parent.mkdir(parents=True, exist_ok=True)
    archive.unlink(missing_ok=True)
    log(f"loading {name} into the CPU node's containerd (~3 min for the 4 GB cpu image; "
        "the node keeps it)")
    try:
        _run_logged([buildah, "push", "--disable-compression", name,
                     f"docker-archive:{archive}:{name}"], image_home() / "log" / "export.log",
                    f"exporting {name}", "check the free disk space")
        node.load_image(archive, layout)
    finally:
        archive.unlink(missing_ok=True)
    node.label_image(name, LOADED_FROM_LABEL, image_id, layout)
    return name


def _image_id(buildah: str, name: str) -> str | None:
    done = subprocess.run([buildah, "inspect", "--type", "image", "--format", "{{.FromImageID}}",
                           name], capture_output=True, text=True)
    return done.stdout.strip() or None if done.returncode == 0 else None


def _image_oci(buildah: str, image: str) -> dict:
    """The OCI image JSON of ``image``: its config, its layers (``rootfs``), its history."""
    done = subprocess.run([buildah, "inspect", "--type", "image", image], capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise ClusterError(f"no image {image} in buildah's storage",
                           "python -m gemmalab.k8s.cluster image --target cpu")
    return json.loads(done.stdout)["OCIv1"]


def _image_config(buildah: str, image: str) -> dict:
    return _image_oci(buildah, image)["config"]


def runtime_spec(config: dict, rootfs_path: str, args: Sequence[str] | None = None,
                 env: dict[str, str] | None = None) -> dict:
    """An OCI runtime config for runc: the image's command, user, environment and working
    directory; the host's network; no rlimits and no OOM score (setting them needs
    CAP_SYS_RESOURCE, which containers here lack)."""
    user, _, group = (config.get("User") or "0").partition(":")
    command = list(config.get("Entrypoint") or []) + list(args or config.get("Cmd") or [])
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": int(user), "gid": int(group or user)},
            "args": command,
            "env": list(config.get("Env") or []) + [f"{k}={v}" for k, v in (env or {}).items()],
            "cwd": config.get("WorkingDir") or "/",
            "capabilities": {key: [] for key in ("bounding", "effective", "inheritable",
                                                 "permitted", "ambient")},
            "noNewPrivileges": True,
        },
        "root": {"path": rootfs_path, "readonly": False},
        "hostname": "gemmalab",
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
            {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
             "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]},
            {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
             "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=1g"]},
            {"destination": "/sys", "type": "sysfs", "source": "sysfs",
             "options": ["nosuid", "noexec", "nodev", "ro"]},
            {"destination": "/etc/resolv.conf", "type": "bind", "source": "/etc/resolv.conf",
             "options": ["rbind", "ro"]},
        ],
        "linux": {
            # No network namespace: the host's network (this is a smoke run, not isolation).
            "namespaces": [{"type": t} for t in ("pid", "ipc", "uts", "mount")],
            "maskedPaths": ["/proc/kcore", "/proc/keys", "/proc/timer_list", "/sys/firmware"],
            "readonlyPaths": ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys",
                              "/proc/sysrq-trigger"],
        },
    }


def run(image: str, args: Sequence[str] | None = None, *, env: dict[str, str] | None = None,
        timeout: float | None = None, capture: bool = False) -> subprocess.CompletedProcess:
    """Run the image's command (or ``args`` after its entry point; ``env`` added to its
    environment) with runc, as the image's user, on a throw-away buildah container's mount of
    the image; nothing is pulled or pushed, and what the command writes goes with the
    container."""
    buildah, runc = buildah_command(), _tool("runc", "runc")
    config = _image_config(buildah, image)
    name = f"gemmalab-run-{uuid.uuid4().hex[:8]}"
    subprocess.run([buildah, "from", "--name", name, "--pull=never", image], check=True,
                   capture_output=True)
    bundle = image_home() / "run" / name
    try:
        mount = subprocess.run([buildah, "mount", name], check=True, capture_output=True,
                               text=True).stdout.strip()
        bundle.mkdir(parents=True)
        spec = runtime_spec(config, mount, args, env)
        (bundle / "config.json").write_text(json.dumps(spec, indent=1))
        return subprocess.run([runc, "run", "--bundle", str(bundle), name], timeout=timeout,
                              capture_output=capture, text=capture)
    finally:
        subprocess.run([runc, "delete", "--force", name], capture_output=True)
        subprocess.run([buildah, "rm", name], capture_output=True)
        shutil.rmtree(bundle, ignore_errors=True)
