#!/usr/bin/env bash
# The scripts the rendered book needs in a browser - MathJax, require.js and the Jupyter widgets
# embedder - fetched once from the npm registry into book/_vendor, so that the built site serves
# them itself and reads without any internet access (GPU clusters are often air-gapped).
set -euo pipefail
cd "$(dirname "$0")/.."
MATHJAX=mathjax@3.2.2
WIDGETS=@jupyter-widgets/html-manager@1.0.15
REQUIREJS=requirejs@2.3.7
out=book/_vendor
stamp="$out/.versions"
want="$MATHJAX $WIDGETS $REQUIREJS layout-2"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
command -v npm >/dev/null || { echo "fetch_assets: npm is needed once to fetch the book's scripts (apt-get install npm)"; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "fetch_assets: $want"
(cd "$tmp" && npm pack --silent "$MATHJAX" "$WIDGETS" "$REQUIREJS" >/dev/null)
pages=book/_vendor_pages
rm -rf "$out" "$pages" && mkdir -p "$out/mathjax"
for t in "$tmp"/*.tgz; do mkdir -p "$tmp/x" && tar -xzf "$t" -C "$tmp/x" && mv "$tmp/x/package" "$tmp/$(basename "$t" .tgz)" && rm -rf "$tmp/x"; done
# MathJax: the combined TeX -> HTML component, with the fonts and the extensions it may load
src=$(echo "$tmp"/mathjax-*/es5)
cp "$src/tex-chtml.js" "$out/mathjax/"
mkdir -p "$out/mathjax/output" && cp -r "$src/output/chtml" "$out/mathjax/output/"
cp -r "$src/input" "$src/ui" "$src/a11y" "$out/mathjax/"
cp "$tmp"/jupyter-widgets-html-manager-*/dist/embed-amd.js "$out/embed-amd.js"
# The widget embedder asks for its icon fonts at @jupyter-widgets/html-manager/dist/ relative to
# the page itself; the pages with widgets are the chapters, in notebooks/ (copied to the site root)
fonts="$pages/notebooks/@jupyter-widgets/html-manager/dist"
mkdir -p "$fonts"
cp "$tmp"/jupyter-widgets-html-manager-*/dist/*.{woff,woff2,ttf,eot,svg} "$fonts/"
cp "$tmp"/requirejs-*/require.js "$out/require.js"
echo "$want" > "$stamp"
