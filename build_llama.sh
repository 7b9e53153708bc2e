#!/usr/bin/env bash
# Build the patched (or, with --stock, the pristine) llama-server from the pinned source.
#
#   build_llama.sh [--stock] [--native | --cuda] [--no-ui] [--src DIR] [--jobs N] [--print-path] [--quiet]
#
# The source is the vendor/llama.cpp tree of the llama-cpp-python sdist named in
# server_patch/upstream.env, fetched once with pip and verified by sha256. The patches in
# server_patch/series are applied in order. The patched server embeds llama.cpp's web UI
# (tools/ui, built with npm; cached, keyed by its sources); the stock one is the pristine
# source without it. The binary is cached outside the work tree, keyed by source + patches +
# flags, so a second call with the same inputs is instant.
# Progress goes to stderr; the path of the built binary is the only line on stdout.
set -euo pipefail
# The whole script is one compound command, parsed before it runs: editing this file while a
# build is in progress cannot change what that build does.
{
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
patch_dir="$here/server_patch"
# shellcheck source=server_patch/upstream.env
source "$patch_dir/upstream.env"

cache=${LLAMA_SIDECAR_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/llama-sidecar}
python=${PYTHON:-python3}
stock=0 native=0 cuda=0 src="" print_only=0 quiet=0 no_ui=0
jobs=${JOBS:-$(nproc 2>/dev/null || echo 2)}

say()  { [ "$quiet" = 1 ] || printf '\033[1m[build_llama]\033[0m %s\n' "$*" >&2; }
elapsed() { local s=$((SECONDS - $1)); printf '%dm%02ds' $((s / 60)) $((s % 60)); }
die()  { printf '\033[1;31m[build_llama] error:\033[0m %s\n' "$1" >&2; [ $# -lt 2 ] || printf '  what to do: %s\n' "$2" >&2; exit 1; }
usage() { sed -n '2,12p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; cat <<EOF

Options:
  --stock        build the pinned source without the patch series (own cache slot)
  --native       optimise for this CPU (-DGGML_NATIVE=ON; may SIGILL on AMX machines)
  --cuda         build the CUDA backend (CUDA_ARCH env, default "native")
  --no-ui        leave the web UI out (the API is the same; no chat page at /)
  --src DIR      use a local llama.cpp checkout instead of the pinned sdist
  --jobs N       parallel compile jobs (default: all cores)
  --print-path   print where the binary is (or would be) and exit; 1 if not built yet
  --quiet        no progress output
Environment: LLAMA_SIDECAR_CACHE (now: $cache), JOBS, CUDA_ARCH (--cuda), PYTHON (for pip),
LLAMA_CMAKE_ARGS (extra cmake options, part of the cache key).
EOF
}

while [ $# -gt 0 ]; do
    case "$1" in
        --stock) stock=1 ;;
        --native) native=1 ;;
        --cuda) cuda=1 ;;
        --no-ui) no_ui=1 ;;
        --src) [ $# -ge 2 ] || die "--src needs a directory"; src=$(cd "$2" && pwd -P) || die "no such directory: $2"; shift ;;
        --jobs) [ $# -ge 2 ] || die "--jobs needs a number"; jobs=$2; shift ;;
        --print-path) print_only=1 ;;
        --quiet) quiet=1 ;;
        -h|--help) usage; exit 0 ;;
        *) usage >&2; die "unknown option: $1" "run $0 --help" ;;
    esac
    shift
done
[ "$native" = 1 ] && [ "$cuda" = 1 ] && die "--native and --cuda are exclusive"

