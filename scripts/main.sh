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

echo "== 3/3 a short autotune (binary search, 6 trials, 1 GiB budget per slot)"
rm -rf "$out/dsat"
# The example's YAML with a dataset large enough for the micro-batches the search tries (its
# random images are made lazily, so the size costs nothing); everything else as in the example.
"$py" - "$root/examples/core_api/deepspeed.yaml" "$out/dsat_experiment.yaml" <<'PY'
import sys, yaml
config = yaml.safe_load(open(sys.argv[1], encoding="utf-8"))
config["hyperparameters"]["dataset_size"] = 65536
yaml.safe_dump(config, open(sys.argv[2], "w", encoding="utf-8"), sort_keys=False)
PY
"$py" -m toolkit.dsat binary "$out/dsat_experiment.yaml" "$root/examples/core_api" \
  --max-trials 6 --memory-per-slot 1GiB --metric throughput --trial-timeout 300 --output-dir "$out/dsat"

echo
echo "Done. Best DeepSpeed config: $out/dsat/best_ds_config.json"
echo "Open TensorBoard on the results:  $root/.venv/bin/tensorboard --logdir $out --port 6006"
