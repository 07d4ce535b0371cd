"""Stage checkpoints: what a long extraction computed, kept in its journal so a resumed run skips the work.

The journal (:mod:`.journal`) keeps every answer, so a resumed run asks nothing twice; but at MiniLM's size
the block method's *computation* (fits of hundreds of thousands of parameters) is hours, which a replay of
the answers alone would redo. A method that checkpoints stores, after each expensive stage, the stage's
results and the random generator's state under the stage's name; a resumed run with the same journal
restores the latest stage and goes on from there. What a checkpoint restores is what the stage computed
from the same answers, so the run's result is the one an uninterrupted run gives (a refit cut between two
checkpoints goes on from the last, its L-BFGS memory drawn afresh: said in its figures).

Format: ``checkpoints(name TEXT PRIMARY KEY, code TEXT, blob BLOB, checksum BLOB)`` in the journal's SQLite
file; ``blob`` a pickle of plain data (numpy arrays, dicts, lists, numbers, strings) and headthief's own
dataclasses, ``code`` the :func:`code_fingerprint` of the code that wrote it. A checkpoint written by other
code is not used (the stage is computed again, its answers from the journal). Unpickling is restricted
(:class:`_Restricted`): a journal whose checkpoint names any other callable is refused with
:class:`CheckpointError`, so a crafted journal cannot run code.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import hashlib
import io
import pickle
import types
from pathlib import Path

from ..errors import HeadthiefError

_NUMPY = {("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "_reconstruct"),
          ("numpy._core.multiarray", "_reconstruct"), ("numpy.core.multiarray", "scalar"),
          ("numpy._core.multiarray", "scalar"), ("numpy.core.numeric", "_frombuffer"),
          ("numpy._core.numeric", "_frombuffer")}
_BUILTINS = {"dict", "list", "tuple", "set", "frozenset", "complex", "slice", "range", "bytearray", "float", "int",
             "bool", "str", "bytes"}
_COPYREG = {"__newobj__", "_reconstructor"}


class CheckpointError(HeadthiefError):
    """A stage checkpoint cannot be used: damaged, or it names something other than plain data."""


class _Restricted(pickle.Unpickler):
    """Unpickles numpy arrays, scalars and dtypes, builtin containers and headthief's dataclasses and enums;
    nothing else (no function, no other class)."""

    def find_class(self, module: str, name: str):
        if ((module, name) in _NUMPY or (module == "builtins" and name in _BUILTINS)
                or (module == "copyreg" and name in _COPYREG) or (module == "_codecs" and name == "encode")
                or (module == __name__ and name == "read_only")):
            return super().find_class(module, name)
        if module == "numpy" or module.startswith("numpy."):       # scalar and dtype classes (np.float64, ...)
            import numpy as np
            obj = super().find_class(module, name)
            if isinstance(obj, type) and issubclass(obj, (np.generic, np.dtype)):
                return obj
        if module == "headthief" or module.startswith("headthief."):
            obj = super().find_class(module, name)
            if isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)):
                return obj
        raise CheckpointError(f"a checkpoint names {module}.{name}, which is not plain data: refused "
                              "(a journal written by another program?)")


class _Pickler(pickle.Pickler):
    """Pickles read-only mappings (the frozen results' ``MappingProxyType`` fields) as what they wrap."""

    def reducer_override(self, obj):
        if type(obj) is types.MappingProxyType:
            return read_only, (dict(obj),)
        return NotImplemented


def read_only(mapping: dict) -> types.MappingProxyType:
    """A read-only view of ``mapping`` (how a checkpoint rebuilds a frozen result's mapping fields)."""
    return types.MappingProxyType(mapping)


def dumps(obj) -> bytes:
    buf = io.BytesIO()
    _Pickler(buf, protocol=5).dump(obj)
    return buf.getvalue()


def loads(blob: bytes):
    """The object :func:`dumps` wrote; :class:`CheckpointError` if it names anything but plain data."""
    try:
        return _Restricted(io.BytesIO(blob)).load()
    except CheckpointError:
        raise
    except Exception as e:                              # a torn or foreign blob: any unpickling error
        raise CheckpointError(f"a checkpoint cannot be read ({type(e).__name__}: {e})") from None


def code_fingerprint(*modules: str) -> str:
    """A hash of the code that ``modules`` (dotted names under headthief, e.g. ``extraction.block.extract``) run:
    their own and every headthief module they import, directly or not (:func:`module_closure`), each as its
    syntax tree without docstrings. A checkpoint is used only by the code that wrote it; an edit elsewhere in
    the package, or to a docstring or a comment, keeps it."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.blake2b(digest_size=12)
    trees = _parsed_closure(root, [root.joinpath(*m.split(".")).with_suffix(".py") for m in modules])
    for f in sorted(trees):
        h.update(str(f.relative_to(root)).encode())
        h.update(ast.dump(trees[f], include_attributes=False).encode())
    return h.hexdigest()


def code_of(source: str) -> str:
    """The syntax tree of ``source`` without docstrings and positions (``ast.dump``): equal for two sources that
    differ only in comments, docstrings, blank lines or line breaks inside an expression."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        _strip_docstring(node)
    return ast.dump(tree, include_attributes=False)


def _strip_docstring(node: ast.AST) -> None:
    """Remove ``node``'s docstring, if it has one (in place)."""
    body = getattr(node, "body", None)
    if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
            and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)):
        node.body = body[1:] or ([] if isinstance(node, ast.Module) else [ast.Pass()])


def module_closure(root: Path, files: list[Path]) -> list[Path]:
    """``files`` and every module of the package at ``root`` they import (relative or ``headthief.``
    imports, at any depth, inside functions too), sorted."""
    return sorted(_parsed_closure(root, files))


def _parsed_closure(root: Path, files: list[Path]) -> dict[Path, ast.Module]:
    """:func:`module_closure`'s modules, each with its syntax tree without docstrings (:func:`code_of`'s):
    every file read, parsed and walked once."""
    trees: dict[Path, ast.Module] = {}
    todo = [Path(f) for f in files]
    while todo:
        f = todo.pop()
        if f in trees:
            continue
        if not f.is_file():
            raise FileNotFoundError(f"no module {f}")
        trees[f] = tree = ast.parse(f.read_text())
        for node in ast.walk(tree):
            _strip_docstring(node)
            todo += [t for t in _imported(root, f, node) if t not in trees]
    return trees


def _imported(root: Path, f: Path, node: ast.AST) -> list[Path]:
    """The package's module files an import statement ``node`` in file ``f`` names."""
    names: list[tuple[Path, list[str]]] = []
    if isinstance(node, ast.ImportFrom):
        if node.level:
            base = f.parent
            for _ in range(node.level - 1):
                base = base.parent
        elif node.module and node.module.split(".")[0] == root.name:
            base = root.parent
        else:
            return []
        target = base.joinpath(*node.module.split(".")) if node.module else base
        names.append((target, [a.name for a in node.names]))
    elif isinstance(node, ast.Import):
        names += [(root.parent.joinpath(*a.name.split(".")), []) for a in node.names
                  if a.name.split(".")[0] == root.name]
    out = []
    for target, members in names:
        cands = [target.with_suffix(".py"), target / "__init__.py"] + [target / f"{m}.py" for m in members]
        out += [c for c in cands if c.is_file()]
    return out


def checkpoint_blob_checksum(name: str, code: str, blob: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=8)
    for part in (name.encode(), b"\0", code.encode(), b"\0", blob):
        h.update(part)
    return h.digest()


__all__ = ["CheckpointError", "code_fingerprint", "code_of", "dumps", "loads", "module_closure"]
