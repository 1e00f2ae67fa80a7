#!/usr/bin/env bash
# Debian packages the real-infrastructure tests need (root only; off root the
# tests that need them skip with a one-line reason).
set -euo pipefail
[ "$(id -u)" -eq 0 ] || { echo "system-deps: not root, skipping"; exit 0; }
packages=(iproute2 procps util-linux openssh-server openssh-client pdsh slurm-wlm munge slurmdbd mariadb-server docker.io mmdebstrap chromium)
missing=()
for pkg in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "system-deps: installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
