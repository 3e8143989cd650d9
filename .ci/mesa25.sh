#!/usr/bin/env bash
# Mesa 25's software Vulkan driver (lavapipe) in a private folder, for the Dawn backend:
# Dawn refuses Debian 12's Mesa 22.3 lavapipe ("shaderUniform*ArrayDynamicIndexing
# required") and runs on Mesa 25.0's. The packages of Debian's bookworm-backports suite
# (mesa-vulkan-drivers 25.0.7, with the libdrm2 and libdrm-amdgpu1 it needs) are
# downloaded and unpacked with `dpkg -x` into DIR (default .cache/mesa25, git-ignored);
# nothing is installed, the system's Mesa stays as it is.
#
#   bash .ci/mesa25.sh [DIR]      prints the two variables that select it, e.g.
#   eval "$(bash .ci/mesa25.sh)"  -> VK_DRIVER_FILES=DIR/lvp_icd.json LD_LIBRARY_PATH=DIR/lib:...
#
# Idempotent: once DIR holds the driver it only prints the variables (a few milliseconds).
# Adds the bookworm-backports apt source where apt lacks it (its priority keeps every
# installed package as it is); needs root (or sudo) only then.
set -euo pipefail
dir="${1:-${MEMENGINE_MESA25_DIR:-$(cd "$(dirname "$0")/.." && pwd)/.cache/mesa25}}"
mkdir -p "$dir"
dir="$(cd "$dir" && pwd)"
SUITE="bookworm-backports"   # mesa-vulkan-drivers 25.0.7-2~bpo12+1 when this was written
LIBDIR="$dir/root/usr/lib/x86_64-linux-gnu"
ICD="$dir/lvp_icd.json"

emit() {
  printf 'export VK_DRIVER_FILES=%q\n' "$ICD"
  printf 'export LD_LIBRARY_PATH=%q\n' "$LIBDIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
}

if [ -f "$dir/.ready" ] && [ -f "$ICD" ] && [ -f "$LIBDIR/libvulkan_lvp.so" ]; then
  emit
  exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
  echo "error: Mesa 25's lavapipe comes from Debian's bookworm-backports; this machine has no apt-get" >&2
  exit 2
fi
SUDO=""
[ "$(id -u)" != 0 ] && SUDO="sudo"

if ! apt-cache policy mesa-vulkan-drivers 2>/dev/null | grep -qF "$SUITE"; then
  if ! grep -rqs "bookworm-backports" /etc/apt/sources.list /etc/apt/sources.list.d/; then
    echo "adding Debian's bookworm-backports apt source (for Mesa 25's lavapipe) ..." >&2
    $SUDO tee /etc/apt/sources.list.d/bookworm-backports.sources >/dev/null <<'EOF'
Types: deb
URIs: http://deb.debian.org/debian
Suites: bookworm-backports
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
  fi
  $SUDO apt-get update -qq >/dev/null 2>&1 || true
fi

echo "unpacking $SUITE's Mesa lavapipe into $dir (the system's Mesa stays as it is) ..." >&2
debs="$dir/debs"
rm -rf "$debs" "$dir/root" "$dir/.ready"
mkdir -p "$debs"
(cd "$debs" && apt-get download -qq -o APT::Sandbox::User=root "mesa-vulkan-drivers/$SUITE" \
  "libdrm2/$SUITE" "libdrm-amdgpu1/$SUITE" >/dev/null)
for deb in "$debs"/*.deb; do
  dpkg -x "$deb" "$dir/root"
done

# the libraries lavapipe links against that are not in the folder (LLVM 15, xcb ...) come
# from the system: Debian's own mesa-vulkan-drivers pulls in the same ones
if ldd "$LIBDIR/libvulkan_lvp.so" | grep -q "not found"; then
  echo "installing the libraries Mesa's lavapipe links against (mesa-vulkan-drivers) ..." >&2
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq mesa-vulkan-drivers libvulkan1 >/dev/null
fi
if LD_LIBRARY_PATH="$LIBDIR" ldd "$LIBDIR/libvulkan_lvp.so" | grep "not found" >&2; then
  echo "error: Mesa 25's lavapipe misses the libraries above" >&2
  exit 1
fi

# the package's manifest names the driver by its file name alone: this one names ours by its path
src="$(ls "$dir"/root/usr/share/vulkan/icd.d/lvp_icd*.json | head -n 1)"
sed 's|"library_path": *"[^"]*"|"library_path": "'"$LIBDIR"'/libvulkan_lvp.so"|' "$src" > "$ICD"
rm -rf "$debs"
touch "$dir/.ready"
emit
