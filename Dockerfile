# One image for the bootstrap node and the peers of the docker-compose testbed (CPU).
FROM python:3.11-slim
WORKDIR /opt/noloco-swarm
# The CPU build of torch first: a bare torch requirement would pull the multi-GB CUDA build.
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml constraints.txt README.md ./
COPY noloco_swarm ./noloco_swarm
RUN pip install --no-cache-dir -c constraints.txt .
ENV NOLOCO_CACHE=/cache
ENTRYPOINT ["noloco"]
