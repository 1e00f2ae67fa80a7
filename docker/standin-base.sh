#!/usr/bin/env bash
# Build a stand-in for a base image that cannot be pulled (no registry is
# reachable on the CI machines): Debian bookworm's Python 3.11 from the
# host's apt mirror, trusting the host's CA bundle, imported and tagged with
# the name the Dockerfile's FROM expects.
#   docker/standin-base.sh python:3.11-slim-bookworm
set -euo pipefail
tag=${1:?usage: standin-base.sh TAG}
docker=${DOCKER:-docker}
mirror=${DEBIAN_MIRROR:-$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.sources 2>/dev/null |
  awk '/^URIs:/ && /debian\/?$/ {print $2; exit} /^deb / && $2 ~ /debian\/?$/ {print $2; exit}' || true)}
mirror=${mirror:-http://deb.debian.org/debian}
command -v mmdebstrap >/dev/null || { echo "standin-base: mmdebstrap is missing (apt-get install mmdebstrap)" >&2; exit 2; }
echo "standin-base: building $tag from $mirror" >&2
# shellcheck disable=SC2016  # "$1" is the chroot path, expanded by the hook's own shell
mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,ca-certificates \
  --customize-hook='cp /etc/ssl/certs/ca-certificates.crt "$1/etc/ssl/certs/ca-certificates.crt"' \
  --customize-hook='ln -sf python3 "$1/usr/bin/python"' \
  --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
  bookworm - "$mirror" |
  "$docker" import --change 'CMD ["python3"]' - "$tag" >/dev/null
echo "$tag"
