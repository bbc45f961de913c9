"""The docs name only what exists: every rlfleet module, class or function, every file of the
repository and every HTTP route that README.md and docs/*.md name is one the code has (a
route: one it serves, or one it calls on another server).

What counts as a name (a clear rule, so that a writer knows what is checked):

* a module path: `rlfleet/x/y.py`, `src/rlfleet/x/`, or `x/y.py` where `x` is a package of
  rlfleet (all but `vllm`, whose bare paths are vLLM's own files); it must be a file or
  folder under src/rlfleet;
* a dotted name `rlfleet.x.y[.Name[.attr]]` (or `tests.x[.Name]`, under tests/) not
  preceded by `/`, `.` or a word character: the longest prefix that is a module must exist
  and the rest must be defined in it (a class, function, assignment or import; read from
  the source, nothing is imported), or the whole name must be a string the code uses (a
  logger name such as `rlfleet.ready`);
* a repository file: `tests/...`, `bench/...`, `scripts/...`, `examples/...`, `docs/...`,
  `deploy/...` ending in a file extension (globs allowed), and every relative Markdown link;
* a route: an inline code span that holds a path (after an optional HTTP method and an
  optional base such as `http://host:port`, `{system_url}` or `$URL`) whose first segment
  is one the code serves routes under, or any path after an HTTP method; and every URL on
  a local host (`127.0.0.1`, `localhost`, `0.0.0.0`, `$VAR`, `{var}`, `<var>`) anywhere in
  the text. A `{x}` or `<x>` segment matches any segment; `?query` is ignored.

The routes the code serves are read from the apps themselves (the frontend, its RL
listener, a worker's system server with vLLM's native routes and the weights and fan-out
routes, its HTTP request plane, the trainer's publisher, the fleet control service) and
from the route tables in rlfleet.protocol (every /engine route of the admin table, the
relay, the native routes a worker serves with LoRA on); the routes it calls, from the
f-strings that build their URLs in src/, tests/ and bench/ (`f"{url}/workers"`)."""

from __future__ import annotations

import ast
import functools
import glob
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
PACKAGE = SRC / "rlfleet"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
METHODS = ("GET", "POST", "PUT", "DELETE", "PATCH", "HEAD")
REPO_DIRS = ("tests", "bench", "scripts", "examples", "docs", "deploy")
EXTENSIONS = "py|md|sh|json|yaml|yml|toml|png|txt|html|cfg|ini"


def doc_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


# ---------------------------------------------------------------- module names


def _module_file(parts: list[str]) -> Path | None:
    base = (SRC if parts[0] == "rlfleet" else ROOT).joinpath(*parts)
    for f in (base.with_suffix(".py"), base / "__init__.py"):
        if f.is_file():
            return f
    return None


@functools.cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def _statements(body: list[ast.stmt]) -> list[ast.stmt]:
    """Top-level statements, those inside `if` / `try` / `with` blocks too."""
    out: list[ast.stmt] = []
    for s in body:
        out.append(s)
        if isinstance(s, ast.If):
            out += _statements(s.body) + _statements(s.orelse)
        elif isinstance(s, ast.Try):
            out += _statements(s.body) + _statements(s.orelse) + _statements(s.finalbody)
            for h in s.handlers:
                out += _statements(h.body)
        elif isinstance(s, ast.With):
            out += _statements(s.body)
    return out


def _defined(body: list[ast.stmt], name: str) -> ast.AST | str | None:
    """What defines `name` in a body: the node, or the dotted name it is imported from."""
    for s in _statements(body):
        if isinstance(s, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and s.name == name:
            return s
        if isinstance(s, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == name
                or isinstance(t, ast.Tuple) and any(isinstance(e, ast.Name) and e.id == name
                                                    for e in t.elts)
                for t in s.targets):
            return s
        if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name) and s.target.id == name:
            return s
        if isinstance(s, ast.ImportFrom):
            for a in s.names:
                if (a.asname or a.name) == name:  # a relative import: taken as it is
                    return f"{s.module}.{a.name}" if not s.level else "(relative)"
        if isinstance(s, ast.Import):
            for a in s.names:
                if (a.asname or a.name.split(".")[0]) == name:
                    return a.name
    return None


