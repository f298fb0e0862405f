#!/usr/bin/env bash
# Install muajax on every worker of the slice: this checkout as it is on disk (uncommitted
# changes included), Python 3.11 (TPU VM images ship 3.10) in a uv virtualenv, jax[tpu], gcsfs and
# google-cloud-storage (orbax calls it directly for gs:// checkpoint directories).
#   tpu/setup.sh
# Optional, in the environment:
#   MODEL_GCS=gs://BUCKET/models/Qwen3-8B  copied to ~/muajax/checkpoints/Qwen3-8B on every worker
#                                          (the configs' model.hf_dir; each host reads its own slices)
#   SECRETS="OPENAI_API_KEY"               local variables installed on the workers in ~/.muajax_env
#                                          (mode 600, copied as a file: never on a command line)
#   MOUNT_BUCKET=1                         mount gs://$BUCKET at /mnt/gcs/$BUCKET with gcsfuse on every
#                                          worker (not needed for checkpoints, which take gs:// URLs;
#                                          see tpu/README.md)
source "$(dirname "$0")/common.sh"
root=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

run tar -C "$root" --exclude=.git --exclude=runs --exclude=checkpoints --exclude=__pycache__ -czf "$tmp/muajax.tgz" .
tpu_scp "$tmp/muajax.tgz"
tpu_ssh "set -e
  rm -rf ~/$REMOTE_DIR && mkdir -p ~/$REMOTE_DIR && tar -C ~/$REMOTE_DIR -xzf ~/muajax.tgz && rm ~/muajax.tgz
  export PATH=\$HOME/.local/bin:\$PATH
  command -v uv >/dev/null || curl -LsSf https://astral.sh/uv/install.sh | sh
  [ -d ~/$VENV ] || uv venv --python 3.11 ~/$VENV
  uv pip install --python ~/$VENV/bin/python -e ~/$REMOTE_DIR'[tpu]' gcsfs google-cloud-storage"

if [[ -n "${SECRETS:-}" ]]; then
  for name in $SECRETS; do
    if [[ -z "${!name:-}" ]]; then echo "SECRETS names $name, which is not set here" >&2; exit 2; fi
  done
  if [[ -n "$DRY_RUN" ]]; then
    echo "# writes $tmp/.muajax_env (mode 600): export $SECRETS, with their values here (not printed)"
  else
    (
      umask 077
      for name in $SECRETS; do printf 'export %s=%q\n' "$name" "${!name}"; done > "$tmp/.muajax_env"
    )
  fi
  tpu_scp "$tmp/.muajax_env"
  tpu_ssh "chmod 600 ~/.muajax_env"
fi

if [[ -n "${MODEL_GCS:-}" ]]; then
  tpu_ssh "mkdir -p ~/$REMOTE_DIR/checkpoints && gcloud storage cp -r $(printf %q "$MODEL_GCS") ~/$REMOTE_DIR/checkpoints/"
fi

if [[ -n "${MOUNT_BUCKET:-}" ]]; then
  need_bucket
  tpu_ssh "set -e
    if ! command -v gcsfuse >/dev/null; then
      curl -fsSL https://packages.cloud.google.com/apt/doc/apt-key.gpg | sudo tee /usr/share/keyrings/cloud.google.asc >/dev/null
      echo \"deb [signed-by=/usr/share/keyrings/cloud.google.asc] https://packages.cloud.google.com/apt gcsfuse-\$(lsb_release -cs) main\" | sudo tee /etc/apt/sources.list.d/gcsfuse.list >/dev/null
      sudo apt-get update -q && sudo apt-get install -yq gcsfuse
    fi
    sudo mkdir -p /mnt/gcs/$BUCKET && sudo chown \$USER /mnt/gcs/$BUCKET
    mountpoint -q /mnt/gcs/$BUCKET || gcsfuse --implicit-dirs --rename-dir-limit=1000000 $BUCKET /mnt/gcs/$BUCKET"
fi

# Every worker joins the distributed system and sees the whole slice: the launch will work.
tpu_ssh "cd ~/$REMOTE_DIR && MUAJAX_DISTRIBUTED=auto ~/$VENV/bin/python -c '
from muajax.runtime.distributed import maybe_initialize_distributed
maybe_initialize_distributed()
import jax
print(f\"worker {jax.process_index()}/{jax.process_count()}: {jax.local_device_count()} of {jax.device_count()} devices\")'"
