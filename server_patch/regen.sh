#!/usr/bin/env bash
# Write the patch series back from an editable tree made by edit-tree.sh.
#
#   server_patch/regen.sh DIR
#
# Every commit after the `pristine` tag becomes NNNN-<subject>.patch (git format-patch, no
# signature, no version trailer, so regenerating an unchanged tree changes no file; the histogram
# diff, which keeps a rewritten block in one hunk), and `series` lists them in order. Old .patch
# files are removed first.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
dir=${1:?usage: regen.sh DIR}
git -C "$dir" rev-parse -q --verify pristine >/dev/null || { echo "regen: $dir has no 'pristine' tag" >&2; exit 1; }
rm -f "$here"/[0-9][0-9][0-9][0-9]-*.patch
git -C "$dir" format-patch -q --diff-algorithm=histogram --no-signature --no-numbered --zero-commit --no-stat --full-index --filename-max-length=72 \
    -o "$here" pristine..HEAD
{
    echo "# Applied in order by build_llama.sh (patch -p1). One purpose per patch."
    echo "# Regenerate with server_patch/regen.sh from a tree made by server_patch/edit-tree.sh."
    (cd "$here" && ls [0-9][0-9][0-9][0-9]-*.patch)
} > "$here/series"
cat "$here/series"
