"""Great Expectations Data Docs that render with no internet, built locally and published to S3.

GX pages load Bootstrap, jQuery, bootstrap-table, Vega and Font Awesome from public CDNs and show a
logo fetched with a tracking id. The same versions are installed from npm (``make datadocs-assets``,
pinned by ``infra/datadocs-assets/package-lock.json``), copied into the site under
``static/vendor/`` and every page's CDN URL is rewritten to a relative path after each build.

Build cost is bounded, not incremental-forever: validation results beyond the newest N per suite
are pruned (see :func:`millpond.quality.context.prune_results`) and only pages that are missing are
rendered; the index is rebuilt from at most N results per suite.
"""

from __future__ import annotations

import functools
import http.server
import os
import re
import shutil
from pathlib import Path
from typing import Any

from millpond.config import Settings
from millpond.errors import MillpondError

VENDOR = "static/vendor"
PUBLISH_PREFIX = "data_docs"

# CDN URL in the GX 1.24.1 templates -> file in node_modules (same library, pinned version).
CDN_MAP: dict[str, str] = {
    "https://maxcdn.bootstrapcdn.com/bootstrap/4.3.1/css/bootstrap.min.css": "bootstrap/dist/css/bootstrap.min.css",
    "https://stackpath.bootstrapcdn.com/bootstrap/4.3.1/js/bootstrap.min.js": "bootstrap/dist/js/bootstrap.min.js",
    "https://code.jquery.com/jquery-3.7.1.min.js": "jquery/dist/jquery.min.js",
    "https://cdnjs.cloudflare.com/ajax/libs/popper.js/1.12.9/umd/popper.min.js": "popper.js/dist/umd/popper.min.js",
    "https://unpkg.com/bootstrap-table@1.19.1/dist/bootstrap-table.min.css":
        "bootstrap-table/dist/bootstrap-table.min.css",
    "https://unpkg.com/bootstrap-table@1.19.1/dist/bootstrap-table.min.js":
        "bootstrap-table/dist/bootstrap-table.min.js",
    "https://unpkg.com/bootstrap-table@1.19.0/dist/extensions/filter-control/bootstrap-table-filter-control.min.css":
        "bootstrap-table/dist/extensions/filter-control/bootstrap-table-filter-control.min.css",
    "https://unpkg.com/bootstrap-table@1.19.0/dist/extensions/filter-control/bootstrap-table-filter-control.css":
        "bootstrap-table/dist/extensions/filter-control/bootstrap-table-filter-control.min.css",
    "https://unpkg.com/bootstrap-table@1.19.1/dist/extensions/filter-control/bootstrap-table-filter-control.min.js":
        "bootstrap-table/dist/extensions/filter-control/bootstrap-table-filter-control.min.js",
    "https://cdnjs.cloudflare.com/ajax/libs/bootstrap-datepicker/1.9.0/css/bootstrap-datepicker.min.css":
        "bootstrap-datepicker/dist/css/bootstrap-datepicker.min.css",
    "https://cdnjs.cloudflare.com/ajax/libs/bootstrap-datepicker/1.9.0/js/bootstrap-datepicker.min.js":
        "bootstrap-datepicker/dist/js/bootstrap-datepicker.min.js",
    "https://cdn.jsdelivr.net/npm/@forevolve/bootstrap-dark@1.1.0/dist/css/bootstrap-prefers-dark.css":
        "@forevolve/bootstrap-dark/dist/css/bootstrap-prefers-dark.min.css",
    "https://cdn.jsdelivr.net/npm/vega@5": "vega/build/vega.min.js",
    "https://cdn.jsdelivr.net/npm/vega-lite@5": "vega-lite/build/vega-lite.min.js",
    "https://cdn.jsdelivr.net/npm/vega-embed@6": "vega-embed/build/vega-embed.min.js",
    "https://cdnjs.cloudflare.com/ajax/libs/font-awesome/6.6.0/css/all.min.css":
        "@fortawesome/fontawesome-free/css/all.min.css",
}
# Folders a vendored file refers to relatively (Font Awesome's CSS loads ../webfonts/*).
EXTRA_DIRS = ["@fortawesome/fontawesome-free/webfonts"]

_TAG = re.compile(r"<(script|link)\b[^>]*>(?:\s*</script>)?", re.IGNORECASE)
_URL_ATTR = re.compile(r"""\b(src|href)\s*=\s*["'](https?://[^"']+)["']""", re.IGNORECASE)
_SRI = re.compile(r"""\s+(integrity|crossorigin)\s*=\s*["'][^"']*["']""", re.IGNORECASE)
_LOGO = re.compile(r"<img\b[^>]*great-expectations-web-assets[^>]*>", re.IGNORECASE | re.DOTALL)
_CSS_URL = re.compile(r"""url\(\s*["']?https?://[^)]*\)""", re.IGNORECASE)  # dark-mode logo in inline CSS
_FOOTER = re.compile(r"<footer>\s*<p>[^<]*newsletter.*?</footer>", re.IGNORECASE | re.DOTALL)
_BRAND = '<span class="h4 mb-0 text-dark" style="line-height: 50px">Millpond data quality</span>'


