#!/bin/sh
# Build BLIS (github.com/inference-sim/inference-sim, Go) for bench_speed.py without the
# Go module proxy: Go 1.24 and BLIS's dependencies come from Debian's packages of the
# release after bookworm (trixie), downloaded and unpacked under a work folder (the
# system's apt configuration and installed packages are left alone), and each module
# BLIS requires is replaced by Debian's copy of its source. Debian's versions are not
# always the ones BLIS's go.mod names (cobra 1.8.1 for 1.9.1, gonum 0.15.1 for 0.17.0);
# BLIS at commit f90a1e3 builds with them.
#
#   benchmarks/build_blis.sh SOURCE [OUT]
#
# SOURCE: a checkout (or `git archive`) of inference-sim/inference-sim; OUT (default
# benchmarks/blis, ignored by git) receives a copy of it with the `blis` binary, which
# bench_speed.py runs there (BLIS reads defaults.yaml and model_configs/ from it).
set -eu
SRC=$(cd "$1" && pwd)
OUT=${2:-$(dirname "$0")/blis}
WORK=${TMPDIR:-/tmp}/kvsim-blis-build
mkdir -p "$WORK/lists/partial" "$WORK/cache/archives/partial" "$WORK/debs" "$WORK/root" "$WORK/mods"

# trixie from the mirror the system's sources already name
URI=$(grep -h -m1 '^URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '{print $2}')
[ -n "$URI" ] || URI=$(grep -h -m1 '^deb ' /etc/apt/sources.list | awk '{print $2}')
echo "deb $URI trixie main" > "$WORK/trixie.list"
APT="-o Dir::Etc::sourcelist=$WORK/trixie.list -o Dir::Etc::sourceparts=- -o Dir::State::Lists=$WORK/lists -o Dir::Cache=$WORK/cache"
apt-get $APT update >/dev/null
PACKAGES="golang-1.24-go golang-1.24-src golang-github-google-uuid-dev golang-github-sirupsen-logrus-dev
  golang-github-spf13-cobra-dev golang-github-spf13-pflag-dev golang-github-stretchr-testify-dev
  golang-github-stretchr-objx-dev golang-gonum-v1-gonum-dev golang-gopkg-yaml.v3-dev
  golang-github-davecgh-go-spew-dev golang-github-pmezard-go-difflib-dev
  golang-github-inconshreveable-mousetrap-dev golang-golang-x-sys-dev"
(cd "$WORK/debs" && apt-get $APT download $PACKAGES >/dev/null)
for deb in "$WORK"/debs/*.deb; do dpkg -x "$deb" "$WORK/root"; done

rm -rf "$OUT" && mkdir -p "$OUT" && cp -r "$SRC"/. "$OUT"/ && rm -rf "$OUT/.git"
OUT=$(cd "$OUT" && pwd)
GOCODE="$WORK/root/usr/share/gocode/src"
for mod in github.com/google/uuid github.com/sirupsen/logrus github.com/spf13/cobra github.com/spf13/pflag \
           github.com/stretchr/testify github.com/stretchr/objx gonum.org/v1/gonum gopkg.in/yaml.v3 \
           github.com/davecgh/go-spew github.com/pmezard/go-difflib github.com/inconshreveable/mousetrap \
           golang.org/x/sys; do
    rm -rf "$WORK/mods/$mod" && mkdir -p "$(dirname "$WORK/mods/$mod")"
    cp -rL "$GOCODE/$mod" "$WORK/mods/$mod" && chmod -R u+w "$WORK/mods/$mod"
    # a few of Debian's copies predate modules: give them a go.mod so they can replace one
    [ -f "$WORK/mods/$mod/go.mod" ] || printf 'module %s\n\ngo 1.13\n' "$mod" > "$WORK/mods/$mod/go.mod"
    echo "replace $mod => $WORK/mods/$mod" >> "$OUT/go.mod"
done

export GOROOT="$WORK/root/usr/lib/go-1.24" GOPATH="$WORK/gopath" GOCACHE="$WORK/gocache"
export GOPROXY=off GOSUMDB=off GOFLAGS=-mod=mod GOTOOLCHAIN=local
(cd "$OUT" && "$GOROOT/bin/go" build -o blis .)
echo "built $OUT/blis"
