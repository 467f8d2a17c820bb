#!/usr/bin/env bash
# Peer kits: wheels too large for one GPU-machine call (64 MiB a call, the repo included), carried
# there in parts over several calls while the machine stays warm, then checked and installed.
#
# A kit is a folder (git-ignored, e.g. .peers_fa4/) holding, once packed:
#   <kit>.part01, <kit>.part02, ...  one xz-compressed tar cut into pieces of at most PART_BYTES
#   SHA256SUMS                       sha256 of the original wheels (as downloaded)
#   PARTS                            sha256 of every part, in order (says how many parts there are)
# where <kit> is the folder's name without a leading dot (.peers_fa4 -> peers_fa4). Inside the tar:
#   wheels/<w>.whl      small wheels as downloaded
#   trees/<w>.whl/...   large wheels unpacked (a wheel is a zip: its deflate packs them far worse
#                       than xz -9 over the whole tree does); rebuilt into <w>.whl at install
#   TREES.sha256        sha256 of every file of every tree (taken from the original wheel's files)
#   SHA256SUMS          as above
#
# Usage (from the repo root):
#   bash tools/gpu/peer_kit.sh pack KIT_DIR            here, where the wheels were downloaded into KIT_DIR
#   bash tools/gpu/peer_kit.sh stage KIT_DIR           GPU machine: copy the parts (and manifests) present
#                                                      in KIT_DIR to $PEER_KITS_ROOT/<kit>/ (/tmp/peer_kits):
#                                                      one call per part, they accumulate while it stays warm
#   bash tools/gpu/peer_kit.sh install KIT_DIR TARGET  GPU machine: stage what KIT_DIR holds, check every
#                                                      part is there, reassemble, verify, pip install
#                                                      --target TARGET; stdout is ONE line,
#                                                      `export PYTHONPATH=...`, also written to
#                                                      TARGET/pythonpath.sh; use it as
#                                                      eval "$(bash tools/gpu/peer_kit.sh install KIT TARGET)"
#   bash tools/gpu/peer_kit.sh status KIT_DIR          which parts are staged, which missing
#
# The PYTHONPATH holds TARGET and, for each *.pth file pip put in TARGET (pip --target never runs
# them), the folder it adds: plain path lines, and lines of the form
#   import ..., <pkg>; sys.path.insert(0, os.path.join(<pkg>.__path__[0], '<sub>'))
# (nvidia-cutlass-dsl's nvidia_cutlass_dsl_packages.pth: TARGET/nvidia_cutlass_dsl/dsl_packages).
#
# Environment: PYTHON (python3), PEER_KITS_ROOT (/tmp/peer_kits), PART_BYTES (30000000),
# TREE_MIN_BYTES (20000000: wheels at least this large travel unpacked), XZ_OPT_LEVEL (-9),
# PEER_KIT_PIP_ARGS (extra pip install arguments, e.g. for a dry run on another Python).
set -euo pipefail

PY=${PYTHON:-python3}
ROOT=${PEER_KITS_ROOT:-/tmp/peer_kits}
PART_BYTES=${PART_BYTES:-30000000}
TREE_MIN_BYTES=${TREE_MIN_BYTES:-20000000}
XZ_LEVEL=${XZ_OPT_LEVEL:--9}

log() { echo "peer_kit: $*" >&2; }
die() { log "error: $*"; exit "${2:-1}"; }

kit_name() {  # .peers_fa4 -> peers_fa4
    local n
    n=$(basename "$(cd "$1" 2>/dev/null && pwd || echo "$1")")
    echo "${n#.}"
}

sha_of() { sha256sum "$1" | cut -d' ' -f1; }

