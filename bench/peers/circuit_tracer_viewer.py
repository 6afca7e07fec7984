"""Does the graph JSON slmviz saves, pins and supernodes included, open in circuit-tracer's own local viewer and draw
the same nodes? (the workbench issue, item 6)

1. slmviz (this venv) builds the SmolLM2 graph of a prompt over the bundled transcoder_l6, prunes it as the app does
   (0.95 / 0.98), pins the top features and the top logit, groups two into a supernode, labels one, and saves it with
   `save_json` into a folder laid out as circuit-tracer's `create_graph_files` writes it (`{slug}.json` and
   `graph-metadata.json`).
2. circuit-tracer 0.5.0, installed in a side venv (--ct-python, default /work/ct-venv/bin/python), serves that
   folder with its own `circuit_tracer.frontend.local_server.serve`.
3. Headless Chromium opens the viewer at 127.0.0.1 (at `localhost` the page fetches graph files from a remote host).
   The page loads d3, Anthropic's d3-jetpack helpers, dagre and pako from CDNs, unreachable here: Playwright routes
   those URLs to the same libraries' npm packages (d3@7.9.0, d3-jetpack@2.3.0's d3v7+jetpack build with a one-line
   fix, JETPACK_FIX, dagre@0.8.5, pako@2.1.0, installed with npm into --npm-dir); npy_v0.js (only the feature
   pages read .npy files) and the
   hot-reload client become empty scripts. Any other request off 127.0.0.1 is refused and counted.
4. It checks that the link graph draws one node per node of the JSON, that the JSON's pins show as pinned, and that
   the subgraph panel shows the supernode's name and the edited label; it saves a screenshot.

    .venv/bin/python bench/peers/circuit_tracer_viewer.py [--ct-python PATH] [--npm-dir DIR] [--screenshot PATH]

Prints a markdown table for bench/results/perf.md.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py, which puts this checkout first
from common import REPO, RESULTS

sys.path.insert(0, str(REPO / "tests"))
from app_helpers import CHROMIUM, CHROMIUM_ARGS

PACKAGES = ["d3@7.9.0", "d3-jetpack@2.3.0", "dagre@0.8.5", "pako@2.1.0"]
ROUTES = {  # CDN URL (glob) -> file under node_modules, or "" for an empty script
    "https://transformer-circuits.pub/**/static_js/lib/d3.js": "d3/dist/d3.min.js",
    "https://transformer-circuits.pub/**/static_js/lib/jetpack_2024-07-20.js": "d3-jetpack/build/d3v7+jetpack.js",
    "https://unpkg.com/dagre@0.8.5/**": "dagre/dist/dagre.min.js",
    "https://unpkg.com/pako@2.1.0/**": "pako/dist/pako.min.js",
    "https://transformer-circuits.pub/**/static_js/lib/npy_v0.js": "",
    "https://transformer-circuits.pub/**/static_js/lib/hotserver-client-ws.js": "",
}
PATCHED = b"selection.prototype.prop = selection.prototype.property;"


def JETPACK_FIX(body: bytes) -> bytes:  # noqa: N802 - a constant-like fix applied to one file
    """d3-jetpack 2.3.0's d3v7+jetpack build carries two copies of d3-selection: jetpack's methods (appendMany, at,
    st, append('div.class'), ...) go on one and `d3.select` returns the other, so `d3.select(x).appendMany` is
    undefined. One added line copies them across, and conventions() gains c.drawAxis (what Anthropic's own jetpack
    build gives)."""
    if PATCHED not in body:
        raise RuntimeError("d3-jetpack's build changed: the line the fix follows is not there")
    names = "['translate','append','insert','parent','selectAppend','tspans','appendMany','at','st','prop']"
    fix = f"\n  {names}.forEach(function (k) {{ selection$1.prototype[k] = selection.prototype[k]; }});".encode()
    body = body.replace(PATCHED, PATCHED + fix, 1)
    # and the viewer calls c.drawAxis() on what d3.conventions returns; jetpack 2.3.0 has drawAxis(c) beside it
    exported = b"exports.conventions = conventions;"
    if exported not in body:
        raise RuntimeError("d3-jetpack's build changed: it no longer exports conventions as the fix expects")
    return body.replace(exported, b"exports.conventions = function (c) { c = conventions(c); "
                                  b"c.drawAxis = function () { return drawAxis(c); }; return c; };", 1)


SERVE = """
import sys, time
from circuit_tracer.frontend.local_server import serve
server = serve(data_dir=sys.argv[1], port=int(sys.argv[2]))
print("serving", flush=True)
while True:
    time.sleep(3600)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_file(body: bytes):
    """A route handler answering with `body` (one parameter: Playwright passes the request too to a handler that
    takes two)."""
    def handler(route) -> None:
        route.fulfill(status=200, body=body, content_type="application/javascript")
    return handler


