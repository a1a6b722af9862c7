#!/usr/bin/env bash
# Build the Docker image (the repository's Dockerfile) with docker when a daemon answers, else daemonless with
# buildah; optionally on a local stand-in for NVIDIA's PyTorch image, and optionally test it.
#
#   scripts/build_image.sh                      # docker build / buildah bud from BASE_IMAGE (NVIDIA's by default)
#   scripts/build_image.sh --stand-in           # debootstrap a Debian base with Python, pip and the CPU torch
#                                               # wheel, then build the image on it (buildah; needs root)
#   scripts/build_image.sh --stand-in --test    # ... then, inside the image: patches/apply.py --check,
#                                               # one training step, make test-quick; timings to --result FILE
#   scripts/build_image.sh --stand-in --smoke   # ... inside the image: patches/apply.py --check, one training step
#   scripts/build_image.sh --remove             # delete BUILD_DIR (buildah's storage, everything this script
#                                               # left), only when this script made it (its marker file)
# --rebuild-base makes the stand-in base again even when buildah's storage has it (it is reused otherwise);
# --engine docker|buildah chooses the engine (default: docker when its daemon answers, else buildah).
#
# Environment: BASE_IMAGE (default: the Dockerfile's), IMAGE_TAG (nanotron_ext), BUILD_DIR (buildah storage and
# the stand-in's root file system; /var/tmp/nanotron_ext-image; a new or empty folder, which the script marks as its
# own with .nanotron_ext-build-dir: a folder holding anything else is refused, never written to or deleted),
# DEBIAN_MIRROR (default: the first of this machine's apt sources that serves DEBIAN_SUITE, so a local mirror or
# proxy is used as apt uses it; apt's Acquire::http::Proxy reaches debootstrap as http_proxy), DEBIAN_SUITE
# (bookworm), TORCH_SPEC (torch==2.13.0: the stand-in's torch), TORCH_INDEX_URL (where pip finds it,
# e.g. https://download.pytorch.org/whl/cpu for the CPU build; unset: pip's own configuration, which on this
# project's machines finds the CPU wheel on local disk), MIN_FREE_GB (20), CA_BUNDLE (a CA bundle for a
# TLS-intercepting proxy, mounted read-only over the base's /etc/ssl/certs/ca-certificates.crt while building;
# default: pip's own `cert` setting, when set; never copied into the image; buildah only). Every value is checked
# as a value (never evaluated): a bad one is refused in one line naming it, exit code 2, before any work.
# docs/profiling-and-benchmarks.md ("The Docker image") says which bases are supported and how nsys gets in.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
IMAGE_TAG=${IMAGE_TAG-nanotron_ext}  # unset: the default; set empty: refused below
BUILD_DIR=${BUILD_DIR-/var/tmp/nanotron_ext-image}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-}
DEBIAN_SUITE=${DEBIAN_SUITE-bookworm}
TORCH_SPEC=${TORCH_SPEC-torch==2.13.0}
MIN_FREE_GB=${MIN_FREE_GB-20}
STAND_IN_TAG=localhost/nanotron_ext-stand-in:${DEBIAN_SUITE}