def assets_dir(settings: Settings) -> Path:
    root = settings.datadocs_assets_path
    missing = [p for p in [*CDN_MAP.values(), *EXTRA_DIRS] if not (root / p).exists()]
    if missing:
        raise MillpondError(f"Data Docs assets missing under {root} ({missing[0]}, ...): "
                            "run `make datadocs-assets` (needs npm)")
    return root


def vendor_assets(site: Path, settings: Settings) -> int:
    """Copy the pinned CSS/JS into ``site/static/vendor`` (only files missing or changed)."""
    src_root = assets_dir(settings)
    files = [Path(p) for p in sorted(set(CDN_MAP.values()))]
    for d in EXTRA_DIRS:
        files += [p.relative_to(src_root) for p in sorted((src_root / d).iterdir()) if p.is_file()]
    copied = 0
    for rel in files:
        src, dst = src_root / rel, site / VENDOR / rel
        if dst.exists() and dst.stat().st_size == src.stat().st_size:
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)
        copied += 1
    return copied


def rewrite_html(path: Path, site: Path) -> bool:
    """Point CDN URLs at the vendored copies; drop SRI attributes, unknown external tags, the tracking logo."""
    text = path.read_text(encoding="utf-8")
    prefix = os.path.relpath(site / VENDOR, path.parent).replace(os.sep, "/")

    def tag(m: re.Match[str]) -> str:
        whole = m.group(0)
        attr = _URL_ATTR.search(whole)
        if not attr:
            return whole
        local = CDN_MAP.get(attr.group(2))
        if local is None:  # an asset we do not vendor: better absent than a network call
            return ""
        whole = _SRI.sub("", whole)
        return whole.replace(attr.group(2), f"{prefix}/{local}")

    new = _TAG.sub(tag, text)
    new = _LOGO.sub(_BRAND, new)
    new = _CSS_URL.sub("none", new)
    new = _FOOTER.sub("", new)  # marketing link with tracking parameters
    if new != text:
        path.write_text(new, encoding="utf-8")
        return True
    return False


def external_refs(html: str) -> list[str]:
    """CSS/JS/image URLs a page would fetch from the internet (what must be empty offline)."""
    refs = []
    for m in _TAG.finditer(html):
        attr = _URL_ATTR.search(m.group(0))
        if attr:
            refs.append(attr.group(2))
    refs += re.findall(r"""<img\b[^>]*\bsrc\s*=\s*["'](https?://[^"']+)""", html, re.IGNORECASE)
    refs += _CSS_URL.findall(html)
    return refs


def render_pages(context: Any, settings: Settings, identifiers: list[Any]) -> list[str]:
    """Render just these validation results' pages (no index): cost independent of history."""
    from millpond.quality.context import SITE, site_dir, validation_page_path

    context.build_data_docs(site_names=[SITE], resource_identifiers=identifiers, build_index=False)
    site = site_dir(settings)
    vendor_assets(site, settings)
    pages = []
    for vrid in identifiers:
        page = validation_page_path(settings, vrid)
        if page.exists():
            rewrite_html(page, site)
            pages.append(str(page))
    return pages


def build_data_docs(settings: Settings) -> Path:
    """Prune old results, render missing pages and the index, make them offline; return index.html."""
    from great_expectations.data_context.types.resource_identifiers import ExpectationSuiteIdentifier

    from millpond.quality import context as q

    with q._LOCK:
        context = q.get_context(settings)
        site = q.site_dir(settings)
        with q.file_lock(settings):
            q.prune_results(context, settings, q.keep_results(settings))
            results = context.validation_results_store.list_keys()
            missing = [k for k in results if not q.validation_page_path(settings, k).exists()]
            suites = [ExpectationSuiteIdentifier(name) for name in q.qs.SUITES]
            context.build_data_docs(site_names=[q.SITE], resource_identifiers=[*suites, *missing])
            vendor_assets(site, settings)
            for page in [site / "index.html", *(site / "expectations").rglob("*.html"),
                         *(q.validation_page_path(settings, k) for k in missing)]:
                if page.exists():
                    rewrite_html(page, site)
    index = site / "index.html"
    if not index.exists():
        raise MillpondError(f"Data Docs build wrote no index page under {site}")
    return index


def publish_data_docs(settings: Settings, *, rebuild: bool = True) -> int:
    """Upload what changed in the built site since the last publish from this home to
    ``s3://<reports>/data_docs/`` (new pages, the index; pruned pages are removed); return the number of
    files uploaded."""
    from millpond.lake.objectstore import ObjectStore
    from millpond.quality.context import site_dir

    site = build_data_docs(settings).parent if rebuild else site_dir(settings)
    if not (site / "index.html").exists():
        raise MillpondError(f"no Data Docs built under {site}: run `millpond docs --no-serve` first")
    return ObjectStore(settings).upload_dir(settings.bucket_reports, PUBLISH_PREFIX, site,
                                            manifest=site.parent / "published.json")


def serve(site: Path, port: int, host: str = "127.0.0.1") -> None:
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(site))
    with http.server.ThreadingHTTPServer((host, port), handler) as httpd:
        print(f"Data Docs at http://{host}:{httpd.server_address[1]}/index.html (Ctrl-C stops)", flush=True)
        try:
            httpd.serve_forever()
        except KeyboardInterrupt:
            pass
