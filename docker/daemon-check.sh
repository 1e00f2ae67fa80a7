#!/usr/bin/env bash
# Stop at once, with one line and exit 3 (ExitCode.PREFLIGHT: this host cannot
# run it; nothing was started), when the Docker daemon does not answer, instead
# of failing later in a pull, a stand-in base image build or compose.
#   bash docker/daemon-check.sh WHO     (WHO: the name that starts the line)
# Environment: DOCKER (the client, default docker), DOCKER_HOST.
set -uo pipefail
who=${1:-docker}
docker=${DOCKER:-docker}
if ! command -v "$docker" >/dev/null 2>&1; then
  echo "$who: no Docker client '$docker' on PATH; install Docker (or set DOCKER to the client); nothing was started" >&2
  exit 3
fi
timeout 20 "$docker" version --format '{{.Server.Version}}' >/dev/null 2>&1 && exit 0
if [ -n "${DOCKER_HOST:-}" ]; then
  tried="DOCKER_HOST=$DOCKER_HOST"
else
  endpoint=$("$docker" context inspect --format '{{.Endpoints.docker.Host}}' 2>/dev/null || true)
  tried="${endpoint:-unix:///var/run/docker.sock} (DOCKER_HOST is not set; docker context $("$docker" context show 2>/dev/null || echo default))"
fi
echo "$who: cannot reach the Docker daemon at $tried; start it (sudo systemctl start docker, or sudo dockerd &) or set DOCKER_HOST to a running daemon; nothing was started" >&2
exit 3
