#!/usr/bin/env bash
# The README's quick start on a fresh clone with nothing beside it.
#
# Clones this repository's HEAD commit into an empty temporary folder and runs the two
# commands of the README's "Quick start" block there, as written, each in the same
# shell (the first one activates the virtual environment the second one uses). Exits
# non-zero when either command fails. Only committed work is checked; the network is
# used by pip alone. The demo's cache root is a temporary one (KVSTORE_ROOT), not the
# user's.
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

git clone --quiet --no-checkout --no-hardlinks "$repo" "$work/checkout"
git -C "$work/checkout" checkout --quiet --detach "$head"
cd "$work/checkout"

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

echo "fresh-clone-check: $head in $work/checkout"
KVSTORE_ROOT="$work/root" PIP_DISABLE_PIP_VERSION_CHECK=1 bash "$script"
echo "fresh-clone-check: the README's two commands pass on a fresh clone"