def npm_libraries(folder: Path) -> Path:
    modules = folder / "node_modules"
    if not all((modules / f).exists() for f in ROUTES.values() if f):
        subprocess.run(["npm", "install", "--silent", "--no-audit", "--no-fund", "--prefix", str(folder), *PACKAGES],
                       check=True)
    return modules


def build_graph(data_dir: Path, prompt: str, slug: str) -> dict:
    import slmviz

    m = slmviz.load()
    tc = slmviz.load_sae("transcoder_l6", model=m)
    g = slmviz.attribution_graph(prompt, transcoders=[tc], model=m, progress=False).prune(0.95, 0.98)
    top = g.pin_top(6, logit=True)
    g.supernode("top two", top[:2])
    g.label(top[2], "edited by hand")
    path = g.save_json(data_dir / f"{slug}.json", slug=slug)
    data = json.loads(path.read_text())
    # circuit-tracer's create_graph_files appends the graph's metadata to graph-metadata.json (add_graph_metadata)
    (data_dir / "graph-metadata.json").write_text(json.dumps({"graphs": [data["metadata"]]}, indent=2))
    return data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ct-python", default="/work/ct-venv/bin/python")
    parser.add_argument("--npm-dir", default=str(Path(tempfile.gettempdir()) / "slmviz-viewer-libs"))
    parser.add_argument("--prompt", default="The capital of France is")
    parser.add_argument("--screenshot", default=str(RESULTS / "circuit_tracer_viewer.png"))
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    modules = npm_libraries(Path(args.npm_dir))
    ask = "import importlib.metadata as m; print(m.version('circuit-tracer'))"
    version = subprocess.run([args.ct_python, "-c", ask], capture_output=True, text=True, check=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="slmviz-ct-viewer-") as tmp:
        data_dir = Path(tmp)
        slug = "slmviz-smollm2-paris"
        data = build_graph(data_dir, args.prompt, slug)
        port = free_port()
        server = subprocess.Popen([args.ct_python, "-c", SERVE, str(data_dir), str(port)], stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
        try:
            base = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 180
            while True:
                try:
                    urllib.request.urlopen(base + "/data/graph-metadata.json", timeout=2)
                    break
                except OSError:
                    if server.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"circuit-tracer's server did not start: {server.stdout.read()}") from None
                    time.sleep(1)
            refused: list[str] = []
            errors: list[str] = []
            seen: list[str] = []
            failed: list[str] = []
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
                page = browser.new_page(viewport={"width": 1600, "height": 1100})
                page.on("pageerror", lambda e: errors.append(str(e)))

                def off_host(route):
                    refused.append(route.request.url)
                    route.abort()

                page.route(lambda url: not url.startswith(base), off_host)
                for pattern, file in ROUTES.items():  # later routes win over the catch-all above
                    body = (modules / file).read_bytes() if file else b""
                    page.route(pattern, serve_file(JETPACK_FIX(body) if "jetpack" in file else body))
                page.on("requestfinished", lambda r: seen.append(r.url))
                page.on("requestfailed", lambda r: failed.append(r.url))
                page.goto(f"{base}/index.html?slug={slug}", wait_until="domcontentloaded")
                page.wait_for_function("document.querySelectorAll('text.node').length > 0", timeout=120_000)
                page.wait_for_timeout(2000)
                drawn = page.evaluate(
                    "Array.from(document.querySelectorAll('text.node')).map((e) => e.__data__.nodeId)")
                pinned = page.evaluate(
                    "Array.from(document.querySelectorAll('text.node.pinned')).map((e) => e.__data__.nodeId)")
                text = page.evaluate("document.body.textContent")
                # circuit-tracer 0.5.0's init-cg.js replaces the JSON's qParams.supernodes by the URL's, [] when the
                # URL has none (`let urlSupernodes = []; if (urlSupernodes) ...`: an empty array is truthy); the
                # viewer itself keeps supernodes in the URL (supernodesToUrl), so open it again with the JSON's list
                groups = urllib.parse.quote(json.dumps(data["qParams"]["supernodes"]))
                page.goto(f"{base}/index.html?slug={slug}&supernodes={groups}", wait_until="domcontentloaded")
                page.wait_for_function("document.querySelectorAll('text.node').length > 0", timeout=120_000)
                page.wait_for_timeout(2000)
                with_url = page.evaluate("document.body.textContent")
                page.screenshot(path=args.screenshot, full_page=False)
                browser.close()
        finally:
            server.terminate()
            server.wait(timeout=15)
    listed = [n["node_id"] for n in data["nodes"]]
    # the viewer's own filter (util-cg.js): embeddings, logits, pins, and nodes whose cumulative influence is at
    # most the graph's node_threshold (prune keeps the node that crosses it; circuit-tracer's files do the same)
    threshold = data["metadata"]["node_threshold"]
    shown = [n["node_id"] for n in data["nodes"] if n["feature_type"] in ("embedding", "logit")
             or n["node_id"] in data["qParams"]["pinnedIds"] or (n["influence"] is not None
                                                                  and n["influence"] <= threshold)]
    same = sorted(drawn) == sorted(shown)
    missing = sorted(set(shown) - set(drawn))
    extra = sorted(set(drawn) - set(shown))
    hidden = sorted(set(listed) - set(shown))
    pins = data["qParams"]["pinnedIds"]
    print(f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} by `.venv/bin/python "
          f"bench/peers/circuit_tracer_viewer.py` with circuit-tracer {version} in a side venv ({args.ct_python}), "
          f"npm packages {', '.join(PACKAGES)}. SmolLM2, {args.prompt!r}, transcoder_l6, pruned 0.95 / 0.98.\n")
    print("| what | result | notes |\n| --- | --- | --- |")
    print(f"| the link graph draws the JSON's nodes | {'yes' if same else 'no'} | {len(drawn)} drawn of {len(listed)} "
          f"in the JSON ({sum(n['feature_type'] == 'cross layer transcoder' for n in data['nodes'])} features); the "
          f"viewer hides {', '.join(hidden) or 'none'} itself (cumulative influence over node_threshold {threshold}); "
          f"missing otherwise: {', '.join(missing) or 'none'}; drawn but not in the JSON: "
          f"{', '.join(extra) or 'none'} |")
    print(f"| the JSON's pins show as pinned | {'yes' if sorted(pinned) == sorted(pins) else 'no'} | "
          f"{len(pinned)} of {len(pins)} pinned ids marked |")
    print(f"| the subgraph shows the edited label (clerp) | {'yes' if 'edited by hand' in text else 'no'} | "
          f"and every feature's automatic label, '[auto] …' |")
    print(f"| the subgraph shows the supernode, from the JSON alone | {'yes' if 'top two' in text else 'no'} | "
          f"circuit-tracer 0.5.0's init-cg.js replaces qParams.supernodes by the URL's (an empty list when absent) |")
    print(f"| the same, with the JSON's supernodes in the URL (as the viewer keeps them) | "
          f"{'yes' if 'top two' in with_url else 'no'} | qParams.supernodes {data['qParams']['supernodes']} |")
    print(f"| requests off 127.0.0.1 (refused) / page errors | {len(refused)} / {len(errors)} | "
          f"{'; '.join(refused[:3] + errors[:3]) or 'none'} |")


if __name__ == "__main__":
    main()
