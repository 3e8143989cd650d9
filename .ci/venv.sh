#!/usr/bin/env bash
# Create the project virtualenv (default .venv) and install memengine into it, with the
# test extra when asked: `.ci/venv.sh VENV [test]`. On Debian/Ubuntu, where the system
# Python refuses pip installs (PEP 668) and `venv` may be split into python3-venv, this
# installs that package first (needs root or sudo, like the Vulkan driver).
set -euo pipefail
venv="${1:-.venv}"
extra="${2:-}"
py="${PYTHON:-python3}"
if ! "$py" -c 'import ensurepip, venv' >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" != 0 ] && SUDO="sudo"
    ver=$("$py" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
    echo "installing python${ver}-venv (the virtualenv module) ..." >&2
    $SUDO apt-get update -qq >/dev/null 2>&1 || true
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "python${ver}-venv" >/dev/null 2>&1 \
      || DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq python3-venv >/dev/null
  else
    echo "error: $py has no venv/ensurepip module; install your distribution's python3-venv package" >&2
    exit 2
  fi
fi
if [ ! -x "$venv/bin/python" ]; then
  echo "creating the virtualenv $venv ..." >&2
  "$py" -m venv "$venv"
fi
spec="."
[ "$extra" = test ] && spec=".[test]"
echo "installing memengine${extra:+ with its $extra extra} into $venv ..." >&2
"$venv/bin/python" -m pip install -q --disable-pip-version-check -e "$spec"
