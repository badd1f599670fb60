"""Write ~1 MB of English prose found on every machine with Python: the interpreter's documentation topics
(pydoc_data) followed by the docstrings of the standard library, in a fixed order.

    python benchmarks/make_english_corpus.py /tmp/english.txt [--bytes 1000000]
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path
from pydoc_data.topics import topics

from swarmtrain.data import stdlib_root


def docstrings(root: Path):
    for path in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 200:
                    yield doc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--bytes", type=int, default=1_000_000)
    args = parser.parse_args()
    parts, size = [], 0
    for text in [topics[k] for k in sorted(topics)] + list(docstrings(stdlib_root())):
        parts.append(text)
        size += len(text.encode()) + 2
        if size >= args.bytes:
            break
    data = "\n\n".join(parts).encode()[: args.bytes]
    args.out.write_bytes(data)
    print(f"wrote {len(data):,} bytes of English text to {args.out}")


if __name__ == "__main__":
    main()
