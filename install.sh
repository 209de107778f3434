#!/usr/bin/env bash
# Installs everything paraseek needs on a fresh Debian machine: the Python distribution with all
# extras (torch pinned to the CPU build by constraints.txt), redis-server for the service tests,
# docker-compose for validating the compose file and chromium for the search page's browser tests.
# Run as root, or with sudo available.
set -euo pipefail
cd "$(dirname "$0")"

python3 -m pip install -c constraints.txt -e ".[all]"

missing=()
command -v redis-server >/dev/null || missing+=(redis-server)
command -v docker-compose >/dev/null || missing+=(docker-compose)
# headless browser for the search page's tests (driven by playwright against this executable)
command -v chromium >/dev/null || missing+=(chromium)
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
fi
