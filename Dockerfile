# Minimal image of the peer library, the CLI and the coordinator (its extra); by default it runs
# the coordinator, with its SQLite database and checkpoints in the volume /data.
# Build: docker build -t swarmgrad .
# Run:   docker run -p 8000:8000 -v swarmgrad:/data -e SWARMGRAD_SECRET_KEY=... swarmgrad
FROM python:3.11-slim
WORKDIR /app
# torch first and pinned to the CPU build, so the package's looser requirement installs nothing more.
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md ./
COPY peer ./peer
COPY swarmgrad ./swarmgrad
COPY server ./server
# The coordinator's migrations; installed, they are the data package server.migrations.
COPY migrations ./migrations
# The pages' templates and static files; installed, they are the data package server.web.assets.
# (tests/web/test_dockerfile.py builds the wheel from exactly what these COPY lines copy.)
COPY web ./web
RUN pip install --no-cache-dir '.[coordinator]'
WORKDIR /data
VOLUME /data
EXPOSE 8000
# uvicorn serves the port itself, with the coordinator's guard on connections: request
# headers within SWARMGRAD_HTTP_HEADER_TIMEOUT_S (10 s), caps per address and per worker
# (docs/deploy.md); deploy/ puts Caddy in front.
ENTRYPOINT ["swarmgrad"]
CMD ["coordinator", "--host", "0.0.0.0"]
