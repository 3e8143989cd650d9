#!/usr/bin/env bash
# Make sure wgpu finds an adapter: on a machine without a GPU, install Mesa's software
# Vulkan driver (lavapipe). Needs root (or sudo) only when something is missing.
set -u
if ! command -v apt-get >/dev/null 2>&1; then exit 0; fi
if ls /usr/share/vulkan/icd.d/lvp_icd*.json >/dev/null 2>&1 || ls /usr/share/vulkan/icd.d/nvidia_icd*.json >/dev/null 2>&1 \
   || ls /etc/vulkan/icd.d/*.json >/dev/null 2>&1; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
echo "installing Mesa's software Vulkan driver (mesa-vulkan-drivers) for wgpu..." >&2
$SUDO apt-get update -qq >/dev/null 2>&1 || true
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq mesa-vulkan-drivers >/dev/null