BASE_S=null STAND_IN=0 TEST=0 SMOKE=0 REMOVE=0 REBUILD_BASE=0 ENGINE="" RESULT="" ENGINE_GIVEN=0 RESULT_GIVEN=0
usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
  case "$1" in
    --stand-in) STAND_IN=1 ;;
    --test) TEST=1 ;;
    --smoke) SMOKE=1 ;;
    --remove) REMOVE=1 ;;
    --rebuild-base) REBUILD_BASE=1 ;;
    --engine|--result)  # a value must follow (else one line naming the flag, exit 2; checked below)
      [ $# -ge 2 ] || { echo "build_image.sh: error: $1 needs a value" >&2; exit 2; }
      if [ "$1" = --engine ]; then ENGINE=$2 ENGINE_GIVEN=1; else RESULT=$2 RESULT_GIVEN=1; fi; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "build_image.sh: unknown option $1 (--help lists them)" >&2; exit 2 ;;
  esac
  shift
done

# --- every input, as a value: one line naming it, exit 2, before anything is made ---------------------------------
refuse() {  # refuse NAME VALUE WHY
  printf 'build_image.sh: error: %s=%q: %s\n' "$1" "$2" "$3" >&2; exit 2
}
check() {  # check NAME VALUE REGEX WHY: bash's =~ matches the text; nothing in it is run or expanded
  [[ $2 =~ $3 ]] || refuse "$1" "$2" "$4"
}
check MIN_FREE_GB "$MIN_FREE_GB" '^(0|[1-9][0-9]{0,6})$' "a whole number of GB, 0 to 9999999"
# a path: no control characters, none of the shell's own ($ ` ; | & < > \ ' "): a file name never needs them
SAFE='[^[:cntrl:]$`;|&<>\\"'"'"']'
check BUILD_DIR "$BUILD_DIR" "^/$SAFE*[^/[:cntrl:]]\$" "an absolute path other than /, none of the shell's characters"
check IMAGE_TAG "$IMAGE_TAG" '^[A-Za-z0-9][A-Za-z0-9._/:-]{0,254}$' "an image name: letters, digits and ._/:-"
check DEBIAN_SUITE "$DEBIAN_SUITE" '^[a-z][a-z0-9-]{0,40}$' "a Debian suite, e.g. bookworm"
check TORCH_SPEC "$TORCH_SPEC" '^[A-Za-z0-9][A-Za-z0-9._+=<>!~,-]{0,200}$' "a pip requirement, e.g. torch==2.13.0"
URL='^(https?|file)://[^][:space:][:cntrl:]\\"'"'"'`$;|&<>(){}]+$'
[ -z "$DEBIAN_MIRROR" ] || check DEBIAN_MIRROR "$DEBIAN_MIRROR" "$URL" "an http(s):// or file:// URL"
[ -z "${TORCH_INDEX_URL:-}" ] || check TORCH_INDEX_URL "$TORCH_INDEX_URL" "$URL" "an http(s):// or file:// URL"
[ $RESULT_GIVEN -eq 0 ] || check --result "$RESULT" "^$SAFE*[^/[:cntrl:]]\$" "a file path without the shell's characters"
[ -z "${CA_BUNDLE:-}" ] || check CA_BUNDLE "$CA_BUNDLE" "^$SAFE+\$" "a file path without the shell's characters"
[ $ENGINE_GIVEN -eq 0 ] || [[ $ENGINE =~ ^(docker|buildah)$ ]] || refuse --engine "$ENGINE" "docker or buildah"
# --result: replaced only when this script wrote it (its "written_by"; results from before the marker by their
# "image_build_s"), never a file it did not write
RESULT_MARK='"written_by": "scripts/build_image.sh"'
if [ -n "$RESULT" ] && { [ -e "$RESULT" ] || [ -L "$RESULT" ]; }; then
  { [ -f "$RESULT" ] && [ ! -L "$RESULT" ] && grep -qF -e "$RESULT_MARK" -e '"image_build_s":' "$RESULT"; } \
    || refuse --result "$RESULT" "exists and build_image.sh did not write it (no $RESULT_MARK); name a new file"
elif [ -n "$RESULT" ] && { [ -e "${RESULT%.json}-test-quick.log" ] || [ -L "${RESULT%.json}-test-quick.log" ]; }; then
  refuse --result "$RESULT" "${RESULT%.json}-test-quick.log (its log) exists without its result: not this script's"
fi

T0=$(date +%s)
say() { printf '[build_image %4ss] %s\n' "$(( $(date +%s) - T0 ))" "$*"; }
DIED=0
die() { echo "build_image.sh: error: $*" >&2; DIED=1; exit 1; }
need() {  # need TOOL HOW-TO-GET-IT
  command -v "$1" >/dev/null 2>&1 || die "$1 not found; install it: $2"
}

BUILDAH=(buildah --root "$BUILD_DIR/storage" --runroot "$BUILD_DIR/run" --storage-driver vfs)

# Everything this run creates that must not outlive it: working containers, the stand-in's root file system,
# the downloaded torch wheel. The built images stay in $BUILD_DIR/storage (--remove deletes them).
CONTAINERS=() TEMP_DIRS=()
cleanup() {
  local rc=$?
  set +e
  for c in "${CONTAINERS[@]}"; do "${BUILDAH[@]}" rm "$c" >/dev/null 2>&1; done
  for d in "${TEMP_DIRS[@]}"; do rm -rf --one-file-system "$d"; done
  # die() said why in one line; anything else (a failed command under set -e, a signal) is said here
  [ $rc -eq 0 ] || [ $DIED -eq 1 ] || [ $rc -eq 2 ] \
    || echo "build_image.sh: failed (exit $rc) after $(( $(date +%s) - T0 )) s; temporary files removed" >&2
  exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# BUILD_DIR is the script's own only when it made it (or found it empty) and marked it: the one rule for what it
# deletes. A folder holding anything else (the header advises a roomier disk: a user's folder) is refused.
MARKER=.nanotron_ext-build-dir
own_build_dir() {
  [ -L "$BUILD_DIR" ] && refuse BUILD_DIR "$BUILD_DIR" "a symbolic link; name the folder itself"
  [ -f "$BUILD_DIR/$MARKER" ] && [ ! -L "$BUILD_DIR/$MARKER" ] && return 0
  [ ! -e "$BUILD_DIR" ] || [ -d "$BUILD_DIR" ] || refuse BUILD_DIR "$BUILD_DIR" "not a folder"
  [ ! -d "$BUILD_DIR" ] || [ -z "$(ls -A "$BUILD_DIR")" ] || refuse BUILD_DIR "$BUILD_DIR" "holds files this script did \
not make (no $MARKER in it): it is never written to or deleted; name a new or empty folder"
  return 1
}
claim_build_dir() {  # BUILD_DIR, made and marked unless it is the script's already
  own_build_dir && return 0
  mkdir -p "$BUILD_DIR" || die "cannot create BUILD_DIR=$BUILD_DIR"
  echo "made by scripts/build_image.sh: --remove deletes this folder and everything in it" >"$BUILD_DIR/$MARKER"
}
if [ $REMOVE -eq 1 ]; then
  [ -e "$BUILD_DIR" ] || [ -L "$BUILD_DIR" ] || { say "nothing to remove at $BUILD_DIR"; exit 0; }
  own_build_dir || { rmdir "$BUILD_DIR"; say "removed the empty $BUILD_DIR"; exit 0; }
  command -v buildah >/dev/null 2>&1 && "${BUILDAH[@]}" rm --all >/dev/null 2>&1 || true
  command -v buildah >/dev/null 2>&1 && "${BUILDAH[@]}" rmi --all --force >/dev/null 2>&1 || true
  rm -rf --one-file-system "$BUILD_DIR"
  say "removed $BUILD_DIR"
  exit 0
fi

# --- choose the engine ------------------------------------------------------------------------------------------
if [ -z "$ENGINE" ]; then
  if [ $STAND_IN -eq 0 ] && command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then
    ENGINE=docker
  else
    ENGINE=buildah
  fi
fi
case "$ENGINE" in
  docker)
    [ $STAND_IN -eq 0 ] || die "--stand-in builds with buildah (the stand-in base lives in buildah's storage)"
    need docker "https://docs.docker.com/engine/install/ (or leave it out: buildah builds without a daemon)"
    docker info >/dev/null 2>&1 || die "docker is installed but no daemon answers (start it, or use --engine buildah)" ;;
  buildah)
    need buildah "apt-get install -y buildah (Debian/Ubuntu), dnf install buildah (Fedora)"
    [ "$(id -u)" -eq 0 ] || die "a daemonless build with --isolation chroot needs root (run it with sudo)" ;;
