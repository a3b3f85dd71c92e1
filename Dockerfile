# syntax=docker/dockerfile:1
# gemmalab images: the package, its locked dependencies and the notebooks, run by papermill in a
# Kubernetes Job/JobSet or by JupyterHub as a notebook server (see k8s/README.md).
#
#   docker build --target tpu -t us-east5-docker.pkg.dev/PROJECT/gemmalab/gemmalab-tpu:0.1.0 .
#   docker build --target gpu -t us-east5-docker.pkg.dev/PROJECT/gemmalab/gemmalab-gpu:0.1.0 .
#   docker build --target cpu -t gemmalab-cpu . && docker run --rm gemmalab-cpu   # local check
#   python -m gemmalab.k8s.cluster image --target cpu   # no Docker, no registry: buildah on a
#       local stand-in for python:3.12-slim-bookworm (gemmalab/k8s/cluster/image.py)
#
# Every Python package comes from uv.lock (`uv sync --frozen`). Only the accelerator runtime
# (libtpu, or the CUDA plugin) and jupyterhub's single-user server are added on top, constrained
# by requirements.txt (the lock's export) so that nothing locked can move.

ARG PYTHON_IMAGE=python:3.12-slim-bookworm

FROM ${PYTHON_IMAGE} AS python
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# ---- build stages: uv and the sources stay here -------------------------------------------------
FROM python AS builder
ARG UV_VERSION=0.13.9
ENV UV_PROJECT_ENVIRONMENT=/opt/venv \
    UV_PYTHON_DOWNLOADS=never \
    UV_COMPILE_BYTECODE=1 \
    UV_LINK_MODE=copy
# A build host behind a TLS-inspecting proxy mounts its CA bundle into the RUN steps and names it
# here (gemmalab/k8s/cluster/image.py: buildah's --volume): uv and pip trust it. Unset by
# default; an ARG, so each builder stage declares it and no image keeps it.
ARG SSL_CERT_FILE
# No package cache in a layer by default; a builder may mount its own uv cache and name it
# (UV_NO_CACHE=0 UV_CACHE_DIR=/mounted): then locked wheels it already holds are not downloaded.
ARG UV_NO_CACHE=1
ARG UV_CACHE_DIR
RUN pip install --no-cache-dir ${SSL_CERT_FILE:+--cert "$SSL_CERT_FILE"} "uv==${UV_VERSION}"
WORKDIR /src
COPY pyproject.toml uv.lock requirements.txt ./
# The locked dependencies alone: the runtime images copy this venv as one layer, which a change
# to gemmalab/ (or to README.md, which only the project's build reads) does not touch; gemmalab
# itself is the `project` stage's small layer.
RUN uv sync --frozen --no-dev --no-install-project --python /usr/local/bin/python3.12
# JupyterHub starts `jupyterhub-singleuser` in notebook servers: same version as the chart's hub
# (zero-to-jupyterhub 4.4.0 runs JupyterHub 5.5.0).
ARG JUPYTERHUB_VERSION=5.5.0
RUN uv pip install --python /opt/venv/bin/python --constraint requirements.txt \
        "jupyterhub==${JUPYTERHUB_VERSION}"

FROM builder AS builder-tpu
# jax[tpu] at the locked jax version adds libtpu (the TPU runtime); jax/jaxlib stay as locked.
# libtpu comes from PyPI, the release uv.lock holds (its tpu-compile group), no other index.
ARG JAX_VERSION=0.12.0.1
ARG LIBTPU_VERSION=0.0.50.1
ARG SSL_CERT_FILE
ARG UV_NO_CACHE=1
ARG UV_CACHE_DIR
RUN uv pip install --python /opt/venv/bin/python --constraint requirements.txt \
        "jax[tpu]==${JAX_VERSION}" "libtpu==${LIBTPU_VERSION}"

FROM builder AS builder-gpu
ARG JAX_VERSION=0.12.0.1
ARG SSL_CERT_FILE
ARG UV_NO_CACHE=1
ARG UV_CACHE_DIR
RUN uv pip install --python /opt/venv/bin/python --constraint requirements.txt \
        "jax[cuda12]==${JAX_VERSION}"

# gemmalab alone (its package and dist-info, no dependencies), laid out as site-packages.
FROM builder AS project
ARG SSL_CERT_FILE
ARG UV_NO_CACHE=1
ARG UV_CACHE_DIR
COPY README.md ./
COPY gemmalab/ gemmalab/
# Compiled where it runs (the runtime stages), so tracebacks name the installed files.
RUN UV_COMPILE_BYTECODE=0 uv pip install --python /opt/venv/bin/python --no-deps \
        --target /opt/project . \
 && rm -rf /opt/project/bin

# ---- runtime: no uv, no pip, no compiler; a non-root user ---------------------------------------
FROM python AS runtime
# libatomic1: the one library beyond glibc that mimalloc links (cmeel-mimalloc's libmimalloc.so.3),
# absent from the slim base; without it the CPU image's entry point, where gemmalab.allocator
# chooses mimalloc, dies before Python starts (libatomic.so.1: cannot open shared object file).
RUN apt-get update \
 && apt-get install --yes --no-install-recommends libatomic1 \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 1000 gemmalab \
 && useradd --uid 1000 --gid 1000 --create-home --home-dir /home/gemmalab --shell /bin/bash \
        gemmalab \
 && python -m pip uninstall --yes pip
ENV HOME=/home/gemmalab \
    GEMMALAB_CACHE_DIR=/home/gemmalab/.cache/gemmalab \
    TF_CPP_MIN_LOG_LEVEL=3
WORKDIR /app
COPY notebooks/ notebooks/

# The training notebook's default run, offline: LoRA on the embedded pretrained Gemma 3 270M, 16
# steps of 8 x 128 (the demo recipe, gemmalab/recipes.py): `docker run --rm gemmalab-cpu`.
FROM runtime AS cpu
COPY --from=builder /opt/venv /opt/venv
COPY --from=project /opt/project/ /opt/venv/lib/python3.12/site-packages/
RUN python -m compileall -q /opt/venv/lib/python3.12/site-packages/gemmalab
ENV JAX_PLATFORMS=cpu
USER 1000:1000
# The command runs on the malloc gemmalab.allocator chooses for the host the container is on
# (mimalloc in VMs that hand freed pages to their hypervisor, else glibc's with huge pages;
# GEMMALAB_MALLOC overrides): a preload is read only as a process starts, so it is set here.
ENTRYPOINT ["python", "-m", "gemmalab.allocator"]
CMD ["papermill", "notebooks/train.ipynb", "/tmp/train.ipynb", "-p", "output_dir", "/tmp/run", \
     "--log-output", "--no-progress-bar"]

FROM runtime AS gpu
COPY --from=builder-gpu /opt/venv /opt/venv
COPY --from=project /opt/project/ /opt/venv/lib/python3.12/site-packages/
RUN python -m compileall -q /opt/venv/lib/python3.12/site-packages/gemmalab
USER 1000:1000
CMD ["papermill", "--help"]

# The default target (last stage): the image of k8s/*.yaml and of the JupyterHub servers.
FROM runtime AS tpu
COPY --from=builder-tpu /opt/venv /opt/venv
COPY --from=project /opt/project/ /opt/venv/lib/python3.12/site-packages/
RUN python -m compileall -q /opt/venv/lib/python3.12/site-packages/gemmalab
USER 1000:1000
CMD ["papermill", "--help"]
