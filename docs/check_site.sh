#!/usr/bin/env bash
# Build the documentation site, serve it on 127.0.0.1 and take headless-Chromium
# screenshots of the home page, a guide, an API page and the benchmarks page,
# to look at before merging a change to the docs.
#
#   docs/check_site.sh [OUTDIR]      # default: a new temporary directory
#
# Needs the docs extra (pip install -e ".[docs]") and Chromium (Debian:
# apt-get install -y chromium). The screenshots are not committed.
set -euo pipefail
cd "$(dirname "$0")/.."

out="${1:-$(mktemp -d -t jmp_policy_site.XXXXXX)}"
mkdir -p "$out"
site="$(mktemp -d -t jmp_policy_build.XXXXXX)"
profile="$(mktemp -d -t jmp_policy_chromium.XXXXXX)"
port="${PORT:-8765}"

browser=""
for candidate in chromium chromium-browser google-chrome; do
    if command -v "$candidate" >/dev/null 2>&1; then browser="$candidate"; break; fi
done
if [ -z "$browser" ]; then
    echo "no Chromium found: apt-get install -y chromium" >&2
    exit 2
fi

mkdocs build --strict --site-dir "$site"

python3 -m http.server "$port" --bind 127.0.0.1 --directory "$site" >/dev/null 2>&1 &
server=$!
cleanup() { kill "$server" 2>/dev/null || true; rm -rf "$site" "$profile"; }
trap cleanup EXIT
for _ in $(seq 50); do
    if python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/')" 2>/dev/null; then
        break
    fi
    sleep 0.1
done

shoot() {  # shoot NAME PATH [HEIGHT]
    "$browser" --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
        --disable-background-networking --disable-component-update --disable-sync \
        --hide-scrollbars --user-data-dir="$profile" --window-size="1280,${3:-900}" \
        --screenshot="$out/$1.png" "http://127.0.0.1:$port/$2" >/dev/null 2>&1
    echo "$out/$1.png  <- /$2"
}

shoot home ""
shoot guide-loss-scaling "loss-scaling/" 2400
shoot api-policies "api/policies/" 2400
shoot benchmarks "benchmarks/" 2400
shoot migration-pytorch "migration/pytorch-amp/" 1400
echo "screenshots in $out"