esac
if [ $STAND_IN -eq 1 ]; then
  need debootstrap "apt-get install -y debootstrap"
fi

# --- space --------------------------------------------------------------------------------------------------------
if [ "$ENGINE" = buildah ]; then
  claim_build_dir
  free_kb=$(df -Pk "$BUILD_DIR" | awk 'NR == 2 {print $4}')
  [ "$free_kb" -ge $(( MIN_FREE_GB * 1024 * 1024 )) ] || die "$(( free_kb / 1024 / 1024 )) GB free at $BUILD_DIR," \
    "at least $MIN_FREE_GB GB needed (the vfs driver stores each layer whole); set BUILD_DIR to a roomier disk"
fi

# --- the proxy's CA bundle (this project's machines reach PyPI through a TLS-intercepting proxy) -------------------
pip_cert() {  # no python3 (a bare host), or pip without the setting: none
  { python3 -m pip config list 2>/dev/null || true; } | sed -n "/\.cert='/{s/^[^=]*\.cert='\(.*\)'$/\1/p;q}"
}
CA_BUNDLE=${CA_BUNDLE-${PIP_CERT:-${SSL_CERT_FILE:-$(pip_cert)}}}
CA_MOUNT=()
if [ -n "$CA_BUNDLE" ] && [ "$ENGINE" = buildah ]; then
  [ -r "$CA_BUNDLE" ] || die "CA_BUNDLE=$CA_BUNDLE is not a readable file (unset it: CA_BUNDLE= )"
  CA_MOUNT=(--volume "$CA_BUNDLE:/etc/ssl/certs/ca-certificates.crt:ro")
