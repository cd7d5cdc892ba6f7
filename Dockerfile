# blockgrad: the service as a container image (docs/operations.md, "Container").
#
#   docker build -t blockgrad:1.0.0 .                                   # CPU-only torch (default)
#   docker build -t blockgrad:1.0.0-cuda \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .   # CUDA torch
#
# The CUDA wheels bring their own CUDA libraries, so the same slim base serves both;
# the host only needs the NVIDIA driver and container toolkit.
# For byte-for-byte reproducible builds, pin the base by digest (python:3.11-slim@sha256:...).
FROM python:3.11-slim

# Where torch comes from: the CPU-only index by default (no CUDA libraries, a much smaller
# image); a CUDA index (e.g. .../whl/cu128, one your driver supports) for GPU nodes.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

# The writable places are /data (the job store's volume, below) and /tmp (an emptyDir on
# Kubernetes): the metrics files, and gunicorn's control socket, which otherwise goes to
# $HOME/.gunicorn and fails to start.
# A bind beyond loopback: the start refuses without BLOCKGRAD_API_TOKEN (pass it at run time,
# from a Kubernetes Secret in deploy/; never baked in) unless BLOCKGRAD_AUTH=off.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    BLOCKGRAD_BIND=0.0.0.0:8000 \
    BLOCKGRAD_GRPC_BIND=0.0.0.0:8001 \
    PROMETHEUS_MULTIPROC_DIR=/tmp/blockgrad-metrics \
    XDG_RUNTIME_DIR=/tmp \
    BLOCKGRAD_MODEL_DIR=/models \
    BLOCKGRAD_DATA_DIR=/data

# Unprivileged user with a fixed numeric id, so Kubernetes' runAsNonRoot can verify it.
# /models is BLOCKGRAD_MODEL_DIR, empty in the image (built-in objectives only): mount the
# operator's exported programs over it read-only, docker run -v "$PWD/models:/models:ro" ...
# /data is BLOCKGRAD_DATA_DIR, the job store's SQLite file when BLOCKGRAD_JOBS_DB names no
# PostgreSQL (one container with its embedded Dask cluster): the user's, and a volume below.
RUN groupadd --system --gid 10001 blockgrad \
 && useradd --system --no-log-init --uid 10001 --gid blockgrad --no-create-home \
      --home-dir /nonexistent --shell /usr/sbin/nologin blockgrad \
 && mkdir /models /data \
 && chown 10001:10001 /data
# After the chown (later build steps' changes to a volume are discarded): a new named volume
# starts as this directory, the user's; without -v the jobs live in an anonymous volume.
VOLUME ["/data"]

WORKDIR /srv/blockgrad

# Dependencies before the code, so a code change does not reinstall torch.
# torch first, from the chosen index and at the exact version requirements.txt pins
# (2.13.0 matches 2.13.0+cpu / +cuXXX); then everything else from PyPI at its pin, which
# leaves that torch in place and resets any shared dependency to the pinned version.
COPY requirements.txt ./
RUN python -m venv /opt/venv \
 && grep -E '^torch==' requirements.txt > /tmp/torch-requirement.txt \
 && pip install --no-cache-dir --index-url "$TORCH_INDEX_URL" --requirement /tmp/torch-requirement.txt \
 && pip install --no-cache-dir --requirement requirements.txt \
 && pip check \
 && rm /tmp/torch-requirement.txt

COPY gunicorn.conf.py wsgi.py ./
COPY app/ app/
# Bytecode now, as root: the container's filesystem is read-only at run time.
RUN python -m compileall -q app wsgi.py gunicorn.conf.py

USER 10001:10001
EXPOSE 8000 8001

# slim has no curl: ask /healthz with the standard library, on the port gunicorn binds.
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; port = os.environ.get('BLOCKGRAD_BIND', '0.0.0.0:8000').rsplit(':', 1)[1]; urllib.request.urlopen(f'http://127.0.0.1:{port}/healthz', timeout=4)"]

# The command `make serve` runs; gunicorn.conf.py reads BLOCKGRAD_BIND, WEB_CONCURRENCY and the rest.
CMD ["gunicorn", "-c", "gunicorn.conf.py", "wsgi:app"]
