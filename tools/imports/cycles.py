#!/usr/bin/env python3
"""Finds import cycles between the files of each crate: file A refers to an item of file B (through `crate::`,
`super::`, `self::` or a child module's name) and B, directly or through others, to A. A file's references
into its own submodules (the files it declares with `mod`) are the module tree, not a dependency that can
close a cycle: a crate root or mod.rs may re-export and call its children while they use its shared items.
Prints each cycle and exits 1 if there is one; `--self-test` checks the checker on small made-up crates.

Usage: cycles.py [--skip DIR]... [CRATE_DIR]...   (default: every crate under crates/, plus tools/fuzz)

It reads source as text (comments and string literals removed), so it follows modules declared with `mod x;`
from each crate root (src/lib.rs, src/main.rs, src/bin, tests, benches, examples) and inline `mod x { }`.
"""

import os
import re
import sys
import tempfile

IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def strip(text):
    """The source with comments, string and char literals blanked (newlines kept, so positions stay)."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif re.match(r'b?r#*"', text[i:i + 40]) and not (i and (text[i - 1].isalnum() or text[i - 1] == "_")):
            m = re.match(r'b?r(#*)"', text[i:])
            end = text.find('"' + m.group(1), i + m.end())
            j = n if end < 0 else end + 1 + len(m.group(1))
            out.append('""' + re.sub(r"[^\n]", " ", text[i + 2:j]))
            i = j
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append('""' + re.sub(r"[^\n]", " ", text[i + 2:j + 1]))
            i = j + 1
        elif c == "'":
            # A char literal ('x', '\n', '\u{1F600}') and not a lifetime ('a).
            m = re.match(r"'(\\u\{[0-9a-fA-F]+\}|\\.|[^\\'])'", text[i:])
            if m:
                out.append(" " * m.end())
                i += m.end()
            else:
                out.append(c)
                i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


class Crate:
    def __init__(self, root_dir):
        self.dir = root_dir
        self.modules = {}  # module path (tuple) -> file
        self.files = {}  # file -> (module path of the file, stripped text)
        self.scopes = {}  # file -> its inline modules' (start, end, name)

    def add_root(self, path, prefix):
        self.add_file(path, prefix)

    def add_file(self, path, modpath):
        if path in self.files:
            return
        text = strip(open(path, encoding="utf-8").read())
        self.files[path] = (modpath, text)
        self.modules[modpath] = path
        base = os.path.basename(path)
        if base in ("lib.rs", "main.rs", "mod.rs") or modpath == ():
            folder = os.path.dirname(path)
        else:
            folder = path[:-3]
        # Inline modules are registered by their extents; `mod x;` at any depth of the file is found by name.
        for m in re.finditer(r"\bmod\s+(\w+)\s*([;{])", text):
            inner = self.inline_path(path, m.start())
            if m.group(2) == "{":
                self.modules.setdefault(inner + (m.group(1),), path)
                continue
            sub = os.path.join(folder, *inner[len(modpath):], m.group(1))
            for cand in (sub + ".rs", os.path.join(sub, "mod.rs")):
                if os.path.exists(cand):
                    self.add_file(cand, inner + (m.group(1),))
                    break

    def inline_path(self, path, pos):
        """The module path at byte `pos` of `path`: the file's, plus the inline modules around `pos`."""
        modpath, text = self.files[path]
        if path not in self.scopes:
            scopes, stack = [], []
            for m in re.finditer(r"\bmod\s+(\w+)\s*\{|[{}]", text):
                if m.group(0) == "}":
                    if stack:
                        start, name = stack.pop()
                        if name:
                            scopes.append((start, m.start(), name))
                else:
                    stack.append((m.start(), m.group(1)))
            self.scopes[path] = sorted(scopes)
        return modpath + tuple(name for start, end, name in self.scopes[path] if start <= pos < end)

    def resolve(self, segments):
        """The file of the deepest module a path's leading segments name, if any."""
        for k in range(len(segments), -1, -1):
            if tuple(segments[:k]) in self.modules:
                return self.modules[tuple(segments[:k])]
        return None

    def edges(self):
        out = {f: set() for f in self.files}
        for path, (modpath, text) in self.files.items():
            for start, segs in references(text):
                here = list(self.inline_path(path, start))
                children = {m[-1] for m in self.modules if len(m) == len(here) + 1 and list(m[:-1]) == here}
                target = absolute(here, segs, children)
                f = target is not None and self.resolve(target)
                if f and f != path and not below(self.files[f][0], modpath):
                    out[path].add(f)
        return out


def below(module, parent):
    """Whether `module` is inside `parent` (a file's own submodules, which it declares, are not a cycle's)."""
    return len(module) > len(parent) and module[:len(parent)] == parent


def use_tree(text, i):
    """Parses a use tree at `i` (`a::b`, `a::{b, c::d}`, `*`): its paths as lists of segments, and its end."""
    def tree(i):
        while i < len(text) and text[i].isspace():
            i += 1
        if text.startswith("{", i):
            paths, i = [], i + 1
            while True:
                while i < len(text) and text[i] in " \t\r\n,":
                    i += 1
                if i >= len(text) or text[i] == "}":
                    return paths, i + 1
                sub, i = tree(i)
                paths += sub
        m = IDENT.match(text, i)
        if not m:
            return [[]], i + (text.startswith("*", i))
        i = m.end()
        j = i
        while j < len(text) and text[j].isspace():
            j += 1
        if text.startswith("::", j):
            sub, i = tree(j + 2)
            return [[m.group(0)] + s for s in sub], i
        return [[m.group(0)]], i

    return tree(i)


