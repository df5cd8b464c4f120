#!/usr/bin/env python3
"""Which third-party packages SGLang imports when an Engine starts, read from its source.

Walks module-level imports (not those inside functions, nor those in a ``try`` whose
``except`` catches ImportError) from the modules an ``sglang.Engine`` loads for a Llama
model, following ``sglang.*`` imports, and prints the third-party top-level names it meets.
A static walk: dynamic imports (the model registry, backends picked at run time) are roots.

    python bench/sglang_kit/imports_check.py UNPACKED_SGLANG_WHEEL_DIR
"""
from __future__ import annotations

import ast
import os
import sys

ROOTS = [
    "sglang", "sglang.srt.entrypoints.engine", "sglang.srt.managers.scheduler",
    "sglang.srt.managers.detokenizer_manager", "sglang.srt.managers.tokenizer_manager",
    "sglang.srt.model_executor.model_runner", "sglang.srt.models.llama", "sglang.srt.models.qwen2",
    "sglang.srt.constrained.xgrammar_backend", "sglang.srt.layers.attention.flashattention_backend",
    "sglang.srt.layers.attention.triton_backend", "sglang.srt.layers.sampler",
    "sglang.srt.model_loader.loader",
]


def module_file(root: str, name: str) -> str | None:
    base = os.path.join(root, *name.split("."))
    for path in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.exists(path):
            return path
    return None


def catches_import_error(node: ast.Try) -> bool:
    for handler in node.handlers:
        names = []
        if handler.type is None:
            return True
        for n in ast.walk(handler.type):
            if isinstance(n, ast.Name):
                names.append(n.id)
        if {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"} & set(names):
            return True
    return False


def top_imports(path: str, package: str) -> list[str]:
    tree = ast.parse(open(path, encoding="utf-8").read())
    found: list[str] = []

    def visit(nodes):
        for node in nodes:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if isinstance(node, ast.ClassDef):
                    visit(node.body)
                continue
            if isinstance(node, ast.Try):
                if not catches_import_error(node):
                    visit(node.body)
                visit(node.finalbody)
                continue
            if isinstance(node, ast.If):
                test = ast.unparse(node.test)
                if "TYPE_CHECKING" in test:
                    continue
                visit(node.body)
                visit(node.orelse)
                continue
            if isinstance(node, ast.Import):
                found.extend(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1])
                    mod = f"{base}.{node.module}" if node.module else base
                    found.append(mod)
                    found.extend(f"{mod}.{a.name}" for a in node.names)
                elif node.module:
                    found.append(node.module)
                    found.extend(f"{node.module}.{a.name}" for a in node.names)
            elif hasattr(node, "body") and isinstance(getattr(node, "body"), list):
                visit(node.body)

    visit(tree.body)
    return found


def main() -> None:
    root = sys.argv[1]
    seen: set[str] = set()
    third: dict[str, str] = {}
    todo = list(ROOTS)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        path = module_file(root, name)
        if path is None:
            continue
        package = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
        # importing a submodule imports its parents
        parts = name.split(".")
        todo.extend(".".join(parts[:i]) for i in range(1, len(parts)))
        for imp in top_imports(path, package):
            top = imp.split(".")[0]
            if top == "sglang":
                todo.append(imp)
            elif top not in sys.stdlib_module_names and top not in third:
                third[top] = name
    for top, where in sorted(third.items()):
        print(f"{top}\t<- {where}")


if __name__ == "__main__":
    main()
