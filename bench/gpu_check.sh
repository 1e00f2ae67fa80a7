#!/usr/bin/env bash
# One-call GPU check for a lent CUDA machine (see docs/BENCHMARKS.md, "CUDA").
# Runs, each under a hard timeout and all inside one deadline:
#   1. the machine and versions (nvidia-smi, python, torch, CUDA, cuDNN, NCCL)
#   2. every `gpu`-marked test (tests/test_gpu_paths.py, test_devices.py, test_doctor_driver.py: whole runs
#      under `ddpkit train --spawn` and ddpkit.agent, forked and DDPKIT_AGENT_FORK=0) and tests/test_agent.py
#   3. restart: bench/worker_restart.py --device cuda (a worker SIGKILLed, started again: torchrun vs
#      ddpkit.agent), startup: bench/startup.py --device cuda (launch to first step, both agents)
#   profile: bench/step_profile.py over steps 34-53 of ddpkit's fastest CUDA entry and of the compiled
#      channels_last ceiling, ResNet-18 @32 b256 (profile-r18) and ResNet-50 @224 b256 (profile-r50)
#   4. bench/train_throughput.py --device cuda, ResNet-50 @224 then ResNet-18 @32 (cut-down entries/steps)
#   5. `python -m ddpkit.doctor --bench` over NCCL on the GPUs (torchrun, one process per GPU)
# Everything goes to files under $OUT (at most 8); a short table is printed last.
#
#   bash bench/gpu_check.sh            # OUT defaults to ./gpu-check-out; DEADLINE_S (default 520) bounds the whole:
#                                      give the device call timeout_s >= DEADLINE_S + 20
#   STEPS="tests r50" R50_CAP=175 R50_ENTRIES=... bash bench/gpu_check.sh   # a part only (rerun after a failure)
#   STEPS="tests" TESTS_K="dataparallel" bash bench/gpu_check.sh             # the tests pytest -k selects
#
# Python packages the machine lacks (pydantic, paramiko and their needs) may sit as wheels
# in .whl/ (pip download --no-deps ... -d .whl): they are installed first.
set -u
OUT=${OUT:-$PWD/gpu-check-out}
mkdir -p "$OUT"
REPO=$PWD
START=$(date +%s)
DEADLINE=$((START + ${DEADLINE_S:-520}))
SUMMARY=/tmp/gpu_check_summary.txt  # printed last; $OUT keeps its 8 files for the logs
: >"$SUMMARY"
export PYTHONUNBUFFERED=1

STEPS=" ${STEPS:-env tests restart startup profile-r18 profile-r50 r50 r18 doctor} "
wants() { [[ $STEPS == *" $1 "* ]]; }
left() { echo $((DEADLINE - $(date +%s))); }
# step NAME CAP LOG COMMAND...: run COMMAND under min(CAP, time left), output to LOG
step() {
    local name=$1 cap=$2 log=$3 l t s rc
    shift 3
    l=$(left)
    t=$((l < cap ? l : cap))
    if [ "$t" -lt 15 ]; then
        printf '%-10s %-8s %5s s  %s\n' "$name" "SKIPPED" 0 "no time left" | tee -a "$SUMMARY"
        return 0
    fi
    echo "=== $name (timeout ${t}s) $(date +%T): $*" | tee -a "$log"
    s=$(date +%s)
    timeout -k 5 "$t" "$@" >>"$log" 2>&1
    rc=$?
    printf '%-10s rc=%-5s %5s s  timeout %s s\n' "$name" "$rc" $(($(date +%s) - s)) "$t" | tee -a "$SUMMARY"
    return 0
}