def references(text):
    """Every path that starts at a path root in `text` (not inside another's braces): (position, segments)."""
    end = 0
    for m in re.finditer(r"(?<![\w:])([a-z_][a-z0-9_]*)\s*::", text):
        if m.start() < end:
            continue
        paths, end = use_tree(text, m.start())
        for segs in paths:
            yield m.start(), segs


def absolute(here, segs, children):
    """A path's segments as an absolute module path from module `here`, or None (another crate, a type)."""
    if not segs:
        return None
    head = segs[0]
    if head == "crate":
        return segs[1:]
    if head in ("self", "super"):
        at = list(here)
        while segs and segs[0] in ("self", "super"):
            if segs[0] == "super":
                if not at:
                    return None
                at.pop()
            segs = segs[1:]
        return at + [s for s in segs if s != "self"]
    if head in children:
        return here + [s for s in segs if s != "self"]
    return None


def crate_roots(crate_dir):
    roots = []
    for rel in ("src/lib.rs", "src/main.rs"):
        if os.path.exists(os.path.join(crate_dir, rel)):
            roots.append(os.path.join(crate_dir, rel))
    for sub in ("src/bin", "tests", "benches", "examples", "fuzz_targets"):
        d = os.path.join(crate_dir, sub)
        if os.path.isdir(d):
            roots += sorted(os.path.join(d, f) for f in os.listdir(d) if f.endswith(".rs"))
    return roots


def cycles(graph):
    """The strongly connected components of more than one file (Tarjan), each sorted."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def check(crate_dir):
    """The cycles among the files of each crate root under `crate_dir`, as lists of (file, files it uses)."""
    out = []
    for root in crate_roots(crate_dir):
        crate = Crate(crate_dir)
        crate.add_root(root, ())
        graph = crate.edges()
        for comp in cycles(graph):
            out.append([(f, sorted(g for g in graph[f] if g in comp)) for f in comp])
    return out


def self_test():
    cases = {
        # name: (files, expected number of cycles)
        "siblings": ({"src/lib.rs": "mod a;\nmod b;\n", "src/a.rs": "use crate::b::X;\n",
                      "src/b.rs": "pub struct X;\nuse crate::a;\n"}, 1),
        "through a parent": ({"src/lib.rs": "mod a;\nmod b;\n", "src/a.rs": "mod c;\npub struct S;\n",
                              "src/a/c.rs": "use crate::b::B;\npub struct C;\n",
                              "src/b.rs": "pub struct B;\nfn f() { let _ = crate::a::c::C; }\n"}, 1),
        "a root and its children": ({"src/lib.rs": "mod a;\npub struct S;\nfn f() { a::g() }\n",
                                     "src/a.rs": "pub fn g() { let _ = crate::S; }\n"}, 0),
        "groups and super": ({"src/lib.rs": "mod d;\n", "src/d/mod.rs": "mod x;\nmod y;\n",
                              "src/d/x.rs": "use super::{y::{self, Y}};\n",
                              "src/d/y.rs": "pub struct Y;\nfn f() { super::x::g() }\n"}, 1),
        "a chain, tests and strings": ({"src/lib.rs": "mod a;\nmod b;\npub use a::A;\n",
                                        "src/a.rs": "use crate::b::B;\npub struct A;\n"
                                                    "// crate::lib::x, crate::b\n"
                                                    "#[cfg(test)]\nmod tests {\n    use super::*;\n}\n",
                                        "src/b.rs": "pub struct B;\nconst S: &str = \"crate::a::A {\";\n"
                                                    "fn f() -> char { '{' }\n"}, 0),
    }
    bad = 0
    for name, (files, want) in cases.items():
        with tempfile.TemporaryDirectory() as d:
            for rel, text in files.items():
                os.makedirs(os.path.dirname(os.path.join(d, rel)), exist_ok=True)
                with open(os.path.join(d, rel), "w") as f:
                    f.write(text)
            got = len(check(d))
        if got != want:
            print(f"self-test {name!r}: {got} cycles found, {want} expected")
            bad += 1
    print("cycles.py self-test:", "failed" if bad else "ok")
    return 1 if bad else 0


def main(args):
    if args == ["--self-test"]:
        return self_test()
    skip = set()
    dirs = []
    while args:
        a = args.pop(0)
        if a == "--skip":
            skip.add(os.path.normpath(args.pop(0)))
        else:
            dirs.append(a)
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if not dirs:
        crates = os.path.join(repo, "crates")
        dirs = [os.path.join(crates, c) for c in sorted(os.listdir(crates))
                if os.path.exists(os.path.join(crates, c, "Cargo.toml"))]
        dirs.append(os.path.join(repo, "tools", "fuzz"))
    found = 0
    for d in dirs:
        if os.path.normpath(os.path.relpath(d, repo)) in skip:
            continue
        for comp in check(d):
            found += 1
            print(f"import cycle in {os.path.relpath(d, repo)}:")
            for f, uses in comp:
                print(f"  {os.path.relpath(f, d)} uses {', '.join(os.path.relpath(u, d) for u in uses)}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
