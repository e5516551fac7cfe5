#!/usr/bin/env bash
# The main job, on CPU by default: set up .venv, train the example on 2 ranks with torchrun
# (TensorBoard logs + checkpoints), start it again to show it resumes, then a short dsat autotune.
#
#   bash scripts/main.sh                    # everything lands in runs/main/
#   NPROC=4 bash scripts/main.sh            # more ranks
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
# One PATH for every process: DeepSpeed builds its CPU ops with the first `ninja` on PATH, and two
# different ninjas (the venv's and the system's) make processes rebuild them.
export PATH="$root/.venv/bin:$PATH"
# DeepSpeed's CPU ops, built once by scripts/setup.sh into the venv (see scripts/build_ops.py).
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$root/.venv/torch_extensions}"
py="$root/.venv/bin/python"
out="${TOOLKIT_MAIN_OUT:-$root/runs/main}"
nproc="${NPROC:-2}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
mkdir -p "$out"
port() { "$py" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

echo "== 1/3 train examples/core_api/train.py on $nproc CPU ranks (torchrun)"
"$py" -m torch.distributed.run --nproc_per_node "$nproc" --master_port "$(port)" \
  "$root/examples/core_api/train.py" --output-dir "$out/train"

echo "== 2/3 start it again: it resumes from its last checkpoint and has nothing left to do"
"$py" -m torch.distributed.run --nproc_per_node "$nproc" --master_port "$(port)" \
  "$root/examples/core_api/train.py" --output-dir "$out/train"

echo "== 3/3 a short autotune (binary search of ZeRO stage 1 under 1 GiB per slot: 3 profiling trials p1-p3,"
echo "   3 tuning trials, then the best configuration re-run twice and picked by the median)"
rm -rf "$out/dsat"
# The example's YAML with a dataset large enough for the micro-batches the search tries (its
# random images are made lazily, so the size costs nothing); everything else as in the example.
"$py" - "$root/examples/core_api/deepspeed.yaml" "$out/dsat_experiment.yaml" <<'PY'
import sys, yaml
config = yaml.safe_load(open(sys.argv[1], encoding="utf-8"))
config["hyperparameters"]["dataset_size"] = 65536
yaml.safe_dump(config, open(sys.argv[2], "w", encoding="utf-8"), sort_keys=False)
PY
# --max-trials 8 counts the profiling trials (micro-batch 1, the calibration, and up to 3 points
# of stage 1's ladder nearer its boundary): at least 3 tuning trials. --confirm 1: the best
# configuration is re-run until it has 3 measurements (2 re-runs, beside --max-trials). One stage,
# and 2 timed steps (2, 3) spanning at least 1 s, keep the trials short: a trial is mostly its
# start-up.
"$py" -m toolkit.dsat binary "$out/dsat_experiment.yaml" "$root/examples/core_api" \
  --max-trials 8 --zero-stages 1 --confirm 1 --start-profile-step 2 --end-profile-step 3 --timed-window 1 \
  --memory-per-slot 1GiB --metric throughput --trial-timeout 300 --output-dir "$out/dsat"

echo
echo "Done. Best DeepSpeed config: $out/dsat/best_ds_config.json"
echo "Open TensorBoard on the results:  $root/.venv/bin/tensorboard --logdir $out --port 6006"