# -- 0. wheels the image lacks
if ls .whl/*.whl >/dev/null 2>&1; then
    if ! python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade .whl/*.whl >>"$OUT/env.txt" 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >>"$OUT/env.txt" 2>&1
        export PYTHONPATH=/tmp/site
        # subprocesses that set their own PYTHONPATH (tests/test_gpu_paths.py) still find them
        echo /tmp/site >"$(python3 -c 'import site; print(site.getsitepackages()[0])')/zz-ddpkit-wheels.pth"
    fi
fi
export PYTHONPATH=$REPO/src:$REPO${PYTHONPATH:+:$PYTHONPATH}

# GPU load/clock/power samples for the whole run
nvidia-smi --query-gpu=timestamp,utilization.gpu,utilization.memory,clocks.sm,clocks.mem,power.draw,temperature.gpu,memory.used \
    --format=csv -l 2 >"$OUT/smi.csv" 2>&1 &
SMI=$!

# the first import of matplotlib builds its font cache: do it now, not in the bench's timed-out tail
python3 -c "import matplotlib.pyplot" >/dev/null 2>&1 &
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >>"$OUT/env.txt" 2>&1

# -- 1. machine and versions
wants env && step env 40 "$OUT/env.txt" bash -c '
nvidia-smi; nvidia-smi -q | grep -iE "product name|driver version|cuda version|max clocks|power limit|persistence|compute mode|mig mode" | head -30
uname -r; nproc; free -g; df -h /dev/shm /tmp
python3 - <<EOF
import platform, sys, torch, torchvision
print("python", platform.python_version(), sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version(),
      "nccl", ".".join(map(str, torch.cuda.nccl.version())), "torchvision", torchvision.__version__)
p = torch.cuda.get_device_properties(0)
print("gpus", torch.cuda.device_count(), p.name, "cc", f"{p.major}.{p.minor}", "SMs", p.multi_processor_count,
      "mem GiB", round(p.total_memory / 2**30, 1))
from ddpkit.train.startup.rank_report import versions
print("ddpkit versions()", versions())
import pydantic, typing_extensions
print("pydantic", pydantic.VERSION)
EOF
python3 -m pip list 2>/dev/null | grep -iE "^(torch|torchvision|triton|pytest|pytest-xdist|pytest-timeout|pydantic|typing.extensions|numpy) "'

# -- 2. every gpu-marked test and the agent's own tests (few workers: one GPU, 16 cores)
wants tests && step tests "${TESTS_CAP:-240}" "$OUT/tests.log" python3 -m pytest -p no:cacheprovider -n 8 --timeout 200 -v -rA \
    ${TESTS_K:+-k "$TESTS_K"} \
    --durations=0 --junitxml="$OUT/tests.xml" tests/test_gpu_paths.py tests/test_devices.py tests/test_doctor_driver.py \
    tests/test_agent.py

# -- 3. a worker's restart and a job's start-up on CUDA, torchrun beside ddpkit.agent
wants restart && step restart "${RESTART_CAP:-150}" "$OUT/bench.log" python3 -m bench.worker_restart --device cuda --nproc 1 \
    --repeats "${RESTART_REPEATS:-3}" --model resnet18 --image-size 32 --batch-size 128 --steps 30 --out /tmp/bres
wants startup && step startup "${STARTUP_CAP:-90}" "$OUT/bench.log" python3 -m bench.startup --device cuda --nproc 1 \
    --repeats 2 --batch-size 128 --workers 0 --name startup-agents-cuda --out /tmp/bres
cp /tmp/bres/*.json /tmp/bres/*.png "$OUT/" 2>/dev/null

# -- profiles: ddpkit's step beside the ceiling's (one process, under the agent as every target runs it)
profile_pair() {  # MODEL IMAGE_SIZE BATCH: writes /tmp/prof/<model>-{ddpkit,ceiling}.json and -ops.txt
    local p="python3 -m ddpkit.agent --standalone --nproc-per-node=1 bench/step_profile.py --out /tmp/prof"
    $p --name "$1-ddpkit" -- -m ddpkit.train --device cuda --model "$1" --image-size "$2" --batch-size "$3" \
        --max-steps 60 --synthetic-size $((60 * $3)) --eval-size 2 --log-every 20 --progress plain \
        --metrics "/tmp/prof/$1-metrics.jsonl" --gpu-resident-data --workers 0 --precision bf16 --channels-last \
        --compile --cudnn-benchmark || return
    $p --name "$1-ceiling" -- bench/ceiling.py --device cuda --variant compile_channels_last --model "$1" \
        --image-size "$2" --batch-size "$3" --warmup 20 --measure 40 --timing "/tmp/prof/$1-timing.jsonl"
}
export -f profile_pair
wants profile-r18 && step profile-r18 "${PROFILE_CAP:-150}" "$OUT/bench.log" bash -c "profile_pair resnet18 32 256"
wants profile-r50 && step profile-r50 "${PROFILE_CAP:-150}" "$OUT/bench.log" bash -c "profile_pair resnet50 224 256"
if ls /tmp/prof/*-ops.txt >/dev/null 2>&1; then
    for f in /tmp/prof/*-ops.txt; do echo "==== $f"; cat "$f"; done >"$OUT/profile-ops.txt"
    python3 -c 'import json, pathlib, sys; print(json.dumps({p.stem: json.loads(p.read_text()) for p in sorted(pathlib.Path("/tmp/prof").glob("*-*.json")) if not p.stem.endswith("-ops")}, indent=1))' >"$OUT/profiles.json"
fi

# -- 4. throughput (cut down to fit the lease; see docs/BENCHMARKS.md). On one H200 the four
#    ResNet-50 entries took ~185 s before the script's closing plot and JSON write: a 190 s
#    and a 175 s cap both cut that tail, hence 250 s.
FAST="ddpkit --gpu-resident-data bf16 cl compile"
R50_ENTRIES=${R50_ENTRIES:-"ceiling:channels_last,ceiling:compile_channels_last,reference,$FAST"}
wants r50 && step r50 "${R50_CAP:-250}" "$OUT/bench.log" python3 -m bench.train_throughput --device cuda --only resnet50 --repeats 1 \
    --warmup 10 --measure 30 --entries "$R50_ENTRIES" --out /tmp/bres --name "${R50_NAME:-train_throughput-cuda-r50}"
wants r18 && step r18 110 "$OUT/bench.log" python3 -m bench.train_throughput --device cuda --only resnet18 --repeats 1 \
    --entries "ceiling:channels_last,reference,$FAST" --out /tmp/bres --name train_throughput-cuda-r18
cp /tmp/bres/*.json "$OUT/" 2>/dev/null

# -- 5. doctor --bench over NCCL, one process per GPU (JSON; stderr into the bench log)
NGPU=$(nvidia-smi -L | grep -c '^GPU')
wants doctor && step doctor 35 "$OUT/bench.log" bash -c "python3 -m torch.distributed.run --nnodes=1 --nproc-per-node=$NGPU \
    --master-addr=127.0.0.1 --master-port=29533 --max-restarts=0 -m ddpkit.doctor --json --bench --device=cuda \
    --backend=nccl --disk-min=1KiB --shm-min=1KiB >'$OUT/doctor.json'"

kill "$SMI" 2>/dev/null

# -- the short table, last
echo
echo "---- steps (rc 124/137: hit its timeout) ----"
cat "$SUMMARY"
echo "---- versions ----"
grep -E "^(python|torch|gpus|NVIDIA) " "$OUT/env.txt"
echo "---- gpu tests ----"
grep -E "^(PASSED|FAILED|SKIPPED|ERROR) " "$OUT/tests.log" | sed 's/^\(.\{0,150\}\).*/\1/'
tail -n 1 "$OUT/tests.log"
echo "---- throughput (img/s) ----"
grep -E "^\s+\[.*\] run " "$OUT/bench.log"
grep -A12 "^workload  " "$OUT/bench.log" | grep -vE "^\s+\[" | head -40
echo "---- profiles (ms per step) ----"
[ -f "$OUT/profiles.json" ] && python3 -c '
import json, sys
for name, p in json.load(open(sys.argv[1])).items():
    print(name, "wall", p["step_ms_median"], "device", round(p["device_busy_ms_per_step"], 3), "launches",
          p["kernel_launches_per_step"], "syncs", p["host_syncs_per_step"])
    print("   host:", list(p["top_host_ms_per_step"].items())[:6])
    print("   device:", list(p["top_device_ms_per_step"].items())[:6])' "$OUT/profiles.json"
echo "---- restart and start-up (s) ----"
grep -B1 -A14 -E "^(kill -> first step|phase) " "$OUT/bench.log" | head -60
echo "total $(($(date +%s) - START)) s"
