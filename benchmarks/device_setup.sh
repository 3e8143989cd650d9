#!/usr/bin/env bash
# Source this on the device machine (repo root as cwd) after carrying .gl and .whl:
#   source benchmarks/device_setup.sh
# It unpacks the Vulkan loader, installs the carried wheels into /tmp/site and makes the
# source tree importable as the `memengine` package without building it.
for f in .gl/*.deb; do dpkg -x "$f" /; done
ldconfig
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
mkdir -p /tmp/pkg/memengine
for d in cli engine shaders configs; do ln -sfn "$PWD/$d" "/tmp/pkg/memengine/$d"; done
export PYTHONPATH=/tmp/site:/tmp/pkg
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