def resolves(dotted: str, depth: int = 0) -> bool:
    """Whether `rlfleet.x.y.Name.attr` (or `tests.x.Name`) exists (read from the source)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        f = _module_file(parts[:cut])
        if f is not None:
            break
    else:
        return False
    rest = parts[cut:]
    if not rest:
        return True
    found = _defined(_tree(f).body, rest[0])
    if isinstance(found, str):  # imported: follow it (a re-export), unless outside rlfleet
        if not found.startswith(("rlfleet.", "tests.")) or depth > 8:
            return True
        return resolves(".".join([found, *rest[1:]]), depth + 1)
    if found is None:
        return False
    if len(rest) > 1 and isinstance(found, ast.ClassDef):
        inner = _defined(found.body, rest[1])
        if inner is None:  # a field or attribute set in __init__ / __post_init__
            inner = any(isinstance(n, ast.Attribute) and n.attr == rest[1]
                        and isinstance(n.value, ast.Name) and n.value.id == "self"
                        for n in ast.walk(found)) or None
        return inner is not None
    return True


@functools.cache
def code_strings() -> frozenset[str]:
    """Every string constant in the package that reads as a dotted rlfleet name (logger
    names, record targets)."""
    out = set()
    for f in PACKAGE.rglob("*.py"):
        for n in ast.walk(_tree(f)):
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and \
                    re.fullmatch(r"rlfleet(\.\w+)+", n.value):
                out.add(n.value)
    return frozenset(out)


SUBPACKAGES = sorted(p.name for p in PACKAGE.iterdir()
                     if p.is_dir() and (p / "__init__.py").exists() and p.name != "vllm")
_LEAD = r"(?<![\w/.~$-])"
DOTTED = re.compile(_LEAD + r"(?:rlfleet|tests)(?:\.[A-Za-z_]\w*)+")
PATHS = re.compile(_LEAD + r"(?:src/)?rlfleet/(?:[\w]+/)*[\w]*(?:\.py)?")
BARE_PATHS = re.compile(_LEAD + rf"(?:{'|'.join(SUBPACKAGES)})/(?:\w+/)*\w+\.py\b")
REPO_PATHS = re.compile(_LEAD + rf"(?:{'|'.join(REPO_DIRS)})/[\w./*-]*?\.(?:{EXTENSIONS})\b")
LINKS = re.compile(r"\]\(([^)\s]+)\)")


def module_names(text: str) -> list[str]:
    """The module paths and dotted names a text names, that do not exist."""
    bad = []
    for m in DOTTED.finditer(text):
        name = m.group(0)
        if name not in code_strings() and not resolves(name):
            bad.append(name)
    for m in PATHS.finditer(text):
        rel = m.group(0).removeprefix("src/").rstrip("/")
        p = SRC / rel
        if not (p.exists() or p.with_suffix(".py").is_file()):
            bad.append(m.group(0))
    for m in BARE_PATHS.finditer(text):
        if not (PACKAGE / m.group(0)).is_file():
            bad.append(m.group(0))
    return bad


def repo_paths(doc: Path, text: str) -> list[str]:
    bad = [m.group(0) for m in REPO_PATHS.finditer(text) if not glob.glob(str(ROOT / m.group(0)))]
    for m in LINKS.finditer(text):
        target = m.group(1).split("#")[0]
        if not target or re.match(r"[a-z][a-z0-9+.-]*:", target):  # an anchor, a URL
            continue
        if not (doc.parent / target).exists():
            bad.append(m.group(1))
    return bad


# ---------------------------------------------------------------- routes


def _paths_of(app, prefix: str = "") -> set[str]:
    """The route paths an ASGI app serves (through the middlewares that wrap it)."""
    while not hasattr(app, "routes") and hasattr(app, "app"):
        app = app.app
    out = set()
    for r in app.routes:
        path = getattr(r, "path", "")
        if hasattr(r, "routes") and not hasattr(r, "endpoint"):  # a Mount, a Router
            out |= _paths_of(r, prefix + path)
        else:
            out.add(prefix + path)
    return out


@functools.cache
def served_routes() -> frozenset[str]:
    import tempfile

    from rlfleet.frontend.app import build_app
    from rlfleet.frontend.rl import rl_app
    from rlfleet.frontend.router import WorkerPool
    from rlfleet.mocker.engine import MockEngine
    from rlfleet.protocol import admin, dynamo_lora, fleet_control, relay, vllm_rl
    from rlfleet.refresh.fleet_control.app import control_app
    from rlfleet.runtime.discovery import open_discovery
    from rlfleet.weights.fanout import add_fanout_routes
    from rlfleet.weights.publish import add_weights_route, weights_app
    from rlfleet.worker.admin import EngineAdmin
    from rlfleet.worker.native_rl import NativeRL
    from rlfleet.worker.stream_server import WorkerPlane
    from rlfleet.worker.system_server import system_app

    with tempfile.TemporaryDirectory() as d:
        discovery = open_discovery(f"file://{d}")
        # the app's routes (no client: nothing is sent to a worker here)
        routes = _paths_of(build_app(WorkerPool(discovery, "dynamo"), None,  # type: ignore[arg-type]
                                     fleet_control="http://127.0.0.1:9"))
        routes |= _paths_of(rl_app(discovery, "dynamo"))
    engine = MockEngine()
    engine_admin = EngineAdmin(engine)
    system = system_app(engine_admin.routes(), mounted=NativeRL(engine_admin))
    add_fanout_routes(system, lambda version: None)  # as rlfleet.worker.serve adds them
    add_weights_route(system, lambda version: None)
    routes |= _paths_of(system)
    routes |= _paths_of(WorkerPlane(engine).http_app())
    routes |= _paths_of(weights_app(lambda version: None))  # the trainer's publisher
    routes |= _paths_of(control_app(None))  # type: ignore[arg-type]  (routes only)
    # the tables: every /engine route (the system server's `/engine/{name:path}` serves the
    # table it is given), the native routes a worker serves with LoRA on, the dialects
    tables = [*admin.ROUTES.values(), *admin.NATIVE_METHODS.values(), relay.RELAY]
    routes |= {f"{admin.ROUTE_PREFIX}/{r.name}" for r in tables}
    for module in (vllm_rl, dynamo_lora):
        routes |= {v.path for v in vars(module).values() if isinstance(v, vllm_rl.NativeRoute)}
    routes |= {r.path for r in fleet_control.ROUTES}
    routes.discard(admin.ROUTE_PREFIX + "/{name:path}")
    routes.discard("/openapi.json")  # FastAPI's own
    return frozenset(routes)


@functools.cache
def called_routes() -> frozenset[str]:
    """The paths the code calls on other servers (the SGLang router's, a peer's, ...): in an
    f-string of src/, tests/ or bench/, the literal text right after a URL placeholder (one
    whose expression names a URL: `f"{url}/workers"`, `f"{self.rl_url}/v1/rl/workers"`)
    that ends the string or in which a query begins; a path with a placeholder in it is not
    counted (it would match any value)."""
    out = set()
    for top in ("src", "tests", "bench"):
        for f in (ROOT / top).rglob("*.py"):
            for n in ast.walk(_tree(f)):
                if not isinstance(n, ast.JoinedStr):
                    continue
                parts = n.values
                for i in range(1, len(parts)):
                    text = parts[i]
                    before = parts[i - 1]
                    if not (isinstance(before, ast.FormattedValue)
                            and "url" in ast.unparse(before.value).lower()
                            and isinstance(text, ast.Constant) and str(text.value).startswith("/")):
                        continue
                    path = str(text.value)
                    if "?" not in path and i + 1 < len(parts):
                        continue  # a placeholder follows
                    path = path.split("?")[0].rstrip("/")
                    if re.fullmatch(r"(/[\w.:-]+)+", path):
                        out.add(path)
    return frozenset(out)


def _segments(path: str) -> list[str]:
    return [("*" if re.fullmatch(r"\{[^}]*\}|<[^>]*>|\*", s) else s)
            for s in path.strip("/").split("/")]


def route_served(path: str) -> bool:
    doc = _segments(path)
    for route in served_routes() | called_routes():
        rest = re.fullmatch(r"(.*)/\{\w+:path\}", route)
        want = _segments(rest.group(1) if rest else route)
        if rest:  # the last segment takes the rest of the path
            if len(doc) <= len(want):
                continue
            doc_cut = doc[:len(want)]
        elif len(doc) != len(want):
            continue
        else:
            doc_cut = doc
        if all(a == b or "*" in (a, b) for a, b in zip(doc_cut, want, strict=True)):
            return True
    return False


CODE_SPAN = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
BASE = r"(?:https?://[^/\s`]+|\{[\w.]+\}|\$\{?\w+\}?|<[\w-]+>)"
SPAN_ROUTE = re.compile(rf"(?:(?P<method>{'|'.join(METHODS)})\s+)?{BASE}?(?P<path>/[^\s`]*)")
LOCAL_URL = re.compile(r"https?://(?:127\.0\.0\.1|localhost|0\.0\.0\.0|\$\{?\w+\}?|\{[\w.]+\}|"
                       r"<[\w-]+>)(?::[\w${}]+)?(?P<path>/[^\s`'\")\]]*)")


def _clean(path: str) -> str:
    return path.split("?")[0].split("#")[0].rstrip(".,;:)").rstrip("/") or "/"


@functools.cache
def route_roots() -> frozenset[str]:
    return frozenset(_segments(r)[0] for r in served_routes())


def routes_named(text: str) -> set[str]:
    """The route paths a text names (see the module doc for the rule)."""
    out = set()
    prose = FENCE.sub("", text)
    for m in CODE_SPAN.finditer(prose):
        span = m.group(1).strip()
        r = SPAN_ROUTE.fullmatch(span) or SPAN_ROUTE.fullmatch(span.split(" ", 2)[0]) \
            or SPAN_ROUTE.match(span)
        if r is None or not r.group("path").startswith("/"):
            continue
        path = _clean(r.group("path"))
        if r.group("method") or _segments(path)[0] in route_roots():
            out.add(path)
    for m in LOCAL_URL.finditer(text):
        path = _clean(m.group("path"))
        if path != "/":
            out.add(path)
    return out


# ---------------------------------------------------------------- the tests


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_every_module_named_exists(doc: Path) -> None:
    bad = module_names(doc.read_text())
    assert not bad, f"{doc_id(doc)} names modules or names that do not exist: {sorted(set(bad))}"


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_every_repository_file_named_exists(doc: Path) -> None:
    bad = repo_paths(doc, doc.read_text())
    assert not bad, f"{doc_id(doc)} names files that are not in the repository: {sorted(set(bad))}"


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_every_route_named_is_served(doc: Path) -> None:
    bad = sorted(p for p in routes_named(doc.read_text()) if not route_served(p))
    assert not bad, (f"{doc_id(doc)} names routes the code neither serves nor calls: {bad} "
                     "(see this module's doc for what counts as a route)")


def test_the_rules_catch_made_up_names() -> None:
    """The checks above fail on names that do not exist (and pass on ones that do)."""
    text = ("`rlfleet.frontend.router.WorkerPool` `rlfleet.nothing.here` "
            "`rlfleet.protocol.admin.NoSuchRoute` `rlfleet/worker/admin.py` "
            "`rlfleet/worker/nothing.py` `frontend/nowhere.py` `rlfleet.ready` "
            "`tests.clients.one_url` `tests.clients.no_such_fixture`")
    assert sorted(module_names(text)) == ["frontend/nowhere.py", "rlfleet.nothing.here",
                                          "rlfleet.protocol.admin.NoSuchRoute",
                                          "rlfleet/worker/nothing.py",
                                          "tests.clients.no_such_fixture"]
    spans = ("`POST /v1/chat/completions` `{system_url}/engine/pause_generation` "
             "`/engine/<route>` `GET /v1/made_up` `/engine/made_up` `/fanout/<version>/stream` "
             "`http://127.0.0.1:8001/v1/rl/workers` `/tmp/models` `POST /made_up_root`")
    named = routes_named(spans)
    assert "/tmp/models" not in named  # a file path, not a route
    assert sorted(p for p in named if not route_served(p)) == [
        "/engine/made_up", "/made_up_root", "/v1/made_up"]
