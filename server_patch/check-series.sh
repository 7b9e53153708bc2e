#!/usr/bin/env bash
# Build every prefix of the series on its own and run the suites that exist at that point.
#
#   server_patch/check-series.sh [--from N] [--to N] [--fuzz-seeds N] [--build-only] DIR
#
# DIR is made with edit-tree.sh (or, if it exists, must be such a tree: its commits are used
# as they are). For each patch N of the series, in order, DIR is checked out at N and built as
# it is (build_llama.sh --stock --src DIR: incremental, ccache); then
#
# * every prefix: llama.cpp's own server suite (python -m tests.upstream.suite), the stock
#   build's outcomes taken once and reused; a test that passes on stock must pass here;
# * from the patch whose name says "fixed-deadline-wait": tests/server/test_fixed_deadline_wait.py;
# * from the patch that passes the preemption options ("options-on-the-command-line"), which
#   is the first prefix where preemption can be switched on: all of tests/server, and a
#   sample of the fuzz harness (--fuzz-seeds, default 100). tests/server runs as make test runs
#   it: the parallel part on two workers, then the serial part.
#
# --build-only builds each prefix and runs nothing (the upstream suite takes 2-16 min a prefix,
# idle to loaded). A prefix that changes no file the build compiles (the web UI's patch) is not built again: the
# results of the prefix before it hold. One line per prefix goes to DIR.check/summary; the logs
# of each step are beside it.
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/.." && pwd)
from=1 to=999 fuzz_seeds=100 build_only=0
while [ $# -gt 1 ]; do
    case "$1" in
        --from) from=$2; shift 2 ;;
        --to) to=$2; shift 2 ;;
        --fuzz-seeds) fuzz_seeds=$2; shift 2 ;;
        --build-only) build_only=1; shift ;;
        *) echo "check-series: unknown option $1" >&2; exit 2 ;;
    esac
done
dir=${1:?usage: check-series.sh [--from N] [--to N] [--fuzz-seeds N] [--build-only] DIR}
[ -e "$dir" ] || "$here/edit-tree.sh" "$dir" || exit 1
dir=$(cd "$dir" && pwd)
git -C "$dir" rev-parse -q --verify pristine >/dev/null || { echo "check-series: $dir has no 'pristine' tag" >&2; exit 1; }
# the series is the branch DIR has checked out (a run stopped half way leaves HEAD detached at a
# prefix: then the branch edit-tree.sh made)
branch=$(git -C "$dir" symbolic-ref -q --short HEAD || echo master)
tip=$(git -C "$dir" rev-parse "$branch")
mapfile -t commits < <(git -C "$dir" rev-list --reverse "pristine..$tip")
out="$dir.check"
mkdir -p "$out"
py="$repo/.venv/bin/python"
summary="$out/summary"
say() { echo "$*" | tee -a "$summary"; }

stock=$("$repo/build_llama.sh" --stock --quiet) || { echo "check-series: no stock build" >&2; exit 1; }
stock_json="$out/upstream-stock.json"
if [ "$build_only" = 0 ] && [ ! -f "$stock_json" ]; then
    echo "check-series: the upstream suite on stock (once)"
    (cd "$repo" && nice -n 10 "$py" -m tests.upstream.suite --patched "$stock" --stock "$stock" \
        --json "$stock_json" > "$out/upstream-stock.log" 2>&1)
fi

status=0
prev=""
for i in "${!commits[@]}"; do
    n=$((i + 1))
    c=${commits[$i]}
    name=$(printf '%04d %s' "$n" "$(git -C "$dir" log -1 --format=%s "$c")")
    if [ "$n" -lt "$from" ] || [ "$n" -gt "$to" ]; then prev=$c; continue; fi
    if [ -n "$prev" ] && git -C "$dir" diff --quiet "$prev" "$c" -- . ':!tools/ui'; then
        say "$name: changes only tools/ui (not built by --stock): the results of the prefix before hold"
        prev=$c
        continue
    fi
    git -C "$dir" checkout -q --detach "$c"
    tag=$(printf '%04d' "$n")
    t0=$(date +%s)
    if ! bin=$(nice -n 10 "$repo/build_llama.sh" --stock --src "$dir" --quiet 2> "$out/$tag-build.log" | tail -1) || [ ! -x "$bin" ]; then
        say "$name: BUILD FAILED ($out/$tag-build.log)"
        status=1
        prev=$c
        continue
    fi
    line="$name: built in $(( $(date +%s) - t0 )) s"
    if [ "$build_only" = 1 ]; then
        say "$line"
        prev=$c
        continue
    fi
    (cd "$repo" && nice -n 10 "$py" -m tests.upstream.suite --patched "$bin" --stock-from "$stock_json" \
        > "$out/$tag-upstream.log" 2>&1)
    rc=$?
    line="$line; upstream suite: $(grep -E '^patched \(' "$out/$tag-upstream.log" | sed 's/^patched ([^)]*): //') rc=$rc"
    [ "$rc" = 0 ] || status=1
    # the subjects first, then grep: `git log | grep -q` under pipefail fails when grep stops reading early
    subjects=$(git -C "$dir" log --format=%s "pristine..$c")
    grep -q 'fixed-deadline wait' <<< "$subjects" && deadline=1 || deadline=0
    grep -q 'options on the command line' <<< "$subjects" && preempt=1 || preempt=0
    if [ "$preempt" = 1 ]; then
        # as make test runs them: the parallel part on two workers, then the serial part alone
        # test_build_script.py checks build_llama.sh's cache of its own build, not this one
        (cd "$repo" && LLAMA_SERVER_BIN=$bin nice -n 10 .venv/bin/pytest tests/server -q -n 2 --dist loadfile \
            --part parallel -p no:cacheprovider --deselect tests/server/test_build_script.py::test_print_path_is_the_cached_binary \
            > "$out/$tag-server.log" 2>&1)
        rc=$?
        line="$line; tests/server: $(tail -1 "$out/$tag-server.log") rc=$rc"
        [ "$rc" = 0 ] || status=1
        (cd "$repo" && LLAMA_SERVER_BIN=$bin nice -n 10 .venv/bin/pytest tests/server -q --part serial \
            -p no:cacheprovider > "$out/$tag-serial.log" 2>&1)
        rc=$?
        line="$line; serial: $(tail -1 "$out/$tag-serial.log") rc=$rc"
        [ "$rc" = 0 ] || status=1
        (cd "$repo" && FUZZ_SEEDS=$fuzz_seeds LLAMA_SERVER_BIN=$bin nice -n 10 .venv/bin/pytest tests/server/test_preempt_fuzz.py \
            -q -n 2 -p no:cacheprovider > "$out/$tag-fuzz.log" 2>&1)
        rc=$?
        line="$line; fuzz ($fuzz_seeds seeds): $(tail -1 "$out/$tag-fuzz.log") rc=$rc"
        [ "$rc" = 0 ] || status=1
    elif [ "$deadline" = 1 ]; then
        (cd "$repo" && LLAMA_SERVER_BIN=$bin nice -n 10 .venv/bin/pytest tests/server/test_fixed_deadline_wait.py -q \
            -p no:cacheprovider > "$out/$tag-server.log" 2>&1)
        rc=$?
        line="$line; test_fixed_deadline_wait: $(tail -1 "$out/$tag-server.log") rc=$rc"
        [ "$rc" = 0 ] || status=1
    fi
    say "$line"
    prev=$c
done
git -C "$dir" checkout -q "$branch"
exit $status
