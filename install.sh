#!/usr/bin/env bash
# Installs everything paraseek needs on a fresh Debian machine, exactly as the last green CI run had it:
# a virtual environment (.venv) holding the package with all extras at the versions pinned in the lock
# (constraints.txt: every distribution, torch's CPU build included), plus Debian's redis-server for the
# service tests, docker-compose for validating the compose file, chromium for the search page's
# browser tests, prometheus for load runs watched by it, and wordnet-base (WordNet's synonyms). Run it
# again after the lock changes: it brings .venv to the lock.
#   VENV=DIR   the environment to create or update (default .venv)
#   TORCH_CPU_INDEX=URL   where torch's CPU wheel comes from when pip's own configuration has no
#                         copy of it (default PyTorch's CPU index; used only where it resolves)
# Run as root, or with sudo available.
set -euo pipefail
cd "$(dirname "$0")"
VENV=${VENV:-.venv}
TORCH_CPU_INDEX=${TORCH_CPU_INDEX-https://download.pytorch.org/whl/cpu}

# an environment made from another lock starts again empty: pip adds and changes distributions but
# never removes one the lock no longer has
lock_sum=$(sha256sum constraints.txt | cut -d' ' -f1)
if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$VENV/.paraseek-lock" 2>/dev/null)" != "$lock_sum" ]; then
  python3 -m venv --clear "$VENV"
fi
py="$VENV/bin/python"
pip_args=(-c constraints.txt --disable-pip-version-check)
host=$(printf '%s' "$TORCH_CPU_INDEX" | sed -E 's#^[a-z]+://([^/:]+).*#\1#')
if [ -n "$TORCH_CPU_INDEX" ] && "$py" -c "import socket, sys; socket.getaddrinfo(sys.argv[1], 443)" "$host" 2>/dev/null; then
  pip_args+=(--extra-index-url "$TORCH_CPU_INDEX")
fi

# the installer and the build backend first, at their locked versions, so that the editable build
# below runs on them (no build isolation: an isolated build would fetch whatever setuptools is newest)
"$py" -m pip install -q "${pip_args[@]}" pip setuptools wheel
"$py" -m pip install -q "${pip_args[@]}" --no-build-isolation -e ".[all,dev]"
echo "$lock_sum" >"$VENV/.paraseek-lock"

missing=()
command -v redis-server >/dev/null || missing+=(redis-server)
command -v docker-compose >/dev/null || missing+=(docker-compose)
# headless browser for the search page's tests (driven by playwright against this executable)
command -v chromium >/dev/null || missing+=(chromium)
# Prometheus for `paraseek bench load --with-prometheus` and the dashboard's test
command -v prometheus >/dev/null || missing+=(prometheus)
# WordNet 3.0 (/usr/share/wordnet): synonyms for query expansion and consistency reports, out of the box
[ -f /usr/share/wordnet/data.noun ] || missing+=(wordnet-base)
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
fi
