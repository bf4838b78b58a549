#!/usr/bin/env bash
# The main job on 8 simulated CPU devices.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
python examples/train_lm.py "$@"