# ---- the web UI: whether this build embeds it ------------------------------------------------
# The patched build embeds llama.cpp's own web UI (tools/ui, SvelteKit), built with npm from the
# lock file as shipped; it needs node and npm. The stock build stays the pristine source as
# upstream's CMake builds it by default: no UI.
ui=0
if [ "$stock" = 0 ] && [ "$no_ui" = 0 ]; then
    if [ -n "$src" ] && [ ! -f "$src/tools/ui/package.json" ]; then
        ui=0  # a tree without the UI's sources
    elif command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1; then
        ui=1
    elif [ "$print_only" = 0 ]; then
        say "node/npm not found: building llama-server without its web UI (the API works; apt-get install nodejs npm for the chat page)"
    fi
fi

# ---- the configuration that defines a build --------------------------------------------------
cmake_flags=(
    -DCMAKE_BUILD_TYPE=Release
    -DBUILD_SHARED_LIBS=OFF
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF
    -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON
    "-DLLAMA_BUILD_UI=$([ "$ui" = 1 ] && echo ON || echo OFF)" -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_HTML=OFF
    -DLLAMA_OPENSSL=OFF
)
# With the UI, its assets are built here (below, cached) into tools/ui/dist, which CMake's
# scripts/ui-assets.cmake takes before anything else and embeds (never a download: the
# prebuilt-UI download stays off).
if [ "$native" = 1 ]; then
    cmake_flags+=(-DGGML_NATIVE=ON)
    variant=native
else
    # Portable baseline: GGML_NATIVE would enable AMX here, and quantized matmuls then SIGILL.
    cmake_flags+=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON)
    variant=cpu
fi
if [ "$cuda" = 1 ]; then
    cmake_flags+=(-DGGML_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCH:-native}")
    variant=cuda
fi
# Extra configure options (part of the cache key), e.g. LLAMA_CMAKE_ARGS="-DGGML_CUDA_FA=OFF".
# shellcheck disable=SC2206
[ -z "${LLAMA_CMAKE_ARGS:-}" ] || cmake_flags+=(${LLAMA_CMAKE_ARGS})
if command -v ccache >/dev/null 2>&1; then
    cmake_flags+=(-DGGML_CCACHE=ON)
    export CCACHE_DIR=${CCACHE_DIR:-$cache/ccache}
    export CCACHE_SLOPPINESS=${CCACHE_SLOPPINESS:-time_macros,include_file_mtime,include_file_ctime}
else
    cmake_flags+=(-DGGML_CCACHE=OFF)
fi

