#!/usr/bin/env bash
# make compose-test: build the CPU image, render the compose file for NODES
# nodes (default 2), check it with `docker compose config`, run a gloo DDP
# `ddpkit train` on synthetic data, and exit with node0's code. The rank
# report must show every rank exactly once. Environment: NODES, NPROC, OUT,
# IMAGE (tag), SKIP_BUILD=1 (use IMAGE as it is), ARGS (the training
# arguments as a JSON list; default: a tiny synthetic run).
set -euo pipefail
cd "$(dirname "$0")/.."
nodes=${NODES:-2}
nproc=${NPROC:-2}
out=${OUT:-out}/compose-test
py=${PYTHON:-.venv/bin/python}
tag=${IMAGE:-ddpkit:cpu}
bash docker/daemon-check.sh compose-test || exit  # one line, exit 3, before the build
if docker compose version >/dev/null 2>&1; then compose=(docker compose)
elif [ -x .venv/bin/docker-compose ]; then compose=(.venv/bin/docker-compose)
else compose=(docker-compose); fi

[ "${SKIP_BUILD:-0}" = 1 ] || tag=$(bash docker/build.sh cpu "$tag" | tail -n 1)
# Tiny settings: a real DDP run (forward, all-reduce, step) in seconds per node.
args=${ARGS:-'["--model=tiny","--data=synthetic","--image-size=16","--synthetic-size=64","--batch-size=8","--epochs=1","--workers=0","--no-eval"]'}
"$py" -m ddpkit.cli render compose -f examples/cpu-smoke.yaml --nodes "$nodes" --nproc-per-node "$nproc" \
  --image "$tag" -o "$out" --set "command.args=$args"
file=$out/compose.yaml
"${compose[@]}" -f "$file" config --quiet
echo "compose-test: $file passes '${compose[*]} config'"

down() { "${compose[@]}" -f "$file" down --remove-orphans --timeout 5 >/dev/null 2>&1 || true; }
trap down EXIT
set +e
"${compose[@]}" -f "$file" up --no-color --exit-code-from node0 2>&1 | tee "$out/run.log"
rc=${PIPESTATUS[0]}
set -e
echo "compose-test: node0 exited with $rc"
[ "$rc" -eq 0 ] || exit "$rc"
"$py" -m tests.infra.rank_table "$out/run.log" "$((nodes * nproc))" "$nproc"
