#!/usr/bin/env bash
# The main job on 8 simulated CPU devices. Installs only what the example needs (eqpar's
# `examples` extra: optax, tyro, matplotlib, orbax-checkpoint), not the test and docs tools.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh" examples
python examples/train_lm.py "$@"