series_files=()
if [ "$stock" = 0 ]; then
    [ -f "$patch_dir/series" ] || die "missing $patch_dir/series" "restore it from git"
    while IFS= read -r line || [ -n "$line" ]; do
        line=${line%%#*}; line=$(echo "$line" | xargs)
        [ -z "$line" ] && continue
        [ -f "$patch_dir/$line" ] || die "series names $line but $patch_dir/$line does not exist" \
            "fix server_patch/series or restore the patch from git"
        series_files+=("$patch_dir/$line")
    done < "$patch_dir/series"
fi

if [ -n "$src" ]; then
    src_id="src:$src"
else
    src_id="sdist:$SDIST_SHA256"
fi
key=$( {
    echo "$src_id"
    echo "stock=$stock variant=$variant cuda_arch=${CUDA_ARCH:-native}"
    printf '%s\n' "${cmake_flags[@]}" | grep -v CCACHE
    for f in "${series_files[@]}"; do echo "== $(basename "$f")"; cat "$f"; done
} | sha256sum | cut -c1-16)
kind=$([ "$stock" = 1 ] && echo stock || echo patched)
out_dir="$cache/bin/$kind-$variant-$key"
binary="$out_dir/llama-server"

if [ "$print_only" = 1 ]; then
    echo "$binary"
    [ -x "$binary" ]
    exit
fi
if [ -z "$src" ] && [ -x "$binary" ]; then
    say "cached: $binary"
    echo "$binary"
    exit 0
fi

# ---- obtain the source ----------------------------------------------------------------------
need() { command -v "$1" >/dev/null 2>&1 || die "$1 is not installed" "$2"; }
need cmake "install it (apt-get install cmake)"
need patch "install it (apt-get install patch)"
need g++ "install a C++ compiler (apt-get install g++)"

if [ -z "$src" ]; then
    sdist="$cache/sdist/$SDIST_FILE"
    if [ ! -f "$sdist" ]; then
        say "downloading $SDIST_NAME==$SDIST_VERSION (sdist, about 75 MB) with pip"
        mkdir -p "$cache/sdist"
        tmp=$(mktemp -d "$cache/sdist/dl.XXXXXX")
        "$python" -m pip download --quiet --no-deps --no-binary :all: --no-build-isolation \
            "$SDIST_NAME==$SDIST_VERSION" -d "$tmp" >&2 2>/dev/null \
          || "$python" -m pip download --quiet --no-deps --no-binary :all: \
            "$SDIST_NAME==$SDIST_VERSION" -d "$tmp" >&2 \
          || { rm -rf "$tmp"; die "pip could not download $SDIST_NAME==$SDIST_VERSION" \
                 "check the package index is reachable, or pass --src DIR with a llama.cpp checkout"; }
        mv "$tmp/$SDIST_FILE" "$sdist"; rm -rf "$tmp"
    fi
    got=$(sha256sum "$sdist" | cut -d' ' -f1)
    if [ "$got" != "$SDIST_SHA256" ]; then
        rm -f "$sdist"
        die "sha256 mismatch for $SDIST_FILE (got $got, want $SDIST_SHA256)" \
            "the file was removed; run again to download it afresh"
    fi
    pristine="$cache/src/llama.cpp-${SDIST_SHA256:0:16}"
    if [ ! -f "$pristine/.extracted" ]; then
        say "extracting vendor/llama.cpp"
        rm -rf "$pristine"; mkdir -p "$pristine"
        tar -xzf "$sdist" -C "$pristine" --strip-components=3 "${SDIST_FILE%.tar.gz}/vendor/llama.cpp"
        touch "$pristine/.extracted"
    fi
else
    pristine=$src
    [ -f "$pristine/tools/server/server-context.cpp" ] || die "$src does not look like a llama.cpp tree" \
        "point --src at the root of a llama.cpp checkout"
fi

# ---- prepare the tree: pristine copy (mtimes kept, so rebuilds are incremental) + series ------
# The patched and the stock build share one source path ($work/src) and have a build directory
# each. Paths end up inside what ccache hashes, and not only on the command line: llama.cpp's
# unity-build sources (generated in the build directory) #include each source by its absolute
# path. With one source path, every object whose sources the patches leave alone is the same
# for both builds, so the second build takes it from ccache.
work="$cache/work/$variant"
[ -z "$src" ] || work="$work-src-$(echo "$src" | sha256sum | cut -c1-8)"
tree="$work/src"
build="$work/build-$kind"
mkdir -p "$work" "$build"
# One build per tree at a time (the other kind would swap the tree under it); a build that
# waited may find the binary already made.
if command -v flock >/dev/null 2>&1; then
    exec 9>"$work/.lock"
    flock -n 9 || { say "another build of this tree is running; waiting for it"; flock 9; }
    if [ -z "$src" ] && [ -x "$binary" ]; then
        say "cached: $binary"
        echo "$binary"
        exit 0
    fi
fi
rm -rf "$tree.new"
say "preparing $kind tree in $tree"
cp -a "$pristine" "$tree.new"
rm -rf "$tree.new/.git"
changed=()  # files the series changes, relative to the tree
for f in "${series_files[@]}"; do
    name=$(basename "$f")
    if ! out=$(patch -d "$tree.new" -p1 --forward --batch --no-backup-if-mismatch -r - < "$f" 2>&1); then
        printf '%s\n' "$out" >&2
        rm -rf "$tree.new"
        die "patch $name does not apply (the hunks that failed are listed above)" \
            "rebase it on the pinned source: see server_patch/README.md (edit tree, then regenerate)"
    fi
    while IFS= read -r file; do changed+=("$file"); done < <(printf '%s\n' "$out" | sed -n 's/^patching file //p')
    say "applied $name"
done
# A file the series changed for this build directory's last build but not now is back to its
# pristine (older) mtime, and make would keep the objects made from the patched text: touch
# every file changed then or now, so that make recompiles what includes them (ccache makes
# that cheap when the text is one it has seen).
touched="$build/.series-files"
stale=()
[ -f "$touched" ] && mapfile -t stale < "$touched"
for file in "${stale[@]}" "${changed[@]}"; do
    [ -n "$file" ] && [ -e "$tree.new/$file" ] && touch "$tree.new/$file"
done
# Until this build succeeds, its objects may come from either text: keep both lists.
printf '%s\n' "${stale[@]}" "${changed[@]}" | sed '/^$/d' | sort -u > "$touched"
rm -rf "$tree"; mv "$tree.new" "$tree"

# ---- the web UI's assets ----------------------------------------------------------------------
# Built once per content of the tree's tools/ui (the pinned sources, our UI patch, the lock
# file) and node version, into $cache/ui/dist-KEY, and copied into tools/ui/dist, where CMake
# finds them. node_modules stays in $cache/ui/work and is installed again (`npm ci`, the lock
# file as shipped) only when the lock file changes. The npm output goes to a log; the terminal
# gets one line when it starts and one when it is done.
# A UI not cached yet is built in the background, beside the compile: npm ci mostly waits on
# the network and the disk, and vite on one core at a time, while none of the libraries
# llama-server links needs the page (only llama-server's own target embeds it, compiled last).
ui_failed() {
    echo "---- last lines of $ui_log ----" >&2
    tail -20 "$ui_log" >&2
    die "the web UI's $1 failed after $(elapsed "$ui_t0") (full log: $ui_log)" \
        "read the log's end above (npm ci needs the npm registry, or its cache); to build without the chat page: $0 --no-ui"
}
build_ui() {  # runs in the background: no terminal output; $ui_status says which step failed
    local work="$ui_cache/work"
    [ ! -f "$ui_out/index.html" ] || return 0  # another build made it while this one waited
    mkdir -p "$work"
    find "$work" -mindepth 1 -maxdepth 1 ! -name node_modules -exec rm -rf {} +
    cp -a "$ui_src/." "$work/"
    : > "$ui_log"
    if [ "$ui_install" = 1 ]; then
        echo "\$ npm ci --no-audit --no-fund" >>"$ui_log"
        (cd "$work" && npm ci --no-audit --no-fund) >>"$ui_log" 2>&1 || { echo "npm ci" > "$ui_status"; return 1; }
        mkdir -p "$work/node_modules"; echo "$ui_lock_sum" > "$work/node_modules/.llama-sidecar-lock"
    fi
    rm -rf "$ui_out.new"
    echo "\$ npm run build" >>"$ui_log"
    (cd "$work" && LLAMA_UI_OUT_DIR="$ui_out.new" npm run build) >>"$ui_log" 2>&1 \
        || { echo "build (npm run build)" > "$ui_status"; return 1; }
    [ -f "$ui_out.new/index.html" ] || { echo "build (no index.html in its output)" > "$ui_status"; return 1; }
    rm -rf "$ui_out"; mv "$ui_out.new" "$ui_out"
}
ui_info="none" ui_pid=""
if [ "$ui" = 1 ]; then
    ui_src="$tree/tools/ui"
    [ -f "$ui_src/package.json" ] || die "the tree has no tools/ui/package.json" "build without the web UI: $0 --no-ui"
    ui_key=$( { node --version; cd "$ui_src" && find . \( -name node_modules -o -name dist \) -prune -o -type f -print0 \
                | LC_ALL=C sort -z | xargs -0 sha256sum; } | sha256sum | cut -c1-16)
    ui_cache="$cache/ui"
    ui_out="$ui_cache/dist-$ui_key"
    ui_log="$ui_cache/build.log"
    ui_status="$work/ui-failed-step"
    mkdir -p "$ui_cache"
    rm -rf "$ui_src/dist" "$ui_status"
    if [ -f "$ui_out/index.html" ]; then
        say "web UI: cached ($ui_out)"
    else
        ui_lock_sum=$(sha256sum "$ui_src/package-lock.json" | cut -d' ' -f1) ui_install=1
        [ "$(cat "$ui_cache/work/node_modules/.llama-sidecar-lock" 2>/dev/null)" != "$ui_lock_sum" ] || ui_install=0
        say "building the web UI from tools/ui: $([ "$ui_install" = 1 ] && echo "npm ci, ")vite build, beside the compile (log: $ui_log)"
        ui_t0=$SECONDS
        # Its own process group (job control, for this one job), so that a failed build can
        # stop it with all of npm's children. One UI build at a time (the variants share the
        # work directory).
        set -m
        (
            exec 8>"$ui_cache/.lock"
            if command -v flock >/dev/null 2>&1; then flock 8; fi
            build_ui
        ) </dev/null &
        ui_pid=$!
        set +m
    fi
    ui_info="$ui_out"
fi
ui_stop() { [ -z "$ui_pid" ] || kill -TERM -- "-$ui_pid" 2>/dev/null || true; }
trap ui_stop EXIT

# ---- configure and build ----------------------------------------------------------------------
# The compiler's output goes to the log (kept in the cache); the terminal gets one progress
# line: the step, make's percentage and the elapsed time (rewritten in place on a terminal,
# a new line every 25% elsewhere). On failure the first errors and the log's tail are shown.
log="$work/build-$kind.log"
say "configuring ($variant$([ "$stock" = 1 ] && echo ', stock'))"
cmake -S "$tree" -B "$build" "${cmake_flags[@]}" >"$work/configure-$kind.log" 2>&1 \
    || { tail -30 "$work/configure-$kind.log" >&2; die "cmake configure failed (log: $work/configure-$kind.log)" \
         "install the missing dependency named above$([ "$cuda" = 1 ] && echo ' (CUDA toolkit for --cuda)')"; }
# ccache also keys on the compiler's command line: with the base dir at $work, the paths of
# the source tree and of both build directories (the -I of generated headers) become relative
# and so the same for both builds.
export CCACHE_BASEDIR=$work
export CCACHE_STATSLOG="$work/ccache-$kind.log"
rm -f "$CCACHE_STATSLOG"
progress() {  # runs in the background while the compiler runs; reads the log
    set +e +o pipefail  # a log without a percentage yet must not end the loop
    local t0=$1 pct last=-1 tty=0
    if [ -t 2 ]; then tty=1; fi
    while sleep 1; do
        pct=$(grep -oE '^\[ *[0-9]+%\]' "$log" 2>/dev/null | tail -1 | tr -dc '0-9')
        pct=${pct:-0}
        if [ "$tty" = 1 ]; then
            printf '\r\033[1m[build_llama]\033[0m compiling %s llama-server: %3d%%  %s elapsed ' \
                "$kind" "$pct" "$(elapsed "$t0")" >&2
        elif [ $((pct / 25)) != "$last" ]; then
            last=$((pct / 25))
            say "compiling $kind llama-server: $pct%  $(elapsed "$t0") elapsed"
        fi
    done
}
say "compiling $kind llama-server with $jobs jobs (full log: $log)"
t_build=$SECONDS
monitor=""
compile_pid=""
cleanup() {
    [ -z "$monitor" ] || kill "$monitor" 2>/dev/null || true
    [ -z "$compile_pid" ] || kill -TERM -- "-$compile_pid" 2>/dev/null || true
    ui_stop
}
trap cleanup EXIT
if [ "$quiet" = 0 ]; then
    progress "$t_build" & monitor=$!
fi
status=0
: > "$log"
if [ -n "$ui_pid" ]; then
    # While the UI builds: the libraries llama-server links that do not need the page (those
    # of this tree; a --src tree may have none of them). In a process group of their own, so
    # that a UI build failing meanwhile stops them at once rather than after the compile.
    help=$(cmake --build "$build" --target help 2>/dev/null || true)
    before=()
    for target in server-context cpp-httplib; do
        if grep -qE "^\.\.\. $target( |\$)" <<<"$help"; then before+=("$target"); fi
    done
    if [ "${#before[@]}" -gt 0 ]; then
        set -m
        cmake --build "$build" --target "${before[@]}" -j "$jobs" </dev/null >>"$log" 2>&1 &
        compile_pid=$!
        set +m
        while kill -0 "$compile_pid" 2>/dev/null; do
            if [ -s "$ui_status" ]; then  # written as the UI build fails
                kill -TERM -- "-$compile_pid" 2>/dev/null || true
                break
            fi
            sleep 1
        done
        wait "$compile_pid" || status=$?
        compile_pid=""
    fi
    ui_rc=0
    if [ "$status" != 0 ] && [ ! -s "$ui_status" ]; then
        ui_stop  # the compile failed: its errors are reported below, the page is not needed
    else
        wait "$ui_pid" || ui_rc=$?
    fi
    ui_pid=""
    if [ -t 2 ] && [ -n "$monitor" ]; then printf '\r\033[K' >&2; fi  # the line replaces the progress line
    if [ "$ui_rc" != 0 ] && [ "$status" = 0 ] || [ -s "$ui_status" ]; then
        cleanup; monitor=""
        ui_failed "$(cat "$ui_status" 2>/dev/null || echo build)"
    fi
    [ "$status" != 0 ] || say "web UI built in $(elapsed "$ui_t0")"
fi
if [ "$ui" = 1 ] && [ "$status" = 0 ]; then
    cp -a "$ui_out" "$ui_src/dist"
fi
if [ "$status" = 0 ]; then
    cmake --build "$build" --target llama-server -j "$jobs" >>"$log" 2>&1 || status=$?
fi
if [ -n "$monitor" ]; then
    kill "$monitor" 2>/dev/null || true
    wait "$monitor" 2>/dev/null || true
    monitor=""
    if [ -t 2 ]; then printf '\n' >&2; fi
fi
if [ "$status" != 0 ] || [ ! -x "$build/bin/llama-server" ]; then
    if grep -qE 'error|Error' "$log"; then
        echo "---- first errors ----" >&2
        grep -m 40 -B2 -A6 -E 'error' "$log" | head -60 >&2
    fi
    echo "---- last lines of $log ----" >&2
    tail -25 "$log" >&2
    die "build failed after $(elapsed "$t_build") (full log: $log)" \
        "read the first error above; a patch that compiles on its own tree may need a rebase"
fi
hits=$(grep -cE '^(direct|preprocessed)_cache_hit' "$CCACHE_STATSLOG" 2>/dev/null || true)
misses=$(grep -cE '^cache_miss' "$CCACHE_STATSLOG" 2>/dev/null || true)
reuse=""
if [ -f "$CCACHE_STATSLOG" ]; then
    reuse=", ccache reused ${hits:-0} of $(( ${hits:-0} + ${misses:-0} )) compiles"
fi
say "compiled in $(elapsed "$t_build")$reuse"
printf '%s\n' "${changed[@]}" | sed '/^$/d' | sort -u > "$touched"

mkdir -p "$out_dir"
cp "$build/bin/llama-server" "$binary.tmp" && mv "$binary.tmp" "$binary"
{ echo "source: $src_id"; echo "variant: $variant stock=$stock"; echo "web UI: $ui_info"; printf 'patch: %s\n' "${series_files[@]##*/}"; } > "$out_dir/BUILD-INFO"
cp "$log" "$out_dir/build.log"
say "done: $binary"
echo "$binary"
exit 0
}
