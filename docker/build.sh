#!/usr/bin/env bash
# Build the ddpkit image and print its tag on the last line.
#   docker/build.sh cuda [TAG]   default: CUDA runtime base + the tested torch (docker/Dockerfile's ARGs)
#   docker/build.sh cpu  [TAG]   CPU variant: Python base + torch/torchvision wheels
# Environment:
#   BASE_IMAGE         override the base (cpu default: python:3.11-slim-bookworm)
#   TORCH_PACKAGES     cpu: what to pip install (default: the versions in .venv, pinned)
#   PIP_INDEX_URL / PIP_EXTRA_INDEX_URL   e.g. https://download.pytorch.org/whl/cpu
#   OFFLINE=1          install only from docker/wheelhouse (fill it: make wheelhouse)
#   STANDIN=auto       (default) when the base is not here and cannot be pulled, build a
#                      stand-in with docker/standin-base.sh (CI: no registry); 0 never, 1 always
set -euo pipefail
cd "$(dirname "$0")/.."
variant=${1:?usage: build.sh cuda|cpu [TAG]}
docker=${DOCKER:-docker}
DOCKER=$docker bash docker/daemon-check.sh build.sh || exit  # one line, exit 3, before any pull or stand-in build
args=()
case "$variant" in
  cuda) tag=${2:-ddpkit:cuda} ;;
  cpu)
    tag=${2:-ddpkit:cpu}
    BASE_IMAGE=${BASE_IMAGE:-python:3.11-slim-bookworm}
    if [ -z "${TORCH_PACKAGES:-}" ]; then
      py=${PYTHON:-.venv/bin/python}
      TORCH_PACKAGES=$("$py" -c 'import torch, torchvision; print("torch==" + torch.__version__.partition("+")[0], "torchvision==" + torchvision.__version__.partition("+")[0])')
    fi
    # an empty TORCH_INDEX_URL: the CPU wheels come from PIP_INDEX_URL, not the CUDA index
    args+=(--build-arg "TORCH_PACKAGES=$TORCH_PACKAGES" --build-arg "TORCH_INDEX_URL=") ;;
  *) echo "build.sh: variant must be cuda or cpu, not '$variant'" >&2; exit 2 ;;
esac
[ -n "${BASE_IMAGE:-}" ] && args+=(--build-arg "BASE_IMAGE=$BASE_IMAGE")
for var in PIP_INDEX_URL PIP_EXTRA_INDEX_URL; do
  [ -n "${!var:-}" ] && args+=(--build-arg "$var=${!var}")
done
[ "${OFFLINE:-0}" = 1 ] && args+=(--build-arg PIP_NO_INDEX=1)

standin=${STANDIN:-auto}
if [ "$standin" != 0 ] && [ -n "${BASE_IMAGE:-}" ] \
   && ! "$docker" image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
  if [ "$standin" = 1 ] || ! timeout 120 "$docker" pull "$BASE_IMAGE" >&2; then
    echo "build.sh: $BASE_IMAGE cannot be pulled; building a stand-in" >&2
    DOCKER=$docker bash docker/standin-base.sh "$BASE_IMAGE" >&2
  fi
fi

# The Dockerfile uses RUN --mount (BuildKit). Docker >= 23 builds with buildx;
# a 20.10 client (Debian's docker.io) has BuildKit built in.
builder=()
for candidate in "$docker" $(type -ap docker); do
  if "$candidate" buildx version >/dev/null 2>&1; then builder=("$candidate" buildx build --load); break; fi
  major=$("$candidate" version --format '{{.Client.Version}}' 2>/dev/null | cut -d. -f1 || true)
  if [ -n "$major" ] && [ "$major" -lt 23 ]; then builder=(env DOCKER_BUILDKIT=1 "$candidate" build); break; fi
done
[ "${#builder[@]}" -gt 0 ] || { echo "build.sh: need docker buildx or a docker client with built-in BuildKit" >&2; exit 2; }
"${builder[@]}" --progress=plain -f docker/Dockerfile -t "$tag" "${args[@]}" . >&2
echo "$tag"
