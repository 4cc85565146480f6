#!/usr/bin/env bash
# TRL-style PPO from MindSpeed-RL-style YAML run configs on a laptop CPU, then a resume from its checkpoint:
#   configs/rl/trl_ppo_tiny.yaml         first run: actor and reference from the converted policy (finetune: true),
#                                        critic from its value-head copy, 2 iterations saved to runs/tiny_trl_ppo_yaml
#   configs/rl/trl_ppo_tiny_resume.yaml  resume as MindSpeed-RL's docs set it (finetune: false, load = that save,
#                                        the reference's original weights in integrated_mode_config), to iteration 4
# The tiny model, data and checkpoints are trl_ppo_tiny_cpu.sh's (runs/tiny_trl_ppo; it runs first when they are
# missing). Flags after the script name go to both runs and override the files, e.g. --lr 1e-3.
set -euo pipefail
cd "$(dirname "$0")/../../.."
ASSETS=runs/tiny_trl_ppo
if [ ! -f "$ASSETS/mg_value/latest_checkpointed_iteration.txt" ]; then
  OUT="$ASSETS" bash examples/mcore/tiny/trl_ppo_tiny_cpu.sh
fi
PYTHON=${PYTHON:-$(bash scripts/setup_venv.sh | tail -n 1)}
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
rm -rf runs/tiny_trl_ppo_yaml  # the first file starts fresh; the second resumes from it
for CONFIG in configs/rl/trl_ppo_tiny.yaml configs/rl/trl_ppo_tiny_resume.yaml; do
  echo "==> posttrain_gpt.py --config $CONFIG $*"
  ${PYTHON} -m torch.distributed.run --standalone --nproc_per_node 1 posttrain_gpt.py --config "$CONFIG" "$@"
done
