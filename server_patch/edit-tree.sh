#!/usr/bin/env bash
# Make an editable git tree of the pinned source with the series applied, one commit per patch.
#
#   server_patch/edit-tree.sh DIR
#
# DIR gets a commit "pristine" (the pinned vendor/llama.cpp, tagged `pristine`), then one
# commit per entry of `series`, whose message is the patch's own header. Edit, commit
# (`git commit --fixup` / `git rebase -i pristine` to change an earlier patch), then run
# server_patch/regen.sh DIR to write the .patch files and `series` back from the commits.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
dir=${1:?usage: edit-tree.sh DIR}
[ ! -e "$dir" ] || { echo "edit-tree: $dir exists; pick a new directory" >&2; exit 1; }

# build_llama.sh fetches and verifies the sdist; reuse its cache of the extracted source.
source "$here/upstream.env"
cache=${LLAMA_SIDECAR_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/llama-sidecar}
pristine="$cache/src/llama.cpp-${SDIST_SHA256:0:16}"
if [ ! -f "$pristine/.extracted" ]; then
    echo "edit-tree: no extracted source yet; running build_llama.sh --stock --print-path first" >&2
    "$here/../build_llama.sh" --stock >/dev/null
fi
cp -a "$pristine" "$dir"
rm -rf "$dir/.extracted" "$dir/.git"
cd "$dir"
git init -q
git add -A -f
git -c user.name=pristine -c user.email=pristine@localhost commit -qm "pristine llama.cpp $LLAMA_CPP_COMMIT (llama-cpp-python $SDIST_VERSION)"
git tag pristine
grep -v '^\s*#' "$here/series" | sed '/^\s*$/d' | while read -r name; do
    git am -q --keep-cr "$here/$name" || { echo "edit-tree: $name does not apply" >&2; exit 1; }
done
echo "edit-tree: $dir ready: $(git rev-list --count pristine..HEAD) patch commit(s) on top of 'pristine'"
