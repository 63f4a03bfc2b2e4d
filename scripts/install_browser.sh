#!/usr/bin/env bash
# Install the Chromium that tests/test_browser.py drives through Playwright.
#
# The test uses the distribution's Chromium and never downloads a browser (Playwright's own
# `playwright install` fetches one from a CDN, which offline machines and CI cannot reach).
# Idempotent: does nothing when a Chromium is already installed. Without root or apt-get it
# prints what to do and exits 0: the browser test then skips locally (and fails in CI).
set -euo pipefail

for exe in "${LABKIT_CHROMIUM:-}" /usr/bin/chromium /usr/bin/chromium-browser; do
  if [ -n "$exe" ] && [ -x "$exe" ]; then
    echo "install_browser: Chromium is already installed at $exe"
    exit 0
  fi
done

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "install_browser: installing Debian's chromium package"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq chromium >/dev/null
  /usr/bin/chromium --version
  exit 0
fi

cat <<'MSG'
install_browser: no Chromium found, and this script can only install one as root with apt-get.
  Debian:        sudo apt-get install chromium
  Ubuntu:        sudo snap install chromium     (then LABKIT_CHROMIUM=/snap/bin/chromium)
  elsewhere:     install Chromium or Chrome and set LABKIT_CHROMIUM=/path/to/the/binary
Until then tests/test_browser.py skips (in CI, where CI=true, it fails instead).
MSG
exit 0
