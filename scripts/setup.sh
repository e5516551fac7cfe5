#!/usr/bin/env bash
# Create .venv with torch, deepspeed and toolkit (editable) + test extras. Idempotent: when
# nothing changed since the last run it only checks a stamp and returns within a second.
#
#   bash scripts/setup.sh            # from anywhere; paths are relative to this repository
#
# torch comes first: a torch already importable by python3 (e.g. a CUDA build on a GPU machine) is
# kept by giving the venv the system site-packages; otherwise torch==2.13.0 is installed, whose
# CPU wheel lies on disk here (an unpinned torch would pull gigabytes of CUDA packages).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
python="${PYTHON:-python3}"
torch_pin="${TOOLKIT_TORCH:-torch==2.13.0}"

start=$SECONDS
say() { echo "setup [$((SECONDS - start)) s]: $*"; }
# pip's own lines, fewer: what it fetches and installs, not every requirement it finds satisfied
pip_lines() { grep --line-buffered -E '^(Collecting|Downloading|Installing|Successfully|ERROR|WARNING)' || true; }
stamp_of() { cat "$root/setup.cfg" "$root/pyproject.toml" "$root/scripts/setup.sh" | sha256sum | cut -c1-16; }
want="$(stamp_of)"
# DeepSpeed's CPU ops are built into the venv, not ~/.cache: a lock left there by another checkout's
# killed build, or ops built by another torch or another ninja, cannot reach this one.
# scripts/test.sh and scripts/main.sh export the same variable.
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$venv/torch_extensions}"
build_ops() {
  # DeepSpeed never removes its CPU all-reduce segments from /dev/shm (memory); runs that ended
  # without toolkit.init_distributed leave them. Compilers starved by them fail (toolkit/runtime/ds_shm.py).
  "$venv/bin/python" -P "$root/toolkit/runtime/ds_shm.py"
  if [ "$(cat "$venv/.ops-stamp" 2>/dev/null)" != "$want:$TORCH_EXTENSIONS_DIR" ]; then
    say "loading DeepSpeed's CPU ops (FusedAdam, CPU Adam, shared-memory all-reduce) from $TORCH_EXTENSIONS_DIR;" \
        "compiling them the first time takes a few minutes, with no output while the compiler runs"
    PATH="$venv/bin:$PATH" "$venv/bin/python" "$root/scripts/build_ops.py"
    echo "$want:$TORCH_EXTENSIONS_DIR" > "$venv/.ops-stamp"
  fi
}
if [ -x "$venv/bin/python" ] && [ "$(cat "$venv/.toolkit-stamp" 2>/dev/null)" = "$want" ] \
   && "$venv/bin/python" -c "import torch, deepspeed, yaml, tensorboard, pytest, transformers, accelerate, toolkit" 2>/dev/null; then
  build_ops
  exit 0
fi

if [ ! -x "$venv/bin/python" ]; then
  if "$python" -c "import torch" 2>/dev/null; then
    say "reusing the torch of $python ($("$python" -c 'import torch; print(torch.__version__)'))"
    "$python" -m venv --system-site-packages "$venv"
  else
    "$python" -m venv "$venv"
  fi
fi
pip=("$venv/bin/python" -m pip install --disable-pip-version-check --progress-bar off)
if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
  say "installing $torch_pin (its CPU wheel; a minute or more; pip's whole output: $venv/setup.log)"
  "${pip[@]}" "$torch_pin" 2>&1 | tee -a "$venv/setup.log" | pip_lines
fi
say "installing toolkit (editable) with DeepSpeed, TensorBoard, transformers and the test tools into $venv" \
    "(a few minutes the first time; pip's whole output: $venv/setup.log)"
"${pip[@]}" -e "$root[test,hf]" 2>&1 | tee -a "$venv/setup.log" | pip_lines
echo "$want" > "$venv/.toolkit-stamp"
build_ops
say "done"
