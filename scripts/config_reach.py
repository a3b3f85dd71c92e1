"""Where the whole ``TrainConfig`` object goes: a static walk of the calls that hand it on.

    .venv/bin/python scripts/config_reach.py [REV ...]     # default: . (the work tree)

Starts where the training notebook hands the config over (``Experiment.prepare(config)``, and
``self.config`` inside ``Experiment``'s methods, which reach the compiled step) and follows every
call that passes the object itself on, positionally or by keyword, into ``gemmalab/``. Its values
(``config.lora.rank``) and groups (``config.lora``) are not followed: they are what a function
should take instead of the whole object. Prints, per revision, the functions and modules (rooms)
the object reaches and the call chain. Read from ``git show`` of each revision, so one checkout
compares any two commits. Issue 43's proof; not part of the package.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import deque

PACKAGE = "gemmalab"
START = ("gemmalab/train/experiment.py", "Experiment.prepare", "config")


def sources(rev: str) -> dict[str, ast.Module]:
    """The package's parsed files at ``rev``; ``.`` is the work tree as it stands."""
    if rev == ".":
        from pathlib import Path

        return {str(p): ast.parse(p.read_text()) for p in sorted(Path(PACKAGE).rglob("*.py"))}
    names = subprocess.run(["git", "ls-tree", "-r", "--name-only", rev, PACKAGE],
                           capture_output=True, text=True, check=True).stdout.split()
    return {name: ast.parse(subprocess.run(["git", "show", f"{rev}:{name}"], capture_output=True,
                                           text=True, check=True).stdout)
            for name in names if name.endswith(".py")}


def module_of(path: str) -> str:
    dotted = path[:-3].replace("/", ".")
    return dotted[: -len(".__init__")] if dotted.endswith(".__init__") else dotted


