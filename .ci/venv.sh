#!/usr/bin/env bash
# Create the project virtualenv (default .venv) and install memengine into it, with the
# extras asked for: `.ci/venv.sh VENV [test|test,llama]` (llama: llama-cpp-python, which
# compiles llama.cpp; a C++ compiler is installed first where missing). On Debian/Ubuntu,
# where the system Python refuses pip installs (PEP 668) and `venv` may be split into
# python3-venv, this installs that package first (needs root or sudo, like the Vulkan driver).
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
[ -n "$extra" ] && spec=".[$extra]"
case ",$extra," in
  *,llama,*)
    if ! command -v c++ >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
      SUDO=""; [ "$(id -u)" != 0 ] && SUDO="sudo"
      echo "installing a C++ compiler (g++) to build llama.cpp for llama-cpp-python ..." >&2
      $SUDO apt-get update -qq >/dev/null 2>&1 || true
      DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq g++ make >/dev/null
    fi
    # the libraries only (no llama.cpp tests or examples), for any x86-64 with AVX2
    export CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF}"
    export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc 2>/dev/null || echo 2)}"
    echo "llama-cpp-python compiles llama.cpp on its first install (15-20 minutes on 2 cores; pip keeps the wheel)" >&2
    ;;
esac
echo "installing memengine${extra:+ with its $extra extra} into $venv ..." >&2
"$venv/bin/python" -m pip install -q --disable-pip-version-check -e "$spec"
