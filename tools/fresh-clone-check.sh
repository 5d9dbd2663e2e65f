#!/usr/bin/env bash
# The README's quick start on a fresh clone with nothing beside it.
#
# Clones this repository's HEAD commit into a folder named `kvstore` (the name `git clone`
# gives) in an empty temporary folder and runs the two commands of the README's "Quick
# start" block there, as written, each in the same shell (the first one activates the
# virtual environment the second one uses), with a fresh, empty HOME (pip's cache and
# user configuration are kept: PIP_CACHE_DIR and PIP_CONFIG_FILE point at the user's). Exits non-zero when either command fails.
# Only committed work is checked; the network is used by pip alone. The demo's cache root
# is a temporary one (KVSTORE_ROOT), not the user's.
#
# Usage: tools/fresh-clone-check.sh [--keep]   (--keep: leave the temporary folder)
set -euo pipefail

keep=0
[ "${1:-}" = "--keep" ] && keep=1

repo="$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
head="$(git -C "$repo" rev-parse HEAD)"
work="$(mktemp -d "${TMPDIR:-/tmp}/kvstore-fresh-clone.XXXXXX")"
if [ "$keep" -eq 0 ]; then
    trap 'rm -rf "$work"' EXIT
fi

clone="$work/kvstore"
git clone --quiet --no-checkout --no-hardlinks "$repo" "$clone"
git -C "$clone" checkout --quiet --detach "$head"
pip_cache="$(python3 -m pip cache dir 2>/dev/null || true)"
pip_conf=""
for f in "${XDG_CONFIG_HOME:-$HOME/.config}/pip/pip.conf" "$HOME/.pip/pip.conf"; do
    if [ -f "$f" ]; then pip_conf="$f"; break; fi
done
mkdir "$work/home"
cd "$clone"

# The first ```sh block after the "## Quick start" heading, line by line.
commands="$(awk '/^## Quick start/ { q = 1 } q && /^```sh$/ { f = 1; next } f && /^```$/ { exit } f' README.md)"
count="$(printf '%s\n' "$commands" | grep -c .)"
if [ "$count" -ne 2 ]; then
    echo "fresh-clone-check: expected two commands in the README's quick start, found $count" >&2
    exit 1
fi

script="$work/quick-start.sh"
{
    echo "set -u"
    n=0
    while IFS= read -r line; do
        [ -n "$line" ] || continue
        n=$((n + 1))
        printf 'echo %q\n' "+ $line"
        # `a && b` does not stop a shell under -e when `a` fails: check each line's status
        printf '%s || { rc=$?; echo "fresh-clone-check: command %d failed (exit $rc)" >&2; exit $rc; }\n' "$line" "$n"
    done <<< "$commands"
} > "$script"

echo "fresh-clone-check: $head in $clone (HOME=$work/home)"
vars=(HOME="$work/home" KVSTORE_ROOT="$work/root" PIP_DISABLE_PIP_VERSION_CHECK=1)
[ -n "$pip_cache" ] && vars+=(PIP_CACHE_DIR="$pip_cache")
[ -n "$pip_conf" ] && vars+=(PIP_CONFIG_FILE="$pip_conf")
env "${vars[@]}" bash "$script"
echo "fresh-clone-check: the README's two commands pass on a fresh clone"