fi

# --- the stand-in base ------------------------------------------------------------------------------------------
# The mirror apt itself uses for the suite: sources.list, then sources.list.d/*.list and *.sources (deb822) in
# apt's order; the files are read as text, nothing in them is run.
APT_LIST=/etc/apt/sources.list APT_PARTS=/etc/apt/sources.list.d/
apt_setting() {  # apt_setting NAME CONFIG-ITEM: apt-config's value, parsed from `apt-config shell` (never eval'd)
  command -v apt-config >/dev/null 2>&1 || return 0
  { apt-config shell "$1" "$2" 2>/dev/null || true; } | sed -n "/^$1='/{s/^$1='\(.*\)'$/\1/p;q}"
}
apt_paths() {
  APT_LIST=$(apt_setting LIST Dir::Etc::sourcelist/f); APT_LIST=${APT_LIST:-/etc/apt/sources.list}
  APT_PARTS=$(apt_setting PARTS Dir::Etc::sourceparts/d); APT_PARTS=${APT_PARTS:-/etc/apt/sources.list.d/}
}
apt_mirror() {
  local f uri
  for f in "$APT_LIST" "${APT_PARTS%/}"/*; do
    [ -f "$f" ] || continue
    uri=$(case "$f" in
      "$APT_LIST"|*.list) awk -v suite="$DEBIAN_SUITE" '$1 == "deb" {
          i = 2; if ($2 ~ /^\[/) { while (i <= NF && $i !~ /\]$/) i++; i++ }
          if ($(i + 1) == suite) { print $i; exit } }' "$f" ;;
      *.sources) awk -v suite="$DEBIAN_SUITE" 'BEGIN { RS = ""; FS = "\n" } {
          types = ""; uris = ""; suites = ""; enabled = "yes"
          for (j = 1; j <= NF; j++) if ($j !~ /^#/ && match($j, /^[A-Za-z-]+:/)) {
            key = tolower(substr($j, 1, RLENGTH - 1)); value = substr($j, RLENGTH + 1)
            if (key == "types") types = value; else if (key == "uris") uris = value
            else if (key == "suites") suites = value; else if (key == "enabled") enabled = tolower(value) }
          if (types !~ /(^|[ \t])deb([ \t]|$)/ || enabled ~ /no/) next
          n = split(suites, s, /[ \t]+/)
          for (k = 1; k <= n; k++) if (s[k] == suite) { split(uris, u, /[ \t]+/); print (u[1] != "" ? u[1] : u[2]); exit }
        }' "$f" ;;
    esac)
    [ -z "$uri" ] || { printf '%s\n' "$uri"; return 0; }
  done
}

make_stand_in() {
  local work rootfs wheels ctr mnt pyver
  if [ -z "$DEBIAN_MIRROR" ]; then
    apt_paths
    DEBIAN_MIRROR=$(apt_mirror)
    [ -n "$DEBIAN_MIRROR" ] || { printf 'build_image.sh: error: DEBIAN_MIRROR: no apt source of this machine serves %s' \
      "$DEBIAN_SUITE" >&2; printf ' (read %s and %s); set DEBIAN_MIRROR to a Debian mirror'"'"'s URL\n' "$APT_LIST" \
      "$APT_PARTS" >&2; exit 2; }
    check DEBIAN_MIRROR "$DEBIAN_MIRROR" "$URL" "read from $APT_LIST or $APT_PARTS: not an http(s):// or file:// URL"
  fi
  if [ -z "${http_proxy:-}" ]; then  # apt's own proxy, if it has one, for debootstrap's downloads
    http_proxy=$(apt_setting PROXY Acquire::http::Proxy)
    [ -z "$http_proxy" ] || { check Acquire::http::Proxy "$http_proxy" "$URL" "an http(s):// URL"; export http_proxy; }
  fi
  work=$(mktemp -d "$BUILD_DIR/stand-in.XXXXXX"); TEMP_DIRS+=("$work")
  rootfs=$work/rootfs wheels=$work/wheels
  say "stage 1/4: debootstrap $DEBIAN_SUITE from $DEBIAN_MIRROR (a few minutes)"
  # What NVIDIA's image has that the Dockerfile and the tests use: python with pip, make, a C compiler, patch, git.
  debootstrap --variant=minbase \
    --include=python3,python3-pip,python3-venv,python3-dev,python-is-python3,make,gcc,g++,patch,git,ca-certificates \
    "$DEBIAN_SUITE" "$rootfs" "$DEBIAN_MIRROR" >"$work/debootstrap.log" 2>&1 \
    || { tail -5 "$work/debootstrap.log" >&2; die "debootstrap failed (log above; is $DEBIAN_MIRROR reachable?)"; }
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  pyver=$(chroot "$rootfs" python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')

  say "stage 2/4: the torch wheel ($TORCH_SPEC, CPython $pyver) and the stand-in image $STAND_IN_TAG"
  # pip download on the host, for the stand-in's Python: on this project's machines pip's configuration finds the
  # CPU wheel on local disk; elsewhere TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu gives the CPU build.
  mkdir -p "$wheels"
  python3 -m pip download -q --no-deps --only-binary=:all: --dest "$wheels" \
    --python-version "$pyver" --implementation cp --platform "manylinux_2_28_$(uname -m)" \
    ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "$TORCH_SPEC" \
    || die "no $TORCH_SPEC wheel for CPython $pyver (set TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu)"
  ctr=$("${BUILDAH[@]}" from scratch); CONTAINERS+=("$ctr")
  mnt=$("${BUILDAH[@]}" mount "$ctr")
  cp -a "$rootfs/." "$mnt/"
  rm -rf "$rootfs"
  # NVIDIA's image installs into its own Python with pip; Debian marks its Python externally managed.
  printf '[global]\nbreak-system-packages = true\nno-cache-dir = true\n' >"$mnt/etc/pip.conf"
  cp "$wheels"/torch-*.whl "$mnt/tmp/"
  "${BUILDAH[@]}" umount "$ctr" >/dev/null
  "${BUILDAH[@]}" run --isolation chroot "${CA_MOUNT[@]}" "$ctr" -- sh -c \
    'python3 -m pip install -q /tmp/torch-*.whl && rm /tmp/torch-*.whl' \
    || die "installing torch into the stand-in failed (its dependencies come from PyPI)"
  "${BUILDAH[@]}" config --env LANG=C.UTF-8 --cmd bash --label nanotron_ext.stand-in="$DEBIAN_SUITE $TORCH_SPEC" "$ctr"
  "${BUILDAH[@]}" commit -q --rm "$ctr" "$STAND_IN_TAG" >/dev/null
  CONTAINERS=()
  rm -rf "$work"
}

if [ $STAND_IN -eq 1 ]; then
  if [ $REBUILD_BASE -eq 0 ] && "${BUILDAH[@]}" inspect --type image "$STAND_IN_TAG" >/dev/null 2>&1; then
    say "stages 1-2/4: reusing the stand-in base $STAND_IN_TAG (--rebuild-base makes it again)"
  else
    T_BASE=$(date +%s)
    make_stand_in
    BASE_S=$(( $(date +%s) - T_BASE ))
    say "stand-in base made in ${BASE_S} s"
  fi
  BASE_IMAGE=$STAND_IN_TAG
fi
BUILD_ARGS=()
[ -n "${BASE_IMAGE:-}" ] && BUILD_ARGS=(--build-arg "BASE_IMAGE=$BASE_IMAGE")
BASE_SHOWN=${BASE_IMAGE:-$(sed -n 's/^ARG BASE_IMAGE=//p' "$REPO/Dockerfile")}

# --- the image ------------------------------------------------------------------------------------------------------
say "stage 3/4: building $IMAGE_TAG from $BASE_SHOWN with $ENGINE"
T_BUILD=$(date +%s)
if [ "$ENGINE" = docker ]; then
  docker build "${BUILD_ARGS[@]}" -t "$IMAGE_TAG" "$REPO"
  SIZE=$(docker image inspect --format '{{.Size}}' "$IMAGE_TAG")
else
  PULL=(); [ $STAND_IN -eq 1 ] && PULL=(--pull=never)
  "${BUILDAH[@]}" bud --isolation chroot --layers=false "${PULL[@]}" "${BUILD_ARGS[@]}" "${CA_MOUNT[@]}" \
    -f "$REPO/Dockerfile" -t "$IMAGE_TAG" "$REPO"
  # bytes: the sum of the image's (uncompressed) layers, as its manifest lists them
  "${BUILDAH[@]}" rmi --prune >/dev/null 2>&1 || true  # the image this tag named before, if any (GBs under vfs)
  SIZE=$("${BUILDAH[@]}" inspect --type image --format '{{.Manifest}}' "$IMAGE_TAG" \
    | python3 -c 'import json, sys; print(sum(layer["size"] for layer in json.load(sys.stdin)["layers"]))')
fi
BUILD_S=$(( $(date +%s) - T_BUILD ))
say "built $IMAGE_TAG in ${BUILD_S} s ($(( SIZE / 1000000 )) MB); whole run so far $(( $(date +%s) - T0 )) s"

if [ $TEST -eq 0 ] && [ $SMOKE -eq 0 ]; then
  [ "$ENGINE" = buildah ] && say "run it: ${BUILDAH[*]} run --isolation chroot \$(${BUILDAH[*]} from $IMAGE_TAG) -- bash"
  exit 0
fi

# --- inside the image: the patches, one training step, the quick tests ------------------------------------------------
say "stage 4/4: inside $IMAGE_TAG: patches/apply.py --check, one training step$([ $TEST -eq 1 ] && echo ', make test-quick')"
in_image() {
  if [ "$ENGINE" = docker ]; then docker run --rm --ipc=host "$IMAGE_TAG" bash -c "set -o pipefail; $1"
  # a hostname its /etc/hosts resolves: buildah leaves the container's own name (its id) out of it, and
  # torchrun's agent publishes its store under that name (workers never start; docker adds the name)
  else "${BUILDAH[@]}" run --isolation chroot --hostname localhost "$CTR" -- bash -c "set -o pipefail; $1"; fi
}
if [ "$ENGINE" = buildah ]; then CTR=$("${BUILDAH[@]}" from --pull=never "$IMAGE_TAG"); CONTAINERS+=("$CTR"); fi
in_image 'python patches/apply.py --check' || die "patches/apply.py --check failed inside the image"
VERSIONS=$(in_image 'python -c "import sys, torch; print(sys.version.split()[0], torch.__version__)"')
say "inside the image: Python and torch $VERSIONS; command -v nsys: $(in_image 'command -v nsys || echo none')"
T_STEP=$(date +%s)
# one optimizer step of the tiny Llama, data parallel on 2 processes (gloo), on data prepared from the embedded corpus
in_image 'python -m nanotron_ext.data prepare --config-file examples/config_tiny_llama.yaml >/dev/null \
  && OMP_NUM_THREADS=1 python -m nanotron_ext.launch --nproc_per_node=2 -m nanotron_ext.train --config-file examples/config_tiny_llama.yaml \
     --set tokens.train_steps=1 --set tokens.val_check_interval=0 --set checkpoints.interval=0 \
     --set general.run=image_one_step 2>&1 | tail -8'
STEP_S=$(( $(date +%s) - T_STEP ))
say "one training step inside the image: ${STEP_S} s"
if [ $TEST -eq 0 ]; then exit 0; fi
T_TEST=$(date +%s)
LOG=${RESULT:+${RESULT%.json}-test-quick.log}
[ -n "$LOG" ] || { claim_build_dir; LOG=$BUILD_DIR/test-quick.log; }  # (docker: BUILD_DIR holds only this log)
set +e
in_image 'make test-quick' >"$LOG" 2>&1
TEST_RC=$?
set -e
TEST_S=$(( $(date +%s) - T_TEST ))
tail -15 "$LOG"
SUMMARY=$(tail -1 "$LOG" | tr -d '=' | sed 's/^ *//; s/ *$//')
[ $TEST_RC -eq 0 ] || die "make test-quick failed inside the image: $SUMMARY (whole output: $LOG)"
say "inside the image: patches verified, one training step (${STEP_S} s), make test-quick: $SUMMARY (${TEST_S} s)"
if [ -n "$RESULT" ]; then
  ENGINE=$ENGINE BASE=$BASE_SHOWN TAG=$IMAGE_TAG VERSIONS=$VERSIONS BASE_S=$BASE_S BUILD_S=$BUILD_S SIZE=$SIZE \
  STEP_S=$STEP_S TEST_S=$TEST_S SUMMARY=$SUMMARY TOTAL_S=$(( $(date +%s) - T0 )) python3 - "$RESULT" <<'EOF'
import json, os, platform, re, sys, time
e = os.environ
py, torch = e["VERSIONS"].split()
counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|skipped|deselected|errors?)", e["SUMMARY"])}
gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
json.dump({"written_by": "scripts/build_image.sh",  # the marker: --result replaces only a file it wrote
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "engine": e["ENGINE"],
           "machine": f"{os.cpu_count()} cores, {platform.machine()}, {gib:.0f} GiB, {platform.system()} "
                      f"{platform.release()}",
           "base_image": e["BASE"], "image": e["TAG"], "image_python": py, "image_torch": torch,
           "stand_in_base_s": None if e["BASE_S"] == "null" else int(e["BASE_S"]), "image_build_s": int(e["BUILD_S"]),
           "image_bytes": int(e["SIZE"]), "one_step_s": int(e["STEP_S"]), "test_quick_s": int(e["TEST_S"]),
           "test_quick": e["SUMMARY"], "test_quick_counts": counts, "total_s": int(e["TOTAL_S"])},
          open(sys.argv[1], "w"), indent=1)
EOF
  say "wrote $RESULT and $LOG"
fi