# ------------------------------------------------------------------------------------------ pack
cmd_pack() {
    local kit=$1 name w size
    [ -d "$kit" ] || die "no folder $kit"
    name=$(kit_name "$kit")
    shopt -s nullglob
    local wheels=("$kit"/*.whl)
    [ ${#wheels[@]} -gt 0 ] || die "no wheels in $kit"
    work=$(mktemp -d)  # global: the EXIT trap reads it
    trap 'rm -rf "$work"' EXIT
    mkdir -p "$work/payload/wheels" "$work/payload/trees"
    (cd "$kit" && sha256sum -- *.whl) > "$work/payload/SHA256SUMS"
    : > "$work/payload/TREES.sha256"
    for w in "${wheels[@]}"; do
        size=$(stat -c %s "$w")
        if [ "$size" -ge "$TREE_MIN_BYTES" ]; then
            log "unpacking $(basename "$w") ($size bytes) to travel as a tree"
            mkdir -p "$work/payload/trees/$(basename "$w")"
            "$PY" -m zipfile -e "$w" "$work/payload/trees/$(basename "$w")"
        else
            cp "$w" "$work/payload/wheels/"
        fi
    done
    (cd "$work/payload" && find trees -type f -print0 | LC_ALL=C sort -z | xargs -0 -r sha256sum) \
        > "$work/payload/TREES.sha256"
    log "compressing (xz $XZ_LEVEL, one thread: minutes for a few hundred MB)"
    tar -C "$work/payload" --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -cf - . \
        | xz "$XZ_LEVEL" -T1 -c > "$work/payload.tar.xz"
    rm -f "$kit/$name".part* "$kit/PARTS"
    split -b "$PART_BYTES" --numeric-suffixes=1 -a 2 "$work/payload.tar.xz" "$kit/$name.part"
    cp "$work/payload/SHA256SUMS" "$kit/SHA256SUMS"
    (cd "$kit" && sha256sum -- "$name".part*) > "$kit/PARTS"
    log "payload $(stat -c %s "$work/payload.tar.xz") bytes in $(wc -l < "$kit/PARTS") parts:"
    (cd "$kit" && ls -l -- "$name".part* SHA256SUMS PARTS) >&2
}

# ----------------------------------------------------------------------------------------- stage
cmd_stage() {
    local kit=$1 name dest f n=0
    [ -d "$kit" ] || die "no folder $kit"
    name=$(kit_name "$kit")
    dest="$ROOT/$name"
    mkdir -p "$dest"
    shopt -s nullglob
    for f in "$kit/$name".part* "$kit/SHA256SUMS" "$kit/PARTS"; do
        [ -f "$f" ] || continue
        if [ "$(cd "$(dirname "$f")" && pwd)" != "$(cd "$dest" && pwd)" ]; then
            cp -f "$f" "$dest/"
        fi
        n=$((n + 1))
    done
    log "staged $n file(s) of kit $name from $kit into $dest"
    [ "${2:-}" = quiet ] || cmd_status_dir "$dest" "$name" || true
}

# Prints staged/missing parts; returns 0 when every part of PARTS is there and intact.
cmd_status_dir() {
    local dest=$1 name=$2 sum part missing=0 bad=0 have=0
    if [ ! -f "$dest/PARTS" ]; then
        log "kit $name: no PARTS manifest staged yet (carry $name's PARTS and SHA256SUMS with any part)"
        return 1
    fi
    while read -r sum part; do
        if [ ! -f "$dest/$part" ]; then
            log "  missing  $part"; missing=$((missing + 1))
        elif [ "$(sha_of "$dest/$part")" != "$sum" ]; then
            log "  CORRUPT  $part (sha256 differs from PARTS)"; bad=$((bad + 1))
        else
            have=$((have + 1))
        fi
    done < "$dest/PARTS"
    log "kit $name: $have of $(wc -l < "$dest/PARTS") parts staged in $dest, $missing missing, $bad corrupt"
    [ "$missing" -eq 0 ] && [ "$bad" -eq 0 ]
}

cmd_status() {
    local name
    name=$(kit_name "$1")
    cmd_status_dir "$ROOT/$name" "$name"
}

# --------------------------------------------------------------------------------------- install
cmd_install() {
    local kit=$1 target=$2 name dest un sum part w
    name=$(kit_name "$kit")
    dest="$ROOT/$name"
    cmd_stage "$kit" quiet
    cmd_status_dir "$dest" "$name" || die "kit $name is incomplete or a part is corrupt: stage (again) the parts listed above" 2
    [ -f "$dest/SHA256SUMS" ] || die "kit $name: no SHA256SUMS staged"
    un="$dest/unpacked"
    rm -rf "$un"
    mkdir -p "$un"
    log "reassembling $(wc -l < "$dest/PARTS") parts and unpacking into $un"
    while read -r sum part; do cat "$dest/$part"; done < "$dest/PARTS" | xz -dc | tar -x -C "$un"
    cmp -s "$un/SHA256SUMS" "$dest/SHA256SUMS" || die "the payload's SHA256SUMS differs from the kit's"
    # Trees: every file as in the original wheel.
    if [ -s "$un/TREES.sha256" ]; then
        (cd "$un" && sha256sum --quiet -c TREES.sha256) || die "a tree file's sha256 differs from TREES.sha256"
    fi
    # Every wheel of the manifest is there, as itself or as a tree rebuilt into a wheel.
    mkdir -p "$un/install"
    while read -r sum w; do
        if [ -f "$un/wheels/$w" ]; then
            [ "$(sha_of "$un/wheels/$w")" = "$sum" ] || die "$w: sha256 differs from SHA256SUMS"
            mv "$un/wheels/$w" "$un/install/$w"
        elif [ -d "$un/trees/$w" ]; then
            grep -q "  trees/$w/" "$un/TREES.sha256" || die "$w: tree has no checksums"
            "$PY" - "$un/trees/$w" "$un/install/$w" <<'EOF'
import os, sys, zipfile
src, dst = sys.argv[1], sys.argv[2]
files = []
for root, _, names in os.walk(src):
    for n in names:
        files.append(os.path.relpath(os.path.join(root, n), src))
# dist-info last, RECORD the very last (as wheel builders write them); stored, not deflated: it
# is only read once, by pip, on this machine.
files.sort(key=lambda p: (".dist-info/" in p, p.endswith(".dist-info/RECORD"), p))
# Fixed timestamps (the tar's are 1970, before zip's 1980 epoch); the files' permission bits kept.
with zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as z:
    for rel in files:
        path = os.path.join(src, rel)
        info = zipfile.ZipInfo(rel.replace(os.sep, "/"), date_time=(1980, 1, 1, 0, 0, 0))
        info.external_attr = (os.stat(path).st_mode & 0xFFFF) << 16
        with open(path, "rb") as f:
            z.writestr(info, f.read())
EOF
            log "rebuilt $w from its verified tree (the original wheel's sha256 is $sum; the rebuilt"
            log "  zip differs byte-wise, its files match the original's, checked above)"
        else
            die "$w (in SHA256SUMS) is in neither wheels/ nor trees/ of the payload"
        fi
    done < "$un/SHA256SUMS"
    mkdir -p "$target"
    log "pip install --target $target: $(cd "$un/install" && ls | tr '\n' ' ')"
    # shellcheck disable=SC2086
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$target" ${PEER_KIT_PIP_ARGS:-} "$un/install"/*.whl >&2 \
        || die "pip install failed"
    rm -rf "$un"
    local pp
    pp=$(pth_paths "$target")
    echo "export PYTHONPATH=$pp\${PYTHONPATH:+:\$PYTHONPATH}" > "$target/pythonpath.sh"
    log "installed kit $name into $target; PYTHONPATH line also in $target/pythonpath.sh"
    cat "$target/pythonpath.sh"
}

# TARGET, then the folders TARGET's .pth files would add (pip --target does not run them).
pth_paths() {
    local target
    target=$(cd "$1" && pwd)
    "$PY" - "$target" <<'EOF'
import glob, os, re, sys
target = sys.argv[1]
paths = [target]
call = re.compile(r"os\.path\.join\(\s*([A-Za-z_][\w.]*)\.__path__\[0\]\s*,\s*['\"]([^'\"]+)['\"]\s*\)")
for pth in sorted(glob.glob(os.path.join(target, "*.pth"))):
    for line in open(pth):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith(("import ", "import\t")):
            found = call.findall(line)
            if not found:
                print(f"peer_kit: warning: {os.path.basename(pth)}: cannot tell what this line adds: {line}",
                      file=sys.stderr)
            for pkg, sub in found:
                cand = os.path.join(target, *pkg.split("."), sub)
                if os.path.isdir(cand):
                    paths.append(cand)
                else:
                    print(f"peer_kit: warning: {os.path.basename(pth)} points to {cand}, absent",
                          file=sys.stderr)
        else:
            cand = line if os.path.isabs(line) else os.path.join(target, line)
            if os.path.isdir(cand):
                paths.append(cand)
seen = []
for p in paths:
    if p not in seen:
        seen.append(p)
print(":".join(seen))
EOF
}

usage() { sed -n '2,40p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

case "${1:-}" in
    pack) [ $# -eq 2 ] || usage; cmd_pack "$2" ;;
    stage) [ $# -eq 2 ] || usage; cmd_stage "$2" ;;
    status) [ $# -eq 2 ] || usage; cmd_status "$2" ;;
    install) [ $# -eq 3 ] || usage; cmd_install "$2" "$3" ;;
    *) usage ;;
esac
