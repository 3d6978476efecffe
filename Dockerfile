# Minimal image of the peer library, the CLI and the coordinator.
# Build: docker build -t swarmgrad .   Run a coordinator: docker run -p 8000:8000 swarmgrad coordinator --host 0.0.0.0
FROM python:3.11-slim
WORKDIR /app
# torch first and pinned to the CPU build, so the package's looser requirement installs nothing more.
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md ./
COPY peer ./peer
COPY server ./server
COPY web ./web
COPY migrations ./migrations
COPY alembic.ini ./
RUN pip install --no-cache-dir .
ENTRYPOINT ["swarmgrad"]
CMD ["--help"]
