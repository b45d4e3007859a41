# One image for the bootstrap node and the peers of the docker-compose testbed (CPU).
#
# A normal machine: `docker compose up --build` uses the official Python image and PyTorch's CPU
# wheel from its index. A machine without an image registry (scripts/compose_testbed.sh does this):
# BASE_IMAGE names a local Debian 12 image, and docker/wheelhouse/ holds the torch CPU wheel and,
# where egress goes through an inspecting proxy, the host's CA bundle (ca-certificates.crt).
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
ARG TORCH_VERSION=2.13.0

# tc (iproute2) shapes a peer's link (docker/peer.sh). A bare Debian base also lacks Python's venv.
RUN set -e; missing=""; \
    command -v tc >/dev/null || missing="iproute2"; \
    python3 -c "import ensurepip" 2>/dev/null || missing="$missing python3 python3-venv ca-certificates"; \
    if [ -n "$missing" ]; then \
        apt-get update && apt-get install -y --no-install-recommends $missing && rm -rf /var/lib/apt/lists/*; \
    fi; \
    python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /opt/noloco-swarm

# The CPU build of torch first: a bare torch requirement would pull the multi-GB CUDA build. A
# wheel in docker/wheelhouse/ wins; its dependencies come from the index, pinned by constraints.txt.
COPY constraints.txt ./
COPY docker/wheelhouse/ /tmp/wheelhouse/
# pip.conf in the venv makes every later pip (build isolation included) trust the given CA bundle.
RUN set -e; if [ -s /tmp/wheelhouse/ca-certificates.crt ]; then \
        cp /tmp/wheelhouse/ca-certificates.crt /opt/venv/pip-ca.crt \
        && printf '[global]\ncert = /opt/venv/pip-ca.crt\n' > /opt/venv/pip.conf; \
    fi; \
    if ls /tmp/wheelhouse/torch-"${TORCH_VERSION}"*.whl >/dev/null 2>&1; then \
        pip install -c constraints.txt /tmp/wheelhouse/torch-"${TORCH_VERSION}"*.whl; \
    else \
        pip install "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu; \
    fi; \
    rm -rf /tmp/wheelhouse

# Dependencies in their own layer (an empty package stands in), so a code change rebuilds only the last.
COPY pyproject.toml ./
RUN mkdir noloco_swarm && touch noloco_swarm/__init__.py README.md \
    && pip install -c constraints.txt . && pip uninstall -y noloco-swarm && rm -r noloco_swarm
COPY README.md ./
COPY noloco_swarm ./noloco_swarm
RUN pip install --no-deps . && rm -rf build
ENV NOLOCO_CACHE=/cache PYTHONFAULTHANDLER=1
# The embedded corpus and the default tokenizer, built once into the image instead of by every
# peer at its start (they come from this image's Python standard library, so every peer agrees).
RUN python -c "from noloco_swarm.data import DataConfig, load_tokenizer; load_tokenizer(DataConfig())"
COPY docker/peer.sh /usr/local/bin/noloco-peer
ENTRYPOINT ["noloco-peer"]