class House:
    """The package's functions by (file, qualified name), and each file's imported names."""

    def __init__(self, trees: dict[str, ast.Module]):
        self.trees = trees
        self.file_of = {module_of(path): path for path in trees}
        self.functions: dict[tuple[str, str], ast.FunctionDef] = {}
        self.imports: dict[str, dict[str, str]] = {}  # file -> local name -> dotted target
        for path, tree in trees.items():
            for node in tree.body:
                self._define(path, node, "")
            self.imports[path] = self._imports(path, tree)

    def _define(self, path: str, node: ast.stmt, prefix: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            self.functions[(path, prefix + node.name)] = node
        elif isinstance(node, ast.ClassDef):
            for child in node.body:
                self._define(path, child, f"{node.name}.")

    def _imports(self, path: str, tree: ast.Module) -> dict[str, str]:
        names: dict[str, str] = {}
        package = module_of(path).rsplit(".", 1)[0] if not path.endswith("__init__.py") \
            else module_of(path)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                for alias in node.names:
                    names[alias.asname or alias.name] = f"{base}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        names[alias.asname] = alias.name
        return names

    def resolve(self, path: str, scope: str, callee: ast.expr) -> list[tuple[str, str]]:
        """The package functions a call's callee names (both arms of ``a if c else b``)."""
        if isinstance(callee, ast.IfExp):
            return self.resolve(path, scope, callee.body) + self.resolve(path, scope, callee.orelse)
        cls = scope.split(".")[0] if "." in scope else None
        if isinstance(callee, ast.Name):
            if (path, callee.id) in self.functions:
                return [(path, callee.id)]
            return self._dotted(self.imports[path].get(callee.id, ""))
        if isinstance(callee, ast.Attribute):
            owner = callee.value
            if isinstance(owner, ast.Name):
                if owner.id in ("self", "cls") and cls:
                    return [(path, f"{cls}.{callee.attr}")] \
                        if (path, f"{cls}.{callee.attr}") in self.functions else []
                if (path, f"{owner.id}.{callee.attr}") in self.functions:  # Class.method
                    return [(path, f"{owner.id}.{callee.attr}")]
                target = self.imports[path].get(owner.id)
                if target:
                    return self._dotted(f"{target}.{callee.attr}")
        return []

    def _dotted(self, dotted: str) -> list[tuple[str, str]]:
        """``gemmalab.a.b.f`` or ``gemmalab.a.b.Class.method`` as a known function."""
        parts = dotted.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            path = self.file_of.get(".".join(parts[:cut]))
            if path and (path, ".".join(parts[cut:])) in self.functions:
                return [(path, ".".join(parts[cut:]))]
            if path and cut == len(parts) - 1:  # a name re-exported by a package's __init__
                target = self.imports.get(path, {}).get(parts[-1])
                if target and target != dotted:
                    return self._dotted(target)
        return []


def holds(node: ast.expr, names: set[str], holder_attr: bool) -> bool:
    """Whether an expression is the config object itself."""
    if isinstance(node, ast.Name):
        return node.id in names
    if holder_attr and isinstance(node, ast.Attribute) and node.attr == "config" \
            and isinstance(node.value, ast.Name) and node.value.id == "self":
        return True
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
            and node.func.attr == "replace":  # config.replace(...) is a config again
        return holds(node.func.value, names, holder_attr)
    return False


def parameter_at(function: ast.FunctionDef, index: int | None, keyword: str | None) -> str | None:
    positional = [a.arg for a in function.args.posonlyargs + function.args.args]
    if positional and positional[0] in ("self", "cls"):
        positional = positional[1:]
    if keyword is not None:
        return keyword
    return positional[index] if index is not None and index < len(positional) else None


def walk(house: House) -> tuple[set[tuple[str, str]], list[tuple[str, str, str]]]:
    holder = START[1].split(".")[0]
    seeds = [(START[0], START[1], START[2])]
    # Experiment keeps the config: each of its methods that reads self.config holds it.
    seeds += [(START[0], name, "") for (path, name) in house.functions
              if path == START[0] and name.startswith(holder + ".")]
    reached: set[tuple[str, str]] = set()
    edges: list[tuple[str, str, str]] = []
    queue = deque(seeds)
    seen: set[tuple[str, str, str]] = set()
    while queue:
        path, name, param = queue.popleft()
        if (path, name, param) in seen:
            continue
        seen.add((path, name, param))
        function = house.functions[(path, name)]
        holder_attr = name.startswith(holder + ".") and path == START[0]
        names = {param} if param else set()
        for node in ast.walk(function):  # aliases: x = config
            if isinstance(node, ast.Assign) and holds(node.value, names, holder_attr):
                names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        found = False
        for node in ast.walk(function):
            if not isinstance(node, ast.Call):
                continue
            passes = [(i, None) for i, a in enumerate(node.args) if holds(a, names, holder_attr)]
            passes += [(None, k.arg) for k in node.keywords
                       if k.arg and holds(k.value, names, holder_attr)]
            if not passes:
                continue
            found = True
            for callee in house.resolve(path, name, node.func):
                target = house.functions[callee]
                for index, keyword in passes:
                    arg = parameter_at(target, index, keyword)
                    if arg:
                        edges.append((f"{path}:{name}", f"{callee[0]}:{callee[1]}", arg))
                        queue.append((callee[0], callee[1], arg))
        uses = found or any(holds(n, names, holder_attr) for n in ast.walk(function)
                            if isinstance(n, ast.expr))
        if param or uses:
            reached.add((path, name))
    return reached, edges


def main() -> None:
    for rev in sys.argv[1:] or ["."]:
        reached, edges = walk(House(sources(rev)))
        rooms = sorted({path for path, _ in reached})
        print(f"{rev}: the whole config reaches {len(reached)} functions in {len(rooms)} rooms")
        for room in rooms:
            print(f"  {room}: {', '.join(sorted(n for p, n in reached if p == room))}")
        print("  calls that hand it on:")
        for caller, callee, arg in sorted(set(edges)):
            print(f"    {caller} -> {callee} (as {arg})")


if __name__ == "__main__":
    main()
